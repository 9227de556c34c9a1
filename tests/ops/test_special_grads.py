"""torch's derivatives at kinks, ties, boundaries and singular points (issue 29 item 4).

Two parts:

- the OpInfo checker (`tests/ops/_special_grads.py`): every differentiable float32 OpInfo
  entry at snapped sample inputs, JAX-first (`jax.grad` through `call_torch`) and torch-first
  (`loss.backward()` on the `jax` device), against CPU torch, with a two-way expected list
  (`special_grads_expected.txt`: an unlisted failure fails, and so does a listed entry that
  passes). The whole sweep (about 25 minutes on 2 cores) is marked `slow` and runs only with
  `JAXTORCH_SLOW=1`; the representative subset `QUICK` runs by default:
  `JAXTORCH_SLOW=1 python -m pytest -q tests/ops/test_special_grads.py -m slow`.
- focused tests of the named examples, JAX-first, torch-first, and forward mode (`jax.jvp`)
  for the elementwise ones, plus the mechanism itself (`jaxtorch.ops._derivatives`) under
  `jax.jit`, `jax.vmap`, `jax.jacfwd` and `jax.hessian`.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import jaxtorch
from jaxtorch.ops._derivatives import torch_derivative
from tests.expected import check_listed, load_expected
from tests.ops import _special_grads as checker

EXPECTED_FILE = Path(__file__).parent / "special_grads_expected.txt"
EXPECTED = load_expected(EXPECTED_FILE)
ENTRIES = checker.grad_entries()
# the default run: the entries whose derivative conventions this suite is about
QUICK = {
    "abs",
    "clamp",
    "max.reduction_with_dim",
    "maximum",
    "minimum",
    "nn.functional.binary_cross_entropy",
    "nn.functional.hardsigmoid",
    "nn.functional.hardswish",
    "nn.functional.hardtanh",
    "nn.functional.l1_loss",
    "nn.functional.max_pool2d",
    "nn.functional.relu",
    "nn.functional.relu6",
    "nn.functional.smooth_l1_loss",
    "linalg.vector_norm",
    "pow",
    "sort",
}


_FULL = bool(os.environ.get("JAXTORCH_SLOW"))  # the whole sweep is collected only when asked for


def test_expected_names_real_entries():
    unknown = [f"{m} {e}" for (m, e) in EXPECTED if e not in ENTRIES or m not in checker.MODES]
    assert not unknown, f"{EXPECTED_FILE.name} names unknown entries: {unknown}"


def _cases():
    for mode in checker.MODES:
        for eid in ENTRIES:
            if eid in QUICK or _FULL:
                marks = () if eid in QUICK else (pytest.mark.slow,)
                yield pytest.param(mode, eid, id=f"{mode}-{eid}", marks=marks)


@pytest.mark.parametrize("mode,eid", list(_cases()))
def test_special_points(mode, eid):
    ok, reason = checker.run_entry(ENTRIES[eid], mode)
    check_listed(mode, eid, ok, reason, EXPECTED, EXPECTED_FILE.name)


# ---- the named examples -------------------------------------------------------------------
def _torch_grad(fn, x):
    x = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(fn(x).sum(), x)
    return g.numpy()


def _jax_first_grad(fn, x):
    return np.asarray(jax.grad(lambda a: jaxtorch.call_torch(lambda t: fn(t).sum(), a))(jnp.asarray(x.numpy())))


def _torch_first_grad(fn, x):
    xj = x.clone().to("jax").requires_grad_()
    fn(xj).sum().backward()
    return xj.grad.cpu().numpy()


def _jvp(fn, x):
    """Forward mode: the tangent of `fn` at `x` along ones (elementwise ops: the derivative)."""
    a = jnp.asarray(x.numpy())
    _, t = jax.jvp(lambda v: jaxtorch.call_torch(fn, v), (a,), (jnp.ones_like(a),))
    return np.asarray(t)


_BOUNDS = torch.tensor([-6.0, -3.0, -1.0, 0.0, 1.0, 3.0, 6.0, 0.5])
ELEMENTWISE = {
    "relu": F.relu,
    "abs": torch.abs,
    "relu6": F.relu6,
    "hardtanh": F.hardtanh,
    "hardtanh(-2, 3)": lambda t: F.hardtanh(t, -2.0, 3.0),
    "hardswish": F.hardswish,
    "hardsigmoid": F.hardsigmoid,
    "clamp(-1, 3)": lambda t: t.clamp(-1, 3),
    "clamp_min(1)": lambda t: t.clamp(min=1),
    "leaky_relu": F.leaky_relu,
    "elu": F.elu,
    "sign": torch.sign,
}


@pytest.mark.parametrize("name", list(ELEMENTWISE))
def test_elementwise_kinks(name):
    fn = ELEMENTWISE[name]
    want = _torch_grad(fn, _BOUNDS)
    np.testing.assert_allclose(_jax_first_grad(fn, _BOUNDS), want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(_torch_first_grad(fn, _BOUNDS), want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(_jvp(fn, _BOUNDS), want, rtol=1e-6, atol=1e-6)


def test_relu_named_example():
    g = jax.grad(lambda a: jaxtorch.call_torch(lambda t: F.relu(t).sum(), a))(jnp.zeros(3))
    np.testing.assert_array_equal(np.asarray(g), np.zeros(3))


def test_hardswish_backward_op_matches_torch():
    g = torch.randn(_BOUNDS.shape)
    want = torch.ops.aten.hardswish_backward(g, _BOUNDS)
    got = torch.ops.aten.hardswish_backward(g.to("jax"), _BOUNDS.to("jax")).cpu()
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_binary_cross_entropy_at_0_and_1(reduction):
    p = torch.tensor([0.0, 1.0, 0.0, 1.0, 0.5, 0.25])
    y = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0, 0.0])
    fn = lambda t: F.binary_cross_entropy(t, y.to(t.device), reduction=reduction)
    want = _torch_grad(fn, p)
    assert np.isfinite(want).all()
    np.testing.assert_allclose(_jax_first_grad(fn, p), want, rtol=1e-5)
    np.testing.assert_allclose(_torch_first_grad(fn, p), want, rtol=1e-5)


def test_binary_cross_entropy_target_keeps_jax_derivative():
    p, y = jnp.array([0.2, 0.7]), jnp.array([0.0, 1.0])
    g = jax.grad(lambda t: jaxtorch.call_torch(lambda a, b: F.binary_cross_entropy(a, b), p, t))(y)
    pt, yt = torch.tensor([0.2, 0.7]), torch.tensor([0.0, 1.0], requires_grad=True)
    (want,) = torch.autograd.grad(F.binary_cross_entropy(pt, yt), yt)
    np.testing.assert_allclose(np.asarray(g), want.numpy(), rtol=1e-5)


def test_max_pool2d_ties_go_to_torchs_index():
    x = torch.zeros(1, 1, 4, 4)
    fn = lambda t: F.max_pool2d(t, 2)
    want = _torch_grad(fn, x)
    np.testing.assert_array_equal(_jax_first_grad(fn, x), want)
    np.testing.assert_array_equal(_torch_first_grad(fn, x), want)


def test_max_dim_ties_go_to_torchs_index():
    x = torch.tensor([[1.0, 3.0, 3.0], [2.0, 2.0, 2.0]])
    fn = lambda t: t.max(dim=1).values
    want = _torch_grad(fn, x)
    np.testing.assert_array_equal(_jax_first_grad(fn, x), want)
    np.testing.assert_array_equal(_torch_first_grad(fn, x), want)


def test_vector_norm_at_zero():
    x = torch.zeros(4)
    fn = lambda t: torch.linalg.vector_norm(t).reshape(1)
    want = _torch_grad(fn, x)
    np.testing.assert_array_equal(_jax_first_grad(fn, x), want)
    np.testing.assert_array_equal(_torch_first_grad(fn, x), want)


# ---- the mechanism --------------------------------------------------------------------------
@torch_derivative(lambda t, out, x, scale=1.0: jnp.where(x > 0, t * scale, 0))
def _kinked(x, scale=1.0):
    return jnp.maximum(x, 0) * scale


def test_mechanism_modes():
    x = jnp.array([-1.0, 0.0, 2.0])
    want = np.array([0.0, 0.0, 2.0])
    np.testing.assert_array_equal(jax.grad(lambda v: _kinked(v, 2.0).sum())(x), want)
    np.testing.assert_array_equal(jax.jit(jax.grad(lambda v: _kinked(v, 2.0).sum()))(x), want)
    np.testing.assert_array_equal(jax.vmap(jax.grad(lambda v: _kinked(v, 2.0)))(x), want)
    np.testing.assert_array_equal(jnp.diag(jax.jacfwd(lambda v: _kinked(v, 2.0))(x)), want)
    np.testing.assert_array_equal(jax.jvp(lambda v: _kinked(v, 2.0), (x,), (jnp.ones(3),))[1], want)
    np.testing.assert_array_equal(jax.hessian(lambda v: (_kinked(v) ** 2).sum())(x), np.diag([0.0, 0.0, 2.0]))
    np.testing.assert_array_equal(_kinked(jnp.array([-1, 2])), [0, 2])  # integers: the lowering as it is


def test_mechanism_multi_output_and_index_outputs():
    @torch_derivative(lambda t, out, x: (jnp.take_along_axis(t, out[1], 0), None))
    def first_max(x):
        i = jnp.argmax(x, axis=0, keepdims=True)
        return jnp.take_along_axis(x, i, 0), i

    x = jnp.zeros((3, 2))
    g = jax.grad(lambda v: first_max(v)[0].sum())(x)
    np.testing.assert_array_equal(g, [[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]])
    _, (tv, ti) = jax.jvp(first_max, (x,), (jnp.ones((3, 2)),))
    assert ti.dtype == jax.dtypes.float0 and tv.shape == (1, 2)


def test_mechanism_other_arguments_keep_jax_derivative():
    @torch_derivative(lambda t, out, x, y: t * y)
    def mul(x, y):
        return x * y

    gx, gy = jax.grad(lambda a, b: mul(a, b).sum(), argnums=(0, 1))(jnp.array([2.0]), jnp.array([3.0]))
    assert float(gx[0]) == 3.0 and float(gy[0]) == 2.0


def test_eager_and_lazy_executor_values_unchanged():
    x = _BOUNDS.to("jax")
    for fn in (F.relu, torch.abs, F.hardtanh, F.hardswish):
        torch.testing.assert_close(fn(x).cpu(), fn(_BOUNDS))
