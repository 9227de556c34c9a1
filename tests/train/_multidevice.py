"""Checks that need 8 CPU devices; run by test_sharding.py in a subprocess:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m tests.train._multidevice CHECK

Each check asserts and prints "OK <check>" at the end.
"""

import os
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxtorch
from jaxtorch.train import DeviceLoader, load_checkpoint, make_train_step, save_checkpoint, shard, shard_batch

from ._models import MLP

MEGATRON = [(r"fc1\.weight$", P("model", None)), (r"fc1\.bias$", P("model")), (r"fc2\.weight$", P(None, "model"))]


def mse(o, y):
    return jnp.mean((o - y) ** 2)


def _batches(n=4, rows=16):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, 8, generator=g), torch.randn(rows, 4, generator=g)) for _ in range(n)]


def _train(model, mesh=None, rules=()):
    init, step = make_train_step(model, mse, optax.adam(1e-2))
    state = init()
    if mesh is not None:
        state = shard(state, mesh, rules)
    losses = []
    for x, y in _batches():
        if mesh is not None:
            x, y = shard_batch((x, y), mesh, "data")
        state, loss = step(state, x, y)
        losses.append(float(loss))
    return state, losses


def check_parallel():
    assert jax.device_count() == 8
    torch.manual_seed(0)
    model = MLP()
    params, fn = jaxtorch.extract(model)
    x = jnp.asarray(_batches(1)[0][0].numpy())
    ref_out = fn(params, x)
    ref_state, ref_losses = _train(model)
    for shape, rules in [((8, 1), ()), ((1, 8), MEGATRON), ((2, 4), MEGATRON)]:
        mesh = Mesh(np.array(jax.devices()).reshape(shape), ("data", "model"))
        sp = shard(params, mesh, rules)
        out = jax.jit(fn)(sp, shard_batch(x, mesh))
        np.testing.assert_allclose(out, ref_out, atol=1e-5, err_msg=str(shape))
        state, losses = _train(model, mesh, rules)
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, err_msg=str(shape))
        for k in ref_state.params:
            np.testing.assert_allclose(state.params[k], ref_state.params[k], atol=1e-5, err_msg=f"{shape} {k}")
        w = state.params["fc1.weight"]
        if rules:  # parameters and their Adam moments stay split like the rules say
            assert w.sharding.is_equivalent_to(NamedSharding(mesh, P("model", None)), 2), w.sharding
            assert w.addressable_shards[0].data.shape == (16 // shape[1], 8)
            mu = state.opt_state[0].mu["fc2.weight"]
            assert mu.addressable_shards[0].data.shape == (4, 16 // shape[1])
        else:
            assert w.sharding.is_fully_replicated
    print("OK parallel")


def check_checkpoint():
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    torch.manual_seed(0)
    init, _ = make_train_step(MLP(), mse, optax.adam(1e-2))
    state = shard(init(), mesh, MEGATRON)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "ckpt.safetensors")
        save_checkpoint(state, path)
        plain = load_checkpoint(path)
        back = load_checkpoint(path, shardings=state)
    for a, b, c in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(plain)):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)
        assert b.sharding.is_equivalent_to(a.sharding, a.ndim)
        assert len(c.sharding.device_set) == 1
    print("OK checkpoint")


def check_xla():
    import jaxtorch.xla as xm

    jaxtorch.enable_globally()
    t = torch.ones(3).to("jax:1")
    assert t.elem.devices() == {jax.devices()[1]}, t.elem.devices()
    assert xm.xla_device(3) == torch.device("jax", 3)
    u = xm.send_to_device(torch.ones(3), xm.xla_device(3))
    assert u.elem.devices() == {jax.devices()[3]}
    ds = torch.utils.data.TensorDataset(torch.arange(64.0).reshape(32, 2), torch.arange(32))
    loader = torch.utils.data.DataLoader(ds, batch_size=16)
    seen = []
    for x, y in xm.ParallelLoader(loader):
        assert xm.is_xla_tensor(x) and xm.is_xla_tensor(y)
        assert len(x.elem.sharding.device_set) == 8 and x.elem.addressable_shards[0].data.shape == (2, 2)
        seen.append(x.cpu())
    np.testing.assert_array_equal(torch.cat(seen).numpy(), np.arange(64.0).reshape(32, 2))
    placed = list(DeviceLoader([(np.ones((8, 3)),)], Mesh(np.array(jax.devices()[:4]), ("data",))))
    assert placed[0][0].sharding.spec == P("data") and len(placed[0][0].sharding.device_set) == 4
    print("OK xla")


def check_factory_placement():
    jaxtorch.enable_globally()
    for make in (torch.ones, torch.zeros, torch.randn):
        t = make(3, device="jax:2")
        assert t.elem.devices() == {jax.devices()[2]}, (make.__name__, t.elem.devices())
    print("OK factory_placement")


if __name__ == "__main__":
    globals()[f"check_{sys.argv[1]}"]()
