"""Checks that need 8 CPU devices; run by test_sharding.py in a subprocess:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m tests.train._multidevice CHECK

Each check asserts and prints "OK <check>" at the end.
"""

import contextlib
import copy
import os
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

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


# Megatron rules for a Llama: q/k/v/gate/up split by output columns, o/down by input rows.
LLAMA_TP = [
    (r"(q_proj|k_proj|v_proj|gate_proj|up_proj)\.weight$", P("model", None)),
    (r"(o_proj|down_proj)\.weight$", P(None, "model")),
]


def _llama():
    from tests._hf_models import tiny_llama

    torch.manual_seed(0)
    return tiny_llama(max_position_embeddings=32, use_cache=False).eval()


def _lm_loss(out, ids):
    return optax.softmax_cross_entropy_with_integer_labels(out.logits[:, :-1], ids[:, 1:]).mean()


def _llama_run(model, ids, mesh=None):
    """Jitted logits and three Adam steps of a Llama, on `mesh` (tensor x data parallel) or one device."""
    params, fn = jaxtorch.extract(model)
    init, step = make_train_step(model, _lm_loss, optax.adam(1e-2))
    state = init()
    if mesh is not None:
        params, state, ids = shard(params, mesh, LLAMA_TP), shard(state, mesh, LLAMA_TP), shard_batch(ids, mesh)
    logits = jax.jit(lambda p, x: fn(p, x).logits)(params, ids)
    losses = []
    for _ in range(3):
        state, loss = step(state, ids, ids)
        losses.append(float(loss))
    return logits, losses, state


def check_llama_meshes():
    """A hand-built Mesh (Auto axes) and jax.make_mesh (Explicit axes, also under jax.set_mesh) give
    the single-device logits and training run of a Llama, its weights split like the rules say."""
    model = _llama()
    ids = jnp.asarray(np.random.RandomState(0).randint(0, 64, (4, 12)), jnp.int32)
    ref_logits, ref_losses, ref_state = _llama_run(model, ids)
    devices = np.array(jax.devices()).reshape(2, 4)
    explicit = jax.make_mesh((2, 4), ("data", "model"))
    assert explicit.axis_types == (AxisType.Explicit,) * 2, explicit.axis_types
    cases = [
        ("auto", Mesh(devices, ("data", "model")), None),
        ("explicit", explicit, None),
        ("explicit+set_mesh", explicit, explicit),
    ]
    for name, mesh, context in cases:
        with jax.set_mesh(context) if context is not None else contextlib.nullcontext():
            logits, losses, state = _llama_run(model, ids, mesh)
        np.testing.assert_allclose(logits, ref_logits, atol=1e-5, err_msg=name)
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, err_msg=name)
        assert losses[-1] < losses[0], (name, losses)
        for k, v in ref_state.params.items():
            np.testing.assert_allclose(state.params[k], v, atol=1e-5, err_msg=f"{name} {k}")
        assert logits.sharding.is_equivalent_to(NamedSharding(mesh, P("data")), 3), (name, logits.sharding)
        q = "model.layers.0.self_attn.q_proj.weight"
        for tree in (state.params, state.opt_state[0].mu):
            assert tree[q].sharding.is_equivalent_to(NamedSharding(mesh, P("model", None)), 2), (name, tree[q].sharding)
            assert tree[q].addressable_shards[0].data.shape == (8, 32)
        if mesh is explicit:  # shardings stay in the types
            assert str(jax.typeof(state.params[q])) == "float32[32@model,32]", jax.typeof(state.params[q])
            assert str(jax.typeof(logits)) == "float32[4@data,12,64]", jax.typeof(logits)
    _check_torch_first_llama(model, ids, ref_logits, explicit)
    print("OK llama_meshes")


