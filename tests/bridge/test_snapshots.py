"""Every torch CPU tensor jaxtorch reads is read as a snapshot (issue 22, item 3).

Each entry point gets a writer racing JAX's asynchronous dispatch: the caller overwrites
its tensor right after the call returns (as a data loader refilling a reused buffer does),
many times over, and the result must be the one for the values at call time. Sizes on
both sides of the copy/copy-on-write threshold (64 KiB) are tried.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

import jaxtorch
from jaxtorch.train import DeviceLoader, make_train_step, shard_batch
from jaxtorch.train._sharding import data_mesh

REPEAT = 20
SIZES = [(4, 8), (128, 256)]  # 128 B (copied) and 128 KiB (copy-on-write)


def _filled(shape, i: int) -> torch.Tensor:
    return torch.full(shape, float(i))


@pytest.mark.parametrize("shape", SIZES)
def test_to_jax_is_a_snapshot(shape):
    for i in range(REPEAT):
        t = _filled(shape, i)
        a = jaxtorch.to_jax(t)
        t.fill_(float("nan"))  # the caller reuses its buffer at once
        np.testing.assert_array_equal(np.asarray(a), np.full(shape, float(i), np.float32))


def test_to_jax_snapshot_survives_views_and_out_writes():
    t = torch.zeros(1 << 15)  # 128 KiB: copy-on-write
    a = jaxtorch.to_jax(t)
    t[5:].fill_(1.0)  # a view of the same storage
    torch.ones(1 << 15, out=t)
    t.add_(3)
    assert not np.asarray(a).any()
    assert float(t[0]) == 4.0  # the writes did land in torch


def test_to_jax_large_tensor_is_not_copied():
    """Copy-on-write: the array reads the tensor's own memory until torch writes to it."""
    t = torch.arange(1 << 16, dtype=torch.float32)
    a = jaxtorch.to_jax(t)
    assert a.unsafe_buffer_pointer() == t.const_data_ptr()


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _mse(out, y):
    return jnp.mean((out - y) ** 2)


@pytest.mark.parametrize("rows", [4, 512])  # 128 B and 16 KiB+ batches
def test_train_step_reads_the_batch_at_call_time(rows):
    model = _mlp()
    init, step = make_train_step(model, _mse, optax.sgd(0.0))  # lr 0: every loss is the first one's
    state = init()
    xb, yb = torch.empty(rows, 8), torch.empty(rows, 1)
    for i in range(REPEAT):
        torch.manual_seed(i)
        xb.copy_(torch.randn(rows, 8))
        yb.copy_(torch.randn(rows, 1))
        with torch.no_grad():
            want = torch.nn.functional.mse_loss(model(xb), yb).item()
        state, loss = step(state, xb, yb)
        xb.fill_(float("nan"))  # the loader refills its pinned buffer
        yb.fill_(float("nan"))
        assert np.isfinite(float(loss))
        np.testing.assert_allclose(float(loss), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", SIZES)
def test_device_loader_over_a_reused_buffer(shape):
    buf = torch.zeros(shape)

    def refilling():
        for i in range(REPEAT):
            buf.fill_(float(i))
            yield buf

    got = [float(np.asarray(b)[0, 0]) for b in DeviceLoader(refilling(), data_mesh(), prefetch=2)]
    assert got == [float(i) for i in range(REPEAT)]


@pytest.mark.parametrize("shape", SIZES)
def test_shard_batch_is_a_snapshot(shape):
    mesh = data_mesh()
    for i in range(REPEAT):
        t = _filled(shape, i)
        x, y = shard_batch((t, t[:, :1]), mesh)
        t.fill_(7.0)
        np.testing.assert_array_equal(np.asarray(x), np.full(shape, float(i), np.float32))
        np.testing.assert_array_equal(np.asarray(y), np.full((shape[0], 1), float(i), np.float32))


def test_shard_batch_takes_jax_tensors_without_a_host_round_trip():
    with jaxtorch.default_env():
        t = torch.arange(8.0, device="jax").reshape(4, 2)
    x = shard_batch(t, data_mesh())
    np.testing.assert_array_equal(np.asarray(x), np.arange(8.0).reshape(4, 2))


@pytest.mark.parametrize("shape", SIZES)
def test_compile_inputs_are_snapshots(shape):
    double = jaxtorch.jit(lambda x: x * 2)
    for i in range(REPEAT):
        t = _filled(shape, i)
        out = double(t)
        t.fill_(-1.0)
        np.testing.assert_array_equal(out.cpu().numpy(), np.full(shape, 2.0 * i, np.float32))


@pytest.mark.parametrize("shape", SIZES)
@pytest.mark.parametrize("jit", [False, True])
def test_call_torch_closure_tensors_are_snapshots(shape, jit):
    for i in range(REPEAT):
        t = _filled(shape, i)

        def run(x, t=t):
            return jaxtorch.call_torch(lambda a: a + t, x)

        out = (jax.jit(run) if jit else run)(jnp.zeros(shape))
        t.fill_(-1.0)
        np.testing.assert_array_equal(np.asarray(out), np.full(shape, float(i), np.float32))


def test_extract_fn_reads_plain_tensor_attributes_at_call_time():
    """A plain tensor attribute (not a buffer) the forward reads is converted as a snapshot."""

    class Shift(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.shift = torch.zeros(128, 256)  # a plain attribute: the forward closes over it

        def forward(self, x):
            return x + self.shift

    m = Shift()
    params, fn = jaxtorch.extract(m)
    for i in range(REPEAT):
        m.shift.fill_(float(i))
        out = fn(params, jnp.zeros((128, 256)))
        m.shift.fill_(-1.0)
        np.testing.assert_array_equal(np.asarray(out), np.full((128, 256), float(i), np.float32))
