"""The prims lowerings (`jaxtorch/ops/prims.py`) against the same prims run eagerly on CPU torch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxtorch
from jaxtorch import JaxTensor

P = torch.ops.prims
TOL = dict(rtol=1e-5, atol=1e-5)


def _both(fn, *tensors):
    """(torch result on CPU, jaxtorch result) of `fn` on `tensors`."""
    ref = fn(*tensors)
    got = jaxtorch.call_torch(fn, *[jnp.asarray(t.numpy()) for t in tensors])
    return ref, got


def _check(ref, got, **tol):
    tol = tol or TOL
    if isinstance(ref, (tuple, list)):
        assert len(ref) == len(got)
        for r, g in zip(ref, got):
            _check(r, g, **tol)
        return
    g = np.asarray(got)
    assert tuple(g.shape) == tuple(ref.shape)
    if ref.dtype == torch.bfloat16:
        ref, g = ref.float(), g.astype(np.float32)
    r = ref.numpy()
    if r.dtype == np.bool_ or np.issubdtype(r.dtype, np.integer):
        assert g.dtype.kind == r.dtype.kind or (g.dtype.kind in "iu" and r.dtype.kind in "iu")
        np.testing.assert_array_equal(g, r)
    else:
        assert g.dtype.kind == r.dtype.kind, (g.dtype, r.dtype)
        np.testing.assert_allclose(g, r, equal_nan=True, **tol)


def _rand(*shape, lo=-3.0, hi=3.0):
    return torch.empty(shape).uniform_(lo, hi)


# ---- elementwise -------------------------------------------------------------------------
UNARY = {
    "abs": None,
    "acos": (-1, 1),
    "acosh": (1, 4),
    "asin": (-1, 1),
    "asinh": None,
    "atan": None,
    "atanh": (-0.99, 0.99),
    "cos": None,
    "cosh": None,
    "sin": None,
    "sinh": None,
    "tan": (-1.4, 1.4),
    "tanh": None,
    "exp": None,
    "exp2": None,
    "expm1": None,
    "log": (0.01, 5),
    "log1p": (-0.9, 5),
    "log2": (0.01, 5),
    "log10": (0.01, 5),
    "sqrt": (0, 5),
    "rsqrt": (0.1, 5),
    "cbrt": None,
    "reciprocal": (0.1, 3),
    "erf": None,
    "erfc": None,
    "erf_inv": (-0.99, 0.99),
    "erfcx": (-2, 8),
    "lgamma": (0.1, 6),
    "digamma": (0.1, 6),
    "ndtri": (0.01, 0.99),
    "bessel_i0": None,
    "bessel_i0e": None,
    "bessel_i1": None,
    "bessel_i1e": None,
    "bessel_j0": (-30, 30),
    "bessel_j1": (-30, 30),
    "spherical_bessel_j0": (-20, 20),
    "neg": None,
    "sign": None,
    "signbit": None,
    "isfinite": None,
    "floor": None,
    "ceil": None,
    "trunc": None,
    "round": None,
}


@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary_float(name):
    lo, hi = UNARY[name] or (-3.0, 3.0)
    x = _rand(4, 5, lo=lo, hi=hi)
    op = getattr(P, name)
    _check(*_both(lambda t: op(t), x), rtol=1e-4, atol=1e-5)


def test_complex_unary():
    z = torch.complex(_rand(3, 4), _rand(3, 4))
    for name in ["conj_physical", "abs", "real", "imag", "exp", "neg"]:
        op = getattr(P, name)
        _check(*_both(lambda t: op(t), z))
    _check(*_both(lambda t: P.conj(t).resolve_conj(), z))


def test_unary_special_values():
    x = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), -2.0, 2.5])
    for name in ["sign", "signbit", "isfinite", "digamma", "lgamma", "floor", "round", "abs"]:
        op = getattr(P, name)
        _check(*_both(lambda t: op(t), x))


def test_round_half_to_even():
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5])
    _check(*_both(lambda t: P.round(t), x))


def test_unary_integer_and_bool():
    i = torch.tensor([-3, 0, 5, 7])
    b = torch.tensor([True, False, True])
    for name in ["abs", "neg", "sign", "bitwise_not", "floor", "trunc"]:
        op = getattr(P, name)
        _check(*_both(lambda t: op(t), i))
    _check(*_both(lambda t: P.bitwise_not(t), b))
    _check(*_both(lambda t: P.sin(t), i), rtol=1e-5, atol=1e-6)  # the CPU prim returns float


BINARY_FLOAT = [
    "add",
    "sub",
    "mul",
    "div",
    "fmod",
    "remainder",
    "atan2",
    "hypot",
    "nextafter",
    "maximum",
    "minimum",
    "fmax",
    "fmin",
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "pow",
]


@pytest.mark.parametrize("name", BINARY_FLOAT)
def test_binary_float(name):
    a, b = _rand(3, 4), _rand(3, 4)
    b[0, 0] = a[0, 0]
    if name in ("fmax", "fmin", "maximum", "minimum"):
        a[1, 1] = float("nan")
    if name == "pow":
        a = a.abs()
    op = getattr(P, name)
    _check(*_both(lambda x, y: op(x, y), a, b))


@pytest.mark.parametrize(
    "name",
    [
        "add",
        "sub",
        "mul",
        "div",
        "fmod",
        "remainder",
        "maximum",
        "minimum",
        "bitwise_and",
        "bitwise_or",
        "bitwise_xor",
        "gcd",
        "eq",
        "lt",
        "ge",
        "shift_left",
        "shift_right_arithmetic",
    ],
)
def test_binary_int(name):
    a = torch.tensor([-7, 7, -8, 9, 0, 13])
    b = torch.tensor([2, -2, 3, -4, 5, 1])
    if name.startswith("shift"):
        b = b.abs()
    op = getattr(P, name)
    _check(*_both(lambda x, y: op(x, y), a, b))


def test_binary_with_python_scalar_and_cpu_scalar_tensor():
    a = _rand(3, 2)
    _check(*_both(lambda x: P.mul(x, 2.5), a))
    _check(*_both(lambda x: P.add(x, torch.tensor(1.5)), a))


def test_binary_special():
    a = _rand(3, 4, lo=0.5, hi=5)
    b = _rand(3, 4, lo=0.5, hi=5)
    _check(*_both(lambda x, y: P.igamma(x, y), a, b), rtol=1e-4, atol=1e-5)
    _check(*_both(lambda x, y: P.igammac(x, y), a, b), rtol=1e-4, atol=1e-5)
    _check(*_both(lambda x, y: P.zeta(x + 1.5, y), a, b), rtol=1e-4, atol=1e-5)


def test_where_fill_frexp():
    a, b = _rand(3, 4), _rand(3, 4)
    _check(*_both(lambda x, y: P.where(x > 0, x, y), a, b))
    _check(*_both(lambda x: P.fill(x, 2.5), a))
    _check(*_both(lambda x: P.frexp(x), a))


# ---- views and shapes --------------------------------------------------------------------
def test_broadcast_in_dim():
    x = _rand(3, 1)
    _check(*_both(lambda t: P.broadcast_in_dim(t, [2, 3, 4], [1, 2]), x))
    _check(*_both(lambda t: P.broadcast_in_dim(t, [3, 5, 1], [0, 2]), x))


def test_shape_prims():
    x = _rand(2, 3, 4)
    _check(*_both(lambda t: P.collapse_view(t, 0, 1), x))
    _check(*_both(lambda t: P.collapse(t, 1, 2), x))
    _check(*_both(lambda t: P.split_dim(t, 2, 2), x))
    _check(*_both(lambda t: P.transpose(t, [2, 0, 1]), x))
    _check(*_both(lambda t: P.view_of(t), x))
    _check(*_both(lambda t: P.reshape(t, [4, 6]), x))
    _check(*_both(lambda t: P.rev(t, [0, 2]), x))
    _check(*_both(lambda t: P.rev(t, []), x))
    _check(*_both(lambda t: P.squeeze(t, [0, 2]), _rand(1, 3, 1)))
    _check(*_both(lambda a, b: P.cat([a, b], 1), x, _rand(2, 5, 4)))
    _check(*_both(lambda t: P.view_of_dtype(t, torch.int32), x))


def test_as_strided_scatter():
    x, src = _rand(4, 5), _rand(2, 3)
    _check(*_both(lambda t, s: P.as_strided_scatter(t, s, [2, 3], [5, 2], 1), x, src))


def test_as_strided_gather():
    from jaxtorch.ops.prims import as_strided

    x = _rand(4, 5)
    ref = torch.as_strided(x, (3, 2), (4, 3), 2)
    np.testing.assert_array_equal(np.asarray(as_strided(jnp.asarray(x.numpy()), (3, 2), (4, 3), 2)), ref.numpy())


def test_view_prims_alias_their_input():
    """A write through a view prim shows in the base, as in torch."""

    def fn(t):
        v = P.transpose(P.split_dim(t, 1, 2), [1, 0, 2])  # (2, 2, 3) view of t
        v.add_(100.0)
        w = P.squeeze(P.broadcast_in_dim(t, [1, 2, 6], [1, 2]), [0])
        w[0, 0] = -1.0
        return t

    x = _rand(2, 6)
    ref = fn(x.clone())
    got = jaxtorch.call_torch(fn, jnp.asarray(x.numpy()))
    _check(ref, got)


def test_view_prims_are_views():
    x = JaxTensor(jnp.ones((2, 3)))
    views = [
        P.view_of(x),
        P.collapse_view(x, 0, 1),
        P.split_dim(x, 1, 3),
        P.transpose(x, [1, 0]),
        P.broadcast_in_dim(x, [4, 2, 3], [1, 2]),
        P.squeeze(P.broadcast_in_dim(x, [1, 2, 3], [1, 2]), [0]),
    ]
    assert all(v._jt_base is x for v in views)
    assert P.reshape(x, [6])._jt_base is None  # prims.reshape copies


# ---- dtype, copies ---------------------------------------------------------------------------
def test_convert_element_type():
    x = torch.tensor([-2.7, -0.5, 0.0, 0.5, 3.9])
    for dt in [torch.int64, torch.int32, torch.bool, torch.float16, torch.bfloat16]:
        _check(*_both(lambda t: P.convert_element_type(t, dt), x), rtol=1e-2, atol=1e-2)
    _check(*_both(lambda t: P.convert_element_type(t, torch.float32), torch.tensor([1, 0, 3])))


def test_copies():
    x = _rand(2, 3)
    _check(*_both(lambda t: P.clone(t), x))
    _check(*_both(lambda t: P.copy_strided(t, [1, 2]), x))

    def copy_to(t):
        dst = torch.zeros(2, 3, dtype=torch.int64, device=t.device)
        out = P.copy_to(dst, t * 10)
        return dst, out

    _check(*_both(copy_to, x))


def test_item():
    got = jaxtorch.call_torch(lambda t: jnp.asarray(P.item(t)), jnp.asarray([2.5]))
    assert float(got) == 2.5
    with pytest.raises(Exception, match="data-dependent|traced"):
        jax.jit(lambda a: jaxtorch.call_torch(lambda t: jnp.asarray(P.item(t)), a))(jnp.asarray([2.5]))


# ---- reductions -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["sum", "prod", "amax", "amin"])
@pytest.mark.parametrize("dims", [[0], [1, 2], [0, 1, 2], []])
def test_reductions(name, dims):
    x = _rand(2, 3, 4, lo=0.5, hi=1.5)
    op = getattr(P, name)
    _check(*_both(lambda t: op(t, dims), x))


def test_reduction_output_dtype_and_ints():
    x = torch.tensor([[1, 2, 3], [4, 5, 6]])
    _check(*_both(lambda t: P.sum(t, [1]), x))
    _check(*_both(lambda t: P.prod(t, [0]), x))
    _check(*_both(lambda t: P.amax(t, [0, 1]), x))
    # the CPU prim cannot take output_dtype (torch.sum has no such keyword): compare to torch.sum
    got = jaxtorch.call_torch(lambda t: P.sum(t, [0], output_dtype=torch.float32), jnp.asarray(x.numpy()))
    _check(torch.sum(x, [0], dtype=torch.float32), got)


def test_xor_sum():
    """The CPU prim has no eager kernel ("only implemented with inductor"): compare to numpy."""
    x = np.array([[1, 2, 7], [3, 8, 1]], dtype=np.int32)
    got = jaxtorch.call_torch(lambda t: P.xor_sum(t, [1]), jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(got), np.bitwise_xor.reduce(x, axis=1))


@pytest.mark.parametrize("correction", [0, 1, 0.5, 3])
@pytest.mark.parametrize("dims", [[0], [0, 2], []])
def test_var(correction, dims):
    x = _rand(2, 3, 4)
    _check(*_both(lambda t: P.var(t, dims, correction), x))


# ---- factories ------------------------------------------------------------------------------
def test_factories():
    def fn(t):
        d = t.device
        return (
            P.iota(5, start=3, step=-2, dtype=torch.int64, device=d, requires_grad=False),
            P.full([2, 3], 1.5, dtype=torch.float32, device=d, requires_grad=False),
            P.full_like(t, 7, dtype=torch.int32, device=d, requires_grad=False),
            P.empty([2, 0, 3], dtype=torch.float32, device=d, requires_grad=False),
            P.scalar_tensor(3, dtype=torch.float32, device=d),
            P.scalar_tensor(True, dtype=torch.bool, device=d),
        )

    ref = fn(_rand(2, 2))
    got = jaxtorch.call_torch(fn, jnp.zeros((2, 2)))
    _check(ref, got)


def test_normal_is_random_and_shaped():
    got = jaxtorch.call_torch(
        lambda t: P.normal([1000], mean=2.0, std=0.5, dtype=torch.float32, device=t.device, requires_grad=False),
        jnp.zeros(1),
        rng=jax.random.key(0),
    )
    got = np.asarray(got)
    assert got.shape == (1000,)
    assert abs(got.mean() - 2.0) < 0.1 and abs(got.std() - 0.5) < 0.1


# ---- linear algebra, FFT ------------------------------------------------------------------
def test_svd_reconstructs():
    a = _rand(4, 3)
    u, s, vh = jaxtorch.call_torch(lambda t: P.svd(t, full_matrices=False), jnp.asarray(a.numpy()))
    _, s_ref, _ = P.svd(a, full_matrices=False)
    np.testing.assert_allclose(np.asarray(s), s_ref.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(u) * np.asarray(s) @ np.asarray(vh), a.numpy(), rtol=1e-4, atol=1e-5)


def test_fft_prims():
    x = _rand(4, 6)
    _check(*_both(lambda t: P.fft_r2c(t, dim=[0, 1], onesided=True), x), rtol=1e-4, atol=1e-4)
    _check(*_both(lambda t: P.fft_r2c(t, dim=[1], onesided=False), x), rtol=1e-4, atol=1e-4)
    z = torch.complex(_rand(4, 6), _rand(4, 6))
    for fwd in (True, False):
        _check(*_both(lambda t: P.fft_c2c(t, dim=[0, 1], forward=fwd), z), rtol=1e-4, atol=1e-4)
    h = torch.fft.rfftn(x)
    _check(*_both(lambda t: P.fft_c2r(t, dim=[0, 1], last_dim_size=6), h), rtol=1e-4, atol=1e-4)


# ---- decompositions now run ------------------------------------------------------------------
@pytest.mark.parametrize(
    "fn",
    [
        lambda t: torch.flip(t, [0, 1]),  # aten.flip -> prims.rev
        lambda t: torch.std(t, 1),  # aten.std -> prims.var
        lambda t: torch.diag_embed(t),  # -> prims.broadcast_in_dim, prims.iota, prims.where
        lambda t: torch.logaddexp(t, t * 2),  # -> prims.ge, prims.where, ...
        lambda t: torch.fmod(t, 0.7),  # -> prims.fmod
    ],
    ids=["flip", "std", "diag_embed", "logaddexp", "fmod"],
)
def test_decomposition_only_ops_run(fn):
    x = _rand(3, 4)
    _check(*_both(fn, x), rtol=1e-5, atol=1e-5)


def test_decomposition_under_jit():
    x = _rand(3, 4)
    got = jax.jit(lambda a: jaxtorch.call_torch(lambda t: torch.std(t, 1), a))(jnp.asarray(x.numpy()))
    np.testing.assert_allclose(np.asarray(got), torch.std(x, 1).numpy(), rtol=1e-5, atol=1e-6)


def test_grad_through_prims():
    """jax.grad differentiates through the lowerings (prims have no torch autograd formulas)."""
    x = _rand(3, 4)

    def loss(t):
        v = P.var(t, [1], 1.0) * P.broadcast_in_dim(P.rev(t, [0])[:, 0], [3], [0])
        return P.sum(v, [0])

    g = jax.grad(lambda a: jaxtorch.call_torch(loss, a))(jnp.asarray(x.numpy()))
    t = x.clone().requires_grad_(True)
    (torch.var(t, 1) * torch.flip(t, [0])[:, 0]).sum().backward()
    np.testing.assert_allclose(np.asarray(g), t.grad.numpy(), rtol=1e-5, atol=1e-6)