def _check_torch_first_llama(model, ids, ref_logits, mesh):
    """The torch-first path: a module on the jax device whose own tensors are explicitly sharded,
    through `jaxtorch.compile(model)` and through `jaxtorch.jit` with the module as an argument."""
    from jaxtorch.train._sharding import spec_for

    jaxtorch.enable_globally()
    try:
        m = copy.deepcopy(model).to("jax")
        for name, t in [*m.named_parameters(), *m.named_buffers()]:
            t.data = jaxtorch.JaxTensor(jax.device_put(t.jax(), NamedSharding(mesh, spec_for(name, LLAMA_TP))))
        x = jaxtorch.torch_view(jax.device_put(ids, NamedSharding(mesh, P("data"))))
        forward = jaxtorch.jit(lambda model, x: model(x).logits)
        with torch.no_grad():
            for out in (jaxtorch.compile(m)(x).logits, forward(m, x)):
                np.testing.assert_allclose(out.jax(), ref_logits, atol=1e-5)
                assert str(jax.typeof(out.jax())) == "float32[4@data,12,64]", jax.typeof(out.jax())
        q = m.model.layers[0].self_attn.q_proj.weight.jax()
        assert str(jax.typeof(q)) == "float32[32@model,32]", jax.typeof(q)  # left as found
    finally:
        jaxtorch.disable_globally()


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
    for a, b, c in zip(
        jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(plain)
    ):
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
    _check_mp_device_loader(loader)
    print("OK xla")


def _check_mp_device_loader(loader):
    """Issue 30 item 15: torch_xla's `MpDeviceLoader(loader, device, **kwargs)` signature."""
    import jaxtorch.xla as xm

    everywhere = xm.MpDeviceLoader(loader, xm.xla_device(), loader_prefetch_size=32, device_prefetch_size=4)
    assert len(everywhere) == len(loader) == 2
    batches = list(everywhere)
    assert len(batches) == 2 and all(xm.is_xla_tensor(t) for b in batches for t in b)
    assert len(batches[0][0].elem.sharding.device_set) == 8  # one process feeds all its devices
    np.testing.assert_array_equal(torch.cat([b[0].cpu() for b in batches]).numpy(), np.arange(64.0).reshape(32, 2))
    spread = next(iter(xm.ParallelLoader(loader, [xm.xla_device()]).per_device_loader(xm.xla_device())))
    assert len(spread[0].elem.sharding.device_set) == 8  # torch_xla's ParallelLoader(loader, [device]) idiom
    one = list(xm.MpDeviceLoader(loader, xm.xla_device(3), batches_per_execution=2, host_to_device_transfer_threads=2))
    assert [b[0].elem.devices() for b in one] == [{jax.devices()[3]}] * 2
    np.testing.assert_array_equal(one[1][1].cpu().numpy(), np.arange(16, 32))
    for bad, match in [({"batchdim": 1}, "batchdim"), ({"input_sharding": object()}, "mesh"), ({"nope": 1}, "nope")]:
        try:
            xm.MpDeviceLoader(loader, xm.xla_device(), **bad)
        except (NotImplementedError, TypeError) as e:
            assert match in str(e), e
        else:
            raise AssertionError(f"MpDeviceLoader accepted {bad}")


def check_device_loader_loop():
    """Issue 30 item 11: the DeviceLoader docstring's loop, with the state `init()` gives (one device) and
    batches on 8 devices, trains like one device; a state on other devices is refused, naming shard()."""
    torch.manual_seed(0)
    model = MLP()
    batches = _batches()
    torch_loader = torch.utils.data.DataLoader(batches, batch_size=None)  # yields the batches as they are
    mesh, key = jaxtorch.train.data_mesh(), jax.random.key(0)
    init, step = make_train_step(model, mse, optax.adam(1e-2))
    state = init()
    losses = []
    for x, y in DeviceLoader(torch_loader, mesh):  # the docstring's loop, as written
        state, loss = step(state, x, y, key)
        losses.append(float(loss))
    ref_state, ref_losses = _train(model)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for k, v in ref_state.params.items():
        np.testing.assert_allclose(state.params[k], v, atol=1e-5, err_msg=k)
    assert len(state.params["fc1.weight"].sharding.device_set) == 8
    four = Mesh(np.array(jax.devices()[:4]), ("data",))
    x, y = next(iter(DeviceLoader(batches)))
    try:
        step(shard(init(), four), x, y)
    except ValueError as e:
        assert "shard(state, mesh" in str(e), e
    else:
        raise AssertionError("a state on 4 devices and a batch on 8 ran")
    print("OK device_loader_loop")


def check_factory_placement():
    jaxtorch.enable_globally()
    for make in (torch.ones, torch.zeros, torch.randn):
        t = make(3, device="jax:2")
        assert t.elem.devices() == {jax.devices()[2]}, (make.__name__, t.elem.devices())
    print("OK factory_placement")


if __name__ == "__main__":
    globals()[f"check_{sys.argv[1]}"]()
