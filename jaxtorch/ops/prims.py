"""Lowerings of PyTorch's primitive ops (`torch.ops.prims.*`, see `torch/_prims/__init__.py`).

PyTorch's decompositions (`torch._decomp`, `torch._refs`) bottom out in prims, so lowering
every prim lets each ATen op that has a decomposition but no lowering of its own run on
JAX. Prims are simpler than ATen ops: they never type-promote (the refs cast first; the
operands share a dtype), elementwise prims never broadcast (the refs call
`broadcast_in_dim` first), reductions take canonical `dims`, and dtypes are explicit.

Where the eager CPU prim (its `impl_aten`) and the prim's meta function disagree, these
lowerings follow the eager CPU prim, since that is what a decomposition computes in eager
PyTorch: an empty `dims` reduces every dim for `sum`/`amax`/`amin`/`var` and none for
`prod`; unary math prims on integer tensors return floats.

View prims (`broadcast_in_dim`, `collapse_view`, `split_dim`, `squeeze`, `transpose`,
`view_of`, `conj`, `real`, `imag`, `view_of_dtype`) alias their first argument: the
interpreter turns them into views because their schemas say so; each lowering here is a
pure function of that argument.

Example:
    ```python
    import jax.numpy as jnp, torch, jaxtorch
    f = lambda x: torch.ops.prims.broadcast_in_dim(x, [2, 3], [1])
    jaxtorch.call_torch(f, jnp.arange(3.0))    # [[0, 1, 2], [0, 1, 2]]
    ```
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import jax.scipy.special as jsp
import numpy as np
import torch
from jax import lax

from ..bridge.core._dtypes import canonical_int, default_float
from ..bridge.core._registry import register
from ._semantics import category, is_array, to_float

prims = torch.ops.prims

_BOOL, _INT, _FLOAT, _COMPLEX = 0, 1, 2, 3


# ---- helpers ---------------------------------------------------------------------------
def _shared_dtype(*args) -> np.dtype | None:
    """The dtype prims compute in: the first dimensioned tensor's, else the first tensor's."""
    first = None
    for a in args:
        if is_array(a):
            if a.ndim > 0:
                return np.dtype(a.dtype)
            if first is None:
                first = np.dtype(a.dtype)
    return first


def _same_dtype(*args) -> list:
    """Cast the array arguments to their shared dtype (CPU scalar tensors may differ)."""
    dtype = _shared_dtype(*args)
    return [a.astype(dtype) if is_array(a) and a.dtype != dtype else a for a in args]


def _floating(a):
    """Integer and bool arrays as the default float dtype (what torch's math kernels return)."""
    if is_array(a) and category(a.dtype) < _FLOAT:
        return a.astype(to_float(a.dtype))
    return a


def _dims(dims: Sequence[int] | None, ndim: int, empty_is_all: bool = True) -> tuple[int, ...]:
    if dims is None or (len(dims) == 0 and empty_is_all):
        return tuple(range(ndim))
    return tuple(d % max(ndim, 1) for d in dims)


def _register_unary(op, fn: Callable, math_fn: bool = True) -> None:
    """Register `fn` as the lowering of the unary elementwise prim `op`."""
    if math_fn:
        register(op)(lambda a, fn=fn: fn(_floating(a)))
    else:
        register(op)(fn)


def _register_binary(op, fn: Callable) -> None:
    """Register `fn(a, b)` (operands cast to their shared dtype) for the binary prim `op`."""
    register(op)(lambda a, b, fn=fn: fn(*_same_dtype(a, b)))


# ---- elementwise unary -------------------------------------------------------------------
def _sign(a):
    """torch.sign: 0 for NaN (jnp.sign gives NaN)."""
    if category(a.dtype) == _BOOL:
        return a
    s = jnp.sign(a)
    return jnp.where(jnp.isnan(a), jnp.zeros_like(s), s) if category(a.dtype) == _FLOAT else s


def _digamma(a):
    """torch.digamma: -inf at +0 and +inf at -0 (jax gives NaN at 0)."""
    return jnp.where(a == 0, jnp.copysign(jnp.inf, -a).astype(a.dtype), jsp.digamma(a))


def _rounding(fn: Callable) -> Callable:
    """floor/ceil/trunc/round: the identity on integer and bool tensors."""
    return lambda a: a if category(a.dtype) < _FLOAT else fn(a)


def _spherical_bessel_j0(a):
    """sin(x)/x, with its Taylor series near 0."""
    small = jnp.abs(a) < 0.5
    safe = jnp.where(small, jnp.ones_like(a), a)
    x2 = a * a
    series = 1 - x2 / 6 * (1 - x2 / 20 * (1 - x2 / 42 * (1 - x2 / 72 * (1 - x2 / 110))))
    return jnp.where(small, series, jnp.sin(safe) / safe)


def _polevl(x, coeffs: Sequence[float]):
    out = jnp.full_like(x, coeffs[0])
    for c in coeffs[1:]:
        out = out * x + c
    return out


# Cephes j0/j1 coefficients (as used by PyTorch's `calc_bessel_j0`/`calc_bessel_j1`).
_J0_PP = [
    7.96936729297347051624e-04,
    8.28352392107440799803e-02,
    1.23953371646414299388e00,
    5.44725003058768775090e00,
    8.74716500199817011941e00,
    5.30324038235394892183e00,
    9.99999999999999997821e-01,
]
_J0_PQ = [
    9.24408810558863637013e-04,
    8.56288474354474431428e-02,
    1.25352743901058953537e00,
    5.47097740330417105182e00,
    8.76190883237069594232e00,
    5.30605288235394617618e00,
    1.00000000000000000218e00,
]
_J0_QP = [
    -1.13663838898469149931e-02,
    -1.28252718670509318512e00,
    -1.95539544257735972385e01,
    -9.32060152123768231369e01,
    -1.77681167980488050595e02,
    -1.47077505154951170175e02,
    -5.14105326766599330220e01,
    -6.05014350600728481186e00,
]
_J0_QQ = [
    1.0,
    6.43178256118178023184e01,
    8.56430025976980587198e02,
    3.88240183605401609683e03,
    7.24046774195652478189e03,
    5.93072701187316984827e03,
    2.06209331660327847417e03,
    2.42005740240291393179e02,
]
_J0_RP = [-4.79443220978201773821e09, 1.95617491946556577543e12, -2.49248344360967716204e14, 9.70862251047306323952e15]
_J0_RQ = [
    1.0,
    4.99563147152651017219e02,
    1.73785401676374683123e05,
    4.84409658339962045305e07,
    1.11855537045356834862e10,
    2.11277520115489217587e12,
    3.10518229857422583814e14,
    3.18121955943204943306e16,
    1.71086294081043136091e18,
]
_J1_PP = [
    7.62125616208173112003e-04,
    7.31397056940917570436e-02,
    1.12719608129684925192e00,
    5.11207951146807644818e00,
    8.42404590141772420927e00,
    5.21451598682361504063e00,
    1.00000000000000000254e00,
]
_J1_PQ = [
    5.71323128072548699714e-04,
    6.88455908754495404082e-02,
    1.10514232634061696926e00,
    5.07386386128601488557e00,
    8.39985554327604159757e00,
    5.20982848682361821619e00,
    9.99999999999999997461e-01,
]
_J1_QP = [
    5.10862594750176621635e-02,
    4.98213872951233449420e00,
    7.58238284132545283818e01,
    3.66779609360150777800e02,
    7.10856304998926107277e02,
    5.97489612400613639965e02,
    2.11688757100572135698e02,
    2.52070205858023719784e01,
]
_J1_QQ = [
    1.0,
    7.42373277035675149943e01,
    1.05644886038262816351e03,
    4.98641058337653607651e03,
    9.56231892404756170795e03,
    7.99704160447350683650e03,
    2.82619278517639096600e03,
    3.36093607810698293419e02,
]
_J1_RP = [-8.99971225705559398224e08, 4.52228297998194034323e11, -7.27494245221818276015e13, 3.68295732863852883286e15]
_J1_RQ = [
    1.0,
    6.20836478118054335476e02,
    2.56987256757748830383e05,
    8.35146791431949253037e07,
    2.21511595479792499675e10,
    4.74914122079991414898e12,
    7.84369607876235854894e14,
    8.95222336184627338078e16,
    5.32278620332680085395e18,
]
_DR1, _DR2 = 5.78318596294678452118e00, 3.04712623436620863991e01
_Z1, _Z2 = 1.46819706421238932572e01, 4.92184563216946036703e01


def _bessel_far(x, pp, pq, qp, qq, phase: float):
    """The x > 5 asymptotic form shared by j0 and j1."""
    xs = jnp.maximum(x, 5.0)
    z = 25.0 / (xs * xs)
    p = _polevl(z, pp) / _polevl(z, pq)
    q = _polevl(z, qp) / _polevl(z, qq)
    xn = xs - phase
    return (p * jnp.cos(xn) - 5.0 / xs * q * jnp.sin(xn)) * 0.79788456080286535588 / jnp.sqrt(xs)


def _bessel_j0(a):
    x = jnp.abs(a)
    z = a * a
    tiny = 1.0 - z / 4.0
    near = (z - _DR1) * (z - _DR2) * _polevl(z, _J0_RP) / _polevl(z, _J0_RQ)
    far = _bessel_far(x, _J0_PP, _J0_PQ, _J0_QP, _J0_QQ, math.pi / 4)
    return jnp.where(x <= 5.0, jnp.where(x < 1e-5, tiny, near), far).astype(a.dtype)


def _bessel_j1(a):
    x = jnp.abs(a)
    z = a * a
    near = _polevl(z, _J1_RP) / _polevl(z, _J1_RQ) * a * (z - _Z1) * (z - _Z2)
    far = _bessel_far(x, _J1_PP, _J1_PQ, _J1_QP, _J1_QQ, 3 * math.pi / 4)
    far = jnp.where(a < 0, -far, far)
    return jnp.where(x <= 5.0, near, far).astype(a.dtype)


def _invert(a):
    return jnp.logical_not(a) if a.dtype == np.bool_ else jnp.invert(a)


def _reciprocal(a):
    return 1 / a


def _rsqrt(a):
    return lax.rsqrt(a)


_UNARY_MATH: dict[str, Callable] = {
    "acos": jnp.arccos,
    "acosh": jnp.arccosh,
    "asin": jnp.arcsin,
    "asinh": jnp.arcsinh,
    "atan": jnp.arctan,
    "atanh": jnp.arctanh,
    "cos": jnp.cos,
    "cosh": jnp.cosh,
    "sin": jnp.sin,
    "sinh": jnp.sinh,
    "tan": jnp.tan,
    "tanh": jnp.tanh,
    "exp": jnp.exp,
    "exp2": jnp.exp2,
    "expm1": jnp.expm1,
    "log": jnp.log,
    "log1p": jnp.log1p,
    "log2": jnp.log2,
    "log10": jnp.log10,
    "sqrt": jnp.sqrt,
    "rsqrt": _rsqrt,
    "cbrt": jnp.cbrt,
    "reciprocal": _reciprocal,
    "erf": jsp.erf,
    "erfc": jsp.erfc,
    "erf_inv": jsp.erfinv,
    "erfcx": jsp.erfcx,
    "lgamma": jsp.gammaln,
    "digamma": _digamma,
    "ndtri": jsp.ndtri,
    "bessel_i0": jsp.i0,
    "bessel_i0e": jsp.i0e,
    "bessel_i1": jsp.i1,
    "bessel_i1e": jsp.i1e,
    "bessel_j0": _bessel_j0,
    "bessel_j1": _bessel_j1,
    "spherical_bessel_j0": _spherical_bessel_j0,
}
_UNARY_EXACT: dict[str, Callable] = {
    "abs": jnp.abs,
    "neg": jnp.negative,
    "sign": _sign,
    "signbit": jnp.signbit,
    "isfinite": jnp.isfinite,
    "bitwise_not": _invert,
    "floor": _rounding(jnp.floor),
    "ceil": _rounding(jnp.ceil),
    "trunc": _rounding(jnp.trunc),
    "round": _rounding(jnp.round),  # half to even, like torch.round
    "conj_physical": jnp.conj,
    "conj": jnp.conj,
    "real": jnp.real,
    "imag": jnp.imag,
}

for _name, _fn in _UNARY_MATH.items():
    _register_unary(getattr(prims, _name).default, _fn, math_fn=True)
for _name, _fn in _UNARY_EXACT.items():
    _register_unary(getattr(prims, _name).default, _fn, math_fn=False)


@register(prims.fill.default)
def fill(a, value):
    """A tensor of `a`'s shape and dtype filled with `value`."""
    return jnp.full(a.shape, value, a.dtype)


@register(prims.frexp.default)
def frexp(a):
    """(mantissa, int32 exponent) with `a == mantissa * 2**exponent`."""
    m, e = jnp.frexp(a)
    return m, e.astype(np.int32)


# ---- elementwise binary ------------------------------------------------------------------
def _int_dtype(a, b) -> bool:
    return category(_shared_dtype(a, b) or np.dtype(type(a))) <= _INT


def _lax_operands(a, b):
    """Both operands as arrays of their shared dtype and broadcast shape (lax does neither)."""
    dtype = _shared_dtype(a, b)
    return jnp.broadcast_arrays(jnp.asarray(a, dtype), jnp.asarray(b, dtype))


def _div(a, b):
    """Truncating division for integers, true division otherwise."""
    if _int_dtype(a, b):
        return lax.div(*_lax_operands(a, b))
    return jnp.true_divide(a, b)


def _fmod(a, b):
    """C fmod: the result has the sign of `a`."""
    if _int_dtype(a, b):
        return lax.rem(*_lax_operands(a, b))
    return jnp.fmod(a, b)


_BINARY: dict[str, Callable] = {
    "add": jnp.add,
    "sub": jnp.subtract,
    "mul": jnp.multiply,
    "div": _div,
    "fmod": _fmod,
    "remainder": jnp.remainder,
    "pow": jnp.power,
    "atan2": jnp.arctan2,
    "hypot": jnp.hypot,
    "nextafter": jnp.nextafter,
    "maximum": jnp.maximum,
    "minimum": jnp.minimum,
    "fmax": jnp.fmax,
    "fmin": jnp.fmin,
    "bitwise_and": jnp.bitwise_and,
    "bitwise_or": jnp.bitwise_or,
    "bitwise_xor": jnp.bitwise_xor,
    "shift_left": jnp.left_shift,
    "shift_right_arithmetic": jnp.right_shift,
    "gcd": jnp.gcd,
    "eq": jnp.equal,
    "ne": jnp.not_equal,
    "lt": jnp.less,
    "le": jnp.less_equal,
    "gt": jnp.greater,
    "ge": jnp.greater_equal,
    "igamma": jsp.gammainc,
    "igammac": jsp.gammaincc,
    "zeta": jsp.zeta,
}

for _name, _fn in _BINARY.items():
    _register_binary(getattr(prims, _name).default, _fn)


@register(prims.where.default)
def where(pred, a, b):
    """`a` where `pred`, else `b` (same dtype; no broadcasting beyond scalars)."""
    a, b = _same_dtype(a, b)
    return jnp.where(pred, a, b)


# ---- views (index maps of their first argument) --------------------------------------------
@register(prims.broadcast_in_dim.default)
def broadcast_in_dim(a, shape: Sequence[int], broadcast_dimensions: Sequence[int]):
    """`a`'s dim i becomes output dim `broadcast_dimensions[i]` of `shape` (size-1 dims expand)."""
    return lax.broadcast_in_dim(a, tuple(shape), tuple(broadcast_dimensions))


def _collapsed_shape(shape: Sequence[int], start: int, end: int) -> tuple[int, ...]:
    shape = tuple(shape) or (1,)
    return shape[:start] + (math.prod(shape[start : end + 1]),) + shape[end + 1 :]


@register(prims.collapse_view.default, prims.collapse.default)
def collapse(a, start: int, end: int):
    """Dims `start` through `end` (inclusive) merged into one."""
    return jnp.reshape(a, _collapsed_shape(a.shape, start, end))


@register(prims.split_dim.default)
def split_dim(a, dim: int, outer_length: int):
    """Dim `dim` split into `(outer_length, size // outer_length)`."""
    dim = dim % max(a.ndim, 1)
    shape = a.shape[:dim] + (outer_length, a.shape[dim] // outer_length) + a.shape[dim + 1 :]
    return jnp.reshape(a, shape)


@register(prims.squeeze.default)
def squeeze(a, dimensions: Sequence[int]):
    """`a` without the (size-1) dims in `dimensions`."""
    return lax.squeeze(a, tuple(d % max(a.ndim, 1) for d in dimensions))


@register(prims.transpose.default)
def transpose(a, permutation: Sequence[int]):
    """Output dim i is input dim `permutation[i]`."""
    return jnp.transpose(a, tuple(permutation))


@register(prims.view_of.default)
def view_of(a):
    """A view of all of `a`."""
    return a


@register(prims.view_of_dtype.default)
def view_of_dtype(a, dtype):
    """`a`'s bytes read as `dtype`; the last dim scales by the ratio of item sizes."""
    dtype = np.dtype(dtype)
    old, new = np.dtype(a.dtype).itemsize, dtype.itemsize
    if old == new:
        return lax.bitcast_convert_type(a, dtype)
    if old > new:
        out = lax.bitcast_convert_type(a, dtype)  # (..., n, old // new)
        return jnp.reshape(out, a.shape[:-1] + (a.shape[-1] * (old // new),))
    grouped = jnp.reshape(a, a.shape[:-1] + (a.shape[-1] // (new // old), new // old))
    return lax.bitcast_convert_type(grouped, dtype)


def strided_indices(size: Sequence[int], stride: Sequence[int], storage_offset: int):
    """Flat indices into a contiguous buffer of the elements of an `as_strided` view."""
    idx = jnp.full(tuple(size), storage_offset, dtype=np.int32)
    for d, (n, s) in enumerate(zip(size, stride)):
        shape = [1] * len(size)
        shape[d] = n
        idx = idx + (jnp.arange(n, dtype=np.int32) * s).reshape(shape)
    return idx


def as_strided(a, size: Sequence[int], stride: Sequence[int], storage_offset: int = 0):
    """The `size`-shaped tensor whose element i is `a.flatten()[offset + sum(i_d * stride_d)]`.

    `a` is taken as contiguous storage (a gather from the flattened input).
    """
    return jnp.reshape(a, (-1,))[strided_indices(size, stride, storage_offset)]


@register(prims.as_strided_scatter.default)
def as_strided_scatter(a, src, size: Sequence[int], stride: Sequence[int], storage_offset: int):
    """A copy of `a` with its `as_strided(size, stride, storage_offset)` elements set to `src`."""
    idx = strided_indices(size, stride, storage_offset)
    flat = jnp.reshape(a, (-1,)).at[idx.reshape(-1)].set(jnp.reshape(src, (-1,)).astype(a.dtype))
    return jnp.reshape(flat, a.shape)


# ---- shape ops that copy -------------------------------------------------------------------
@register(prims.reshape.default)
def reshape(a, shape: Sequence[int]):
    """`a` with shape `shape` (a copy in torch)."""
    return jnp.reshape(a, tuple(shape))


@register(prims.rev.default)
def rev(a, dims: Sequence[int]):
    """`a` reversed along `dims`."""
    return jnp.flip(a, tuple(dims)) if len(dims) else a


@register(prims.cat.default)
def cat(tensors: Sequence[Any], dim: int):
    """Concatenation along `dim` (the tensors share a dtype)."""
    return jnp.concatenate(_same_dtype(*tensors), axis=dim)


# ---- dtype, copies, devices ----------------------------------------------------------------
def _convert(a, dtype):
    dtype = np.dtype(dtype)
    if category(a.dtype) == _COMPLEX and category(dtype) != _COMPLEX:
        a = jnp.real(a)
    return a if a.dtype == dtype else a.astype(dtype)


@register(prims.convert_element_type.default)
def convert_element_type(a, dtype):
    """`a` converted to `dtype` (complex to real drops the imaginary part, like torch)."""
    return _convert(a, dtype)


@register(prims.clone.default)
def clone(a, memory_format=None):
    """A copy of `a`."""
    return jnp.copy(a)


@register(prims.copy_strided.default)
def copy_strided(a, stride: Sequence[int]):
    """A copy of `a` (JAX arrays have no strides)."""
    return jnp.copy(a)


@register(prims.device_put.default)
def device_put(a, device, non_blocking: bool = False):
    """A copy of `a` (it stays a JAX array)."""
    return jnp.copy(a)


@register(prims.copy_to.default)
def copy_to(a, b):
    """The value written into `a` (the interpreter writes it back): `b` cast to `a`'s dtype."""
    b = _convert(b, a.dtype)
    return jnp.reshape(b, a.shape) if b.size == a.size and b.ndim != a.ndim else jnp.broadcast_to(b, a.shape)


@register(prims.resize.default)
def resize(a, shape: Sequence[int]):
    """`a` unchanged when `shape` is its shape; JAX-backed tensors cannot change size."""
    if tuple(shape) != tuple(a.shape):
        raise RuntimeError(
            f"jaxtorch: prims.resize cannot resize a JAX-backed tensor from {a.shape} to {tuple(shape)}."
        )
    return a


@register(prims.item.default, data_dependent=True)
def item(a):
    """The Python number held by the one-element tensor `a` (eager only)."""
    return a.reshape(()).item()


@register(prims.maximum_value.default)
def maximum_value(dtype):
    """The largest value of `dtype` (inf for floats, True for bool)."""
    return _extreme(dtype, True)


@register(prims.minimum_value.default)
def minimum_value(dtype):
    """The smallest value of `dtype` (-inf for floats, False for bool)."""
    return _extreme(dtype, False)


def _extreme(dtype, largest: bool):
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return largest
    if category(dtype) == _INT:
        info = jnp.iinfo(dtype)
        return int(info.max if largest else info.min)
    return math.inf if largest else -math.inf


# ---- reductions ----------------------------------------------------------------------------
@register(prims.sum.default)
def sum_(inp, dims: Sequence[int] | None, *, output_dtype=None):
    """Sum over `dims` (all dims when empty), in `output_dtype` if given."""
    if output_dtype is None and inp.dtype == np.bool_:
        output_dtype = canonical_int()
    return jnp.sum(inp, axis=_dims(dims, inp.ndim), dtype=output_dtype)


@register(prims.prod.default)
def prod(inp, dims: Sequence[int] | None, *, output_dtype=None):
    """Product over `dims` (none when empty), in `output_dtype` if given."""
    if output_dtype is None and inp.dtype == np.bool_:
        output_dtype = canonical_int()
    axes = _dims(dims, inp.ndim, empty_is_all=False)
    out = jnp.prod(inp, axis=axes, dtype=output_dtype) if axes else inp
    return out if output_dtype is None else out.astype(output_dtype)


@register(prims.amax.default)
def amax(inp, dims: Sequence[int] | None, *, output_dtype=None):
    """Maximum over `dims` (NaN propagates)."""
    out = jnp.max(inp, axis=_dims(dims, inp.ndim))
    return out if output_dtype is None else out.astype(output_dtype)


@register(prims.amin.default)
def amin(inp, dims: Sequence[int] | None, *, output_dtype=None):
    """Minimum over `dims` (NaN propagates)."""
    out = jnp.min(inp, axis=_dims(dims, inp.ndim))
    return out if output_dtype is None else out.astype(output_dtype)


@register(prims.xor_sum.default)
def xor_sum(inp, dims: Sequence[int] | None, *, output_dtype=None):
    """Bitwise xor over `dims`."""
    axes = _dims(dims, inp.ndim)
    zero = np.array(0, inp.dtype).item() if inp.dtype != np.bool_ else False
    out = lax.reduce(inp, np.array(zero, inp.dtype), lax.bitwise_xor, axes)
    return out if output_dtype is None else out.astype(output_dtype)


@register(prims.var.default)
def var(inp, dims: Sequence[int] | None, correction: float | None = 1, *, output_dtype=None):
    """Variance over `dims` with divisor `max(N - correction, 0)`; real for complex input."""
    axes = _dims(dims, inp.ndim)
    n = math.prod(inp.shape[d] for d in axes)
    correction = 1 if correction is None else correction
    centered = inp - jnp.mean(inp, axis=axes, keepdims=True)
    sq = jnp.real(centered * jnp.conj(centered)) if category(inp.dtype) == _COMPLEX else centered * centered
    out = jnp.sum(sq, axis=axes) / max(n - correction, 0)
    return out if output_dtype is None else out.astype(output_dtype)


# ---- factories -----------------------------------------------------------------------------
@register(prims.iota.default)
def iota(length: int, *, start: int, step: int, dtype, device=None, requires_grad: bool = False):
    """`[start, start + step, ...]`, `length` integers of `dtype`."""
    return start + step * jnp.arange(length, dtype=dtype)


@register(prims.full.default)
def full(shape: Sequence[int], fill_value, *, dtype, device=None, requires_grad: bool = False):
    """A `shape` tensor of `dtype` filled with `fill_value`."""
    return jnp.full(tuple(shape), fill_value, dtype)


@register(prims.full_like.default)
def full_like(a, fill_value, *, dtype, device=None, requires_grad: bool = False):
    """A tensor of `a`'s shape and `dtype` filled with `fill_value`."""
    return jnp.full(a.shape, fill_value, dtype)


@register(prims.empty.default)
def empty(shape: Sequence[int], *, dtype, device=None, requires_grad: bool = False):
    """Zeros (JAX has no uninitialized memory)."""
    return jnp.zeros(tuple(shape), dtype)


@register(prims.empty_strided.default)
def empty_strided(shape: Sequence[int], strides: Sequence[int], *, dtype, device=None, requires_grad: bool = False):
    """Zeros of `shape` (JAX arrays have no strides)."""
    return jnp.zeros(tuple(shape), dtype)


@register(prims.empty_permuted.default)
def empty_permuted(
    shape: Sequence[int], physical_layout: Sequence[int], *, dtype, device=None, requires_grad: bool = False
):
    """Zeros of `shape` (JAX arrays have no physical layout)."""
    return jnp.zeros(tuple(shape), dtype)


@register(prims.scalar_tensor.default)
def scalar_tensor(s, *, dtype=None, device=None):
    """A 0-dim tensor holding `s` (default float dtype when `dtype` is None, like torch)."""
    if dtype is None:
        dtype = default_float() if not isinstance(s, complex) else np.dtype(np.complex64)
    return jnp.asarray(s, dtype=dtype)


# ---- random --------------------------------------------------------------------------------
@register(prims.normal.default, random=True)
def normal(shape: Sequence[int], *, mean, std, dtype, device=None, requires_grad: bool = False, generator=None, key):
    """Normal samples with `mean` and `std` (from the bridge's key; `generator` is ignored)."""
    return (mean + std * jax.random.normal(key, tuple(shape), dtype)).astype(dtype)


@register(prims.uniform.default, random=True)
def uniform(shape: Sequence[int], *, low, high, dtype, device=None, stride=None, generator=None, key):
    """Uniform samples in `[low, high)` (from the bridge's key; `generator` is ignored)."""
    return jax.random.uniform(key, tuple(shape), dtype, low, high)


# ---- linear algebra and FFT ----------------------------------------------------------------
@register(prims.svd.default)
def svd(A, *, full_matrices: bool):
    """(U, S, Vh) with `A == U @ diag(S) @ Vh`."""
    u, s, vh = jnp.linalg.svd(A, full_matrices=full_matrices)
    return u, s, vh


@register(prims.fft_r2c.default)
def fft_r2c(a, *, dim: Sequence[int], onesided: bool):
    """Unnormalized real-to-complex FFT over `dim`; `onesided` keeps half of the last."""
    if onesided:
        return jnp.fft.rfftn(a, axes=tuple(dim))
    return jnp.fft.fftn(a, axes=tuple(dim))


@register(prims.fft_c2c.default)
def fft_c2c(a, *, dim: Sequence[int], forward: bool):
    """Unnormalized complex FFT (or inverse FFT) over `dim`."""
    if forward:
        return jnp.fft.fftn(a, axes=tuple(dim))
    return jnp.fft.ifftn(a, axes=tuple(dim), norm="forward")


@register(prims.fft_c2r.default)
def fft_c2r(a, *, dim: Sequence[int], last_dim_size: int):
    """Unnormalized complex-to-real inverse FFT over `dim`; the last has `last_dim_size` points."""
    s = [a.shape[d] for d in dim[:-1]] + [last_dim_size]
    return jnp.fft.irfftn(a, s=s, axes=tuple(dim), norm="forward")
