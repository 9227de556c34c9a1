"""Elementwise lowerings: arithmetic, comparison, logical, bitwise and unary math.

Each lowering is the math only: `@elementwise(...)` (from `_semantics`) promotes the
operands torch's way and casts the result, and the interpreter derives the in-place
(`add_`) and `out=` overloads from the functional ones registered here.

Forms are chosen so that `jax.grad` of a lowering equals torch's autograd formula
(e.g. `clamp` sends the gradient to the input at the bounds, as torch does, and
`sinc`/`xlogy` use `jnp.where`-safe operands so no NaN leaks into the gradient).

Example:
    ```python
    import jax.numpy as jnp, torch, jaxtorch
    jaxtorch.call_torch(lambda a, b: torch.remainder(a, b), jnp.array([-7, 7]), jnp.array([3, -3]))
    # Array([ 2, -2], dtype=int32): the sign of the divisor, as in torch
    ```

Notes:
- `float_power` computes in float64 only when JAX's 64-bit mode is on; otherwise torch's
  composite casts to float64 before the op reaches jaxtorch and raises `Float64Error`.
- `torch.int64` is stored as int32 without 64-bit mode, so integer overflow and the width
  used by shifts (`bitwise_left_shift` by 32..63) follow 32 bits.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import jax.scipy.special as jss
import numpy as np
import torch
from jax import lax

from ..bridge.dtypes import x64_enabled
from ._semantics import (ALWAYS_BOOL, COMPLEX_TO_FLOAT, DEFAULT, INT_TO_FLOAT, category, elementwise,
                         is_array, to_float)
from .registry import register

aten = torch.ops.aten

_INT = 1


def _is_int(x) -> bool:
    """Integer or bool array (or Python int/bool)."""
    if is_array(x):
        return category(x.dtype) <= _INT
    return isinstance(x, (bool, int))


def _is_bool(x) -> bool:
    return is_array(x) and x.dtype == np.bool_


def _is_complex(x) -> bool:
    return is_array(x) and jnp.issubdtype(x.dtype, jnp.complexfloating)


def _like(x, ref):
    """`x` (a Python scalar or array) as an array of `ref`'s dtype, for ops that need arrays."""
    return jnp.asarray(x, dtype=ref.dtype) if not is_array(x) or x.dtype != ref.dtype else x


def _float_like(*xs):
    return next(x for x in xs if is_array(x))


# ---------------------------------------------------------------------------------------
# arithmetic
# ---------------------------------------------------------------------------------------
@register(aten.add.Tensor, aten.add.Scalar)
@elementwise(DEFAULT, n=2)
def add(a, b, alpha=1):
    """`a + alpha * b`; bool + bool is logical or. `add(int_t, int_t)` stays integer."""
    return a + (b * alpha if alpha != 1 else b)


@register(aten.sub.Tensor, aten.sub.Scalar)
@elementwise(DEFAULT, n=2)
def sub(a, b, alpha=1):
    """`a - alpha * b`."""
    return a - (b * alpha if alpha != 1 else b)


@register(aten.rsub.Tensor, aten.rsub.Scalar)
@elementwise(DEFAULT, n=2)
def rsub(a, b, alpha=1):
    """`b - alpha * a` (torch's `other - self`)."""
    return b - (a * alpha if alpha != 1 else a)


@register(aten.mul.Tensor, aten.mul.Scalar)
@elementwise(DEFAULT)
def mul(a, b):
    """`a * b`; bool * bool is logical and."""
    if _is_bool(a) and (_is_bool(b) or isinstance(b, bool)):
        return jnp.logical_and(a, b)
    return a * b


@elementwise(INT_TO_FLOAT)
def _true_div(a, b):
    return a / b


def _trunc_div(a, b):
    if _is_int(a) and _is_int(b):
        ref = _float_like(a, b)
        return lax.div(*jnp.broadcast_arrays(_like(a, ref), _like(b, ref)))
    return jnp.trunc(a / b)


def _floor_div_float(a, b):
    """torch's `div_floor_floating`: Python's float floor division, inf/nan on b == 0."""
    a, b = jnp.asarray(a), _like(b, jnp.asarray(a))
    mod = jnp.fmod(a, b)  # broadcasts
    d = (a - mod) / b
    d = jnp.where((mod != 0) & ((b < 0) != (mod < 0)), d - 1, d)
    fl = jnp.floor(d)
    fl = jnp.where(d - fl > 0.5, fl + 1, fl)
    q = a / b
    return jnp.where(b == 0, q, jnp.where(d != 0, fl, jnp.copysign(jnp.zeros_like(q), q)))


def _floor_div(a, b):
    if _is_int(a) and _is_int(b):
        if _is_bool(a) and (_is_bool(b) or isinstance(b, bool)):
            raise RuntimeError('"div_floor_cpu" not implemented for \'Bool\'')
        return jnp.floor_divide(a, b)
    return _floor_div_float(a, b)


@elementwise(DEFAULT, n=2)
def _div_mode(a, b, mode):
    if mode == "trunc":
        out = _trunc_div(a, b)
    elif mode == "floor":
        out = _floor_div(a, b)
    else:
        raise ValueError(f"div expected rounding_mode to be one of None, 'trunc', or 'floor' but found '{mode}'")
    return lax.stop_gradient(out)  # torch: rounding division has a zero gradient


@register(aten.div.Tensor, aten.div.Scalar, aten.div.Tensor_mode, aten.div.Scalar_mode,
          aten.true_divide.Tensor, aten.true_divide.Scalar)
def div(a, b, rounding_mode=None):
    """True division (ints -> float), or `rounding_mode` "trunc" (C) / "floor" (Python)."""
    if rounding_mode is None:
        return _true_div(a, b)
    return _div_mode(a, b, rounding_mode)


@register(aten.floor_divide.default, aten.floor_divide.Scalar)
def floor_divide(a, b):
    """`torch.floor_divide` == `div(..., rounding_mode="floor")`."""
    return _div_mode(a, b, "floor")


@register(aten.remainder.Tensor, aten.remainder.Scalar, aten.remainder.Scalar_Tensor)
@elementwise(DEFAULT)
def remainder(a, b):
    """Python's modulus: the result has the sign of the divisor."""
    if _is_int(a) and _is_int(b):
        return jnp.remainder(a, b)
    ref = _float_like(a, b)
    a, b = jnp.broadcast_arrays(_like(a, ref), _like(b, ref))
    mod = lax.rem(a, b)
    return jnp.where((mod != 0) & ((b < 0) != (mod < 0)), mod + b, mod)


@register(aten.fmod.Tensor, aten.fmod.Scalar)
@elementwise(DEFAULT)
def fmod(a, b):
    """C's fmod: the result has the sign of the dividend."""
    ref = _float_like(a, b)
    return lax.rem(*jnp.broadcast_arrays(_like(a, ref), _like(b, ref)))


def _int_pow(a, b):
    """torch's integer power: negative exponents give 0 except for bases 1 and -1."""
    if isinstance(b, int) and not isinstance(b, bool):
        if b < 0:
            raise RuntimeError("Integers to negative integer powers are not allowed.")
        return lax.integer_pow(a, b) if is_array(a) else jnp.power(a, b)
    ref = _float_like(a, b)
    a, b = _like(a, ref), _like(b, ref)
    if a.dtype == np.bool_:
        return jnp.logical_or(a, ~b)
    pos = jnp.power(a, jnp.maximum(b, 0))
    neg = jnp.where(a == 1, 1, jnp.where(a == -1, jnp.where(b % 2 == 0, 1, -1), 0)).astype(a.dtype)
    return jnp.where(b < 0, neg, pos)


@register(aten.pow.Tensor_Tensor, aten.pow.Tensor_Scalar, aten.pow.Scalar)
@elementwise(DEFAULT)
def power(a, b):
    """`a ** b` with torch's integer and zero-exponent semantics."""
    if _is_int(a) and _is_int(b):
        return _int_pow(a, b)
    if isinstance(b, (int, float)) and not isinstance(b, bool) and float(b).is_integer() and abs(b) <= 64:
        if not _is_complex(a):
            return lax.integer_pow(a, int(b))
    ref = _float_like(a, b)
    return jnp.power(_like(a, ref), _like(b, ref))


@register(aten.float_power.Tensor_Tensor, aten.float_power.Tensor_Scalar, aten.float_power.Scalar)
def float_power(a, b):
    """`pow` in double precision (float64/complex128 only in JAX's 64-bit mode)."""
    cplx = _is_complex(a) or _is_complex(b) or isinstance(a, complex) or isinstance(b, complex)
    wide = (np.complex128 if cplx else np.float64) if x64_enabled() else (np.complex64 if cplx else np.float32)
    a = a.astype(wide) if is_array(a) else a
    b = b.astype(wide) if is_array(b) else b
    return jnp.power(a, b).astype(wide)


@register(aten.neg.default)
@elementwise(DEFAULT)
def neg(a):
    """`-a` (bool is rejected by torch)."""
    if _is_bool(a):
        raise RuntimeError("Negation, the `-` operator, on a bool tensor is not supported.")
    return -a


@register(aten.reciprocal.default)
@elementwise(INT_TO_FLOAT)
def reciprocal(a):
    """`1 / a`; ints -> float."""
    return 1 / a


@register(aten.positive.default)
def positive(a):
    """Identity (a view in torch)."""
    return a


@register(aten.addcmul.default)
@elementwise(DEFAULT, n=3)
def addcmul(a, t1, t2, value=1):
    """`a + value * t1 * t2`."""
    return a + (value * (t1 * t2) if value != 1 else t1 * t2)


@register(aten.addcdiv.default)
@elementwise(DEFAULT, n=3)
def addcdiv(a, t1, t2, value=1):
    """`a + value * t1 / t2` (integer t1/t2 are rejected by torch)."""
    if _is_int(t1) and _is_int(t2):
        raise RuntimeError("Integer division with addcdiv is no longer supported.")
    return a + (value * (t1 / t2) if value != 1 else t1 / t2)


@register(aten.lerp.Scalar, aten.lerp.Tensor)
@elementwise(DEFAULT)
def lerp(a, end, weight):
    """torch's two-sided linear interpolation (exact at both ends)."""
    diff = end - a
    return jnp.where(jnp.abs(weight) < 0.5, a + weight * diff, end - diff * (1 - weight))


@register(aten.copysign.Tensor, aten.copysign.Scalar)
@elementwise(INT_TO_FLOAT)
def copysign(a, b):
    """`|a|` with the sign bit of `b`."""
    ref = _float_like(a, b)
    a, b = _like(a, ref), _like(b, ref)
    return jnp.where(jnp.signbit(b), -jnp.abs(a), jnp.abs(a))


@jax.custom_jvp
def _nextafter(a, b):
    return jnp.nextafter(a, b)


# torch: d/da = 1, d/db = 0
_nextafter.defjvp(lambda primals, tangents: (_nextafter(*primals), jnp.broadcast_to(
    _zero_tangent(tangents[0], primals[0]), jnp.broadcast_shapes(primals[0].shape, primals[1].shape))))


def _zero_tangent(t, x):
    return jnp.zeros_like(x) if type(t) is jax.custom_derivatives.SymbolicZero else t


@register(aten.nextafter.default)
@elementwise(DEFAULT)
def nextafter(a, b):
    """The next float after `a` towards `b` (gradient 1 w.r.t. `a`, as torch)."""
    ref = _float_like(a, b)
    return _nextafter(_like(a, ref), _like(b, ref))


@register(aten.hypot.default)
@elementwise(DEFAULT)
def hypot(a, b):
    """`sqrt(a**2 + b**2)` without overflow."""
    return jnp.hypot(a, b)


@register(aten.ldexp.Tensor)
@elementwise(INT_TO_FLOAT)
def ldexp(a, b):
    """`a * 2 ** b`."""
    return a * jnp.exp2(b)


def _safe_log(x, bad):
    return jnp.log(jnp.where(bad, jnp.ones_like(x), x))


@register(aten.xlogy.Tensor, aten.xlogy.Scalar_Self, aten.xlogy.Scalar_Other)
@elementwise(INT_TO_FLOAT)
def xlogy(x, y):
    """`x * log(y)`, 0 where `x == 0` (unless `y` is NaN)."""
    ref = _float_like(x, y)
    x, y = jnp.broadcast_arrays(_like(x, ref), _like(y, ref))
    zero = x == 0
    out = jnp.where(zero, jnp.zeros_like(x), x * _safe_log(y, zero))
    return jnp.where(jnp.isnan(y), y, out)


@register(aten.special_xlog1py.default, aten.special_xlog1py.self_scalar, aten.special_xlog1py.other_scalar)
@elementwise(INT_TO_FLOAT)
def xlog1py(x, y):
    """`x * log1p(y)`, 0 where `x == 0` (unless `y` is NaN)."""
    ref = _float_like(x, y)
    x, y = jnp.broadcast_arrays(_like(x, ref), _like(y, ref))
    zero = x == 0
    out = jnp.where(zero, jnp.zeros_like(x), x * jnp.log1p(jnp.where(zero, jnp.zeros_like(y), y)))
    return jnp.where(jnp.isnan(y), y, out)


@register(aten.logaddexp.default)
@elementwise(INT_TO_FLOAT)
def logaddexp(a, b):
    """`log(exp(a) + exp(b))`, stable."""
    return jnp.logaddexp(a, b)


@register(aten.logaddexp2.default)
@elementwise(INT_TO_FLOAT)
def logaddexp2(a, b):
    """`log2(2**a + 2**b)`, stable."""
    return jnp.logaddexp2(a, b)


# ---------------------------------------------------------------------------------------
# clamping, min/max
# ---------------------------------------------------------------------------------------
def _clamp(x, lo, hi):
    # where-forms: the gradient goes to `x` at the bounds (torch), NaN in x or a bound propagates
    if lo is not None:
        x = jnp.where(x < lo, lo, x)
        if not _is_int(lo):
            x = jnp.where(jnp.isnan(lo), lo, x) if is_array(lo) else (x if lo == lo else jnp.full_like(x, lo))
    if hi is not None:
        x = jnp.where(x > hi, hi, x)
        if not _is_int(hi):
            x = jnp.where(jnp.isnan(hi), hi, x) if is_array(hi) else (x if hi == hi else jnp.full_like(x, hi))
    return x


@register(aten.clamp.default, aten.clamp.Tensor, aten.clip.default, aten.clip.Tensor)
@elementwise(DEFAULT)
def clamp(x, min=None, max=None):  # noqa: A002
    """`min(max(x, min), max)`; if `min > max` every element becomes `max`."""
    if min is None and max is None:
        raise RuntimeError("torch.clamp: At least one of 'min' or 'max' must not be None")
    return _clamp(x, min, max)


@register(aten.clamp_min.default, aten.clamp_min.Tensor)
@elementwise(DEFAULT)
def clamp_min(x, min):  # noqa: A002
    """`clamp(x, min=min)`."""
    return _clamp(x, min, None)


@register(aten.clamp_max.default, aten.clamp_max.Tensor)
@elementwise(DEFAULT)
def clamp_max(x, max):  # noqa: A002
    """`clamp(x, max=max)`."""
    return _clamp(x, None, max)


@register(aten.maximum.default, aten.max.other)
@elementwise(DEFAULT)
def maximum(a, b):
    """Elementwise max, NaN-propagating; ties split the gradient like torch."""
    return jnp.logical_or(a, b) if _is_bool(a) else jnp.maximum(a, b)


@register(aten.minimum.default, aten.min.other)
@elementwise(DEFAULT)
def minimum(a, b):
    """Elementwise min, NaN-propagating."""
    return jnp.logical_and(a, b) if _is_bool(a) else jnp.minimum(a, b)


@register(aten.fmax.default)
@elementwise(DEFAULT)
def fmax(a, b):
    """Elementwise max ignoring NaN; ties give the gradient to `a`, as torch."""
    if _is_int(a):
        return jnp.maximum(a, b)
    return jnp.where((a >= b) | jnp.isnan(b), a, b)


@register(aten.fmin.default)
@elementwise(DEFAULT)
def fmin(a, b):
    """Elementwise min ignoring NaN."""
    if _is_int(a):
        return jnp.minimum(a, b)
    return jnp.where((a <= b) | jnp.isnan(b), a, b)


# ---------------------------------------------------------------------------------------
# sign, rounding
# ---------------------------------------------------------------------------------------
@register(aten.abs.default)
@elementwise(COMPLEX_TO_FLOAT)
def absolute(a):
    """`|a|` (complex -> its real dtype)."""
    return a if _is_bool(a) else jnp.abs(a)


@register(aten.sign.default)
@elementwise(DEFAULT)
def sign(a):
    """-1, 0 or 1; `sign(nan) == 0`, as in torch."""
    if _is_bool(a):
        return a
    if _is_int(a):
        return jnp.sign(a)
    return lax.stop_gradient((a > 0).astype(a.dtype) - (a < 0).astype(a.dtype))


@register(aten.sgn.default)
@elementwise(DEFAULT)
def sgn(a):
    """`sign` for real tensors; `a / |a|` (0 at 0) for complex ones."""
    if _is_complex(a):
        mag = jnp.abs(a)
        safe = jnp.where(mag == 0, jnp.ones_like(mag), mag)
        return jnp.where(mag == 0, jnp.zeros_like(a), a / safe)
    return sign(a)


@register(aten.signbit.default)
@elementwise(ALWAYS_BOOL)
def signbit(a):
    """Whether the sign bit is set (True for -0.0)."""
    if _is_bool(a):
        return jnp.zeros_like(a)
    return a < 0 if _is_int(a) else jnp.signbit(a)


@register(aten.floor.default)
@elementwise(DEFAULT)
def floor(a):
    """Round down (integers unchanged)."""
    return a if _is_int(a) else jnp.floor(a)


@register(aten.ceil.default)
@elementwise(DEFAULT)
def ceil(a):
    """Round up (integers unchanged)."""
    return a if _is_int(a) else jnp.ceil(a)


@register(aten.trunc.default, aten.fix.default)
@elementwise(DEFAULT)
def trunc(a):
    """Round toward zero (integers unchanged)."""
    return a if _is_int(a) else jnp.trunc(a)


@register(aten.frac.default)
@elementwise(DEFAULT)
def frac(a):
    """`a - trunc(a)`."""
    return a - lax.stop_gradient(jnp.trunc(a))


@register(aten.round.default, aten.round.decimals)
@elementwise(DEFAULT)
def round_half_even(a, decimals=0):
    """Round half to even, at `decimals` digits (negative: to tens, hundreds, ...)."""
    if _is_int(a):
        return a
    if decimals == 0:
        return jnp.round(a)
    if decimals > 0:
        p = 10.0 ** decimals
        return jnp.round(a * p) / p
    p = 10.0 ** (-decimals)
    return jnp.round(a / p) * p


# ---------------------------------------------------------------------------------------
# exponentials, logs, powers, trigonometry
# ---------------------------------------------------------------------------------------
_SIMPLE = {
    aten.exp.default: jnp.exp, aten.exp2.default: jnp.exp2, aten.expm1.default: jnp.expm1,
    aten.log.default: jnp.log, aten.log2.default: jnp.log2, aten.log10.default: jnp.log10,
    aten.log1p.default: jnp.log1p, aten.sqrt.default: jnp.sqrt, aten.rsqrt.default: lax.rsqrt,
    aten.sin.default: jnp.sin, aten.cos.default: jnp.cos, aten.tan.default: jnp.tan,
    aten.asin.default: jnp.arcsin, aten.acos.default: jnp.arccos, aten.atan.default: jnp.arctan,
    aten.sinh.default: jnp.sinh, aten.cosh.default: jnp.cosh, aten.tanh.default: jnp.tanh,
    aten.asinh.default: jnp.arcsinh, aten.acosh.default: jnp.arccosh, aten.atanh.default: jnp.arctanh,
    aten.arcsin.default: jnp.arcsin, aten.arccos.default: jnp.arccos, aten.arctan.default: jnp.arctan,
    aten.arcsinh.default: jnp.arcsinh, aten.arccosh.default: jnp.arccosh, aten.arctanh.default: jnp.arctanh,
    aten.sigmoid.default: jax.nn.sigmoid, aten.special_expit.default: jax.nn.sigmoid,
    aten.erf.default: lax.erf, aten.erfc.default: lax.erfc, aten.erfinv.default: lax.erf_inv,
    aten.special_erfcx.default: jss.erfcx, aten.lgamma.default: lax.lgamma,
    aten.i0.default: jss.i0, aten.special_i0e.default: jss.i0e, aten.special_i1.default: jss.i1,
    aten.special_i1e.default: jss.i1e, aten.special_modified_bessel_i0.default: jss.i0,
    aten.special_modified_bessel_i1.default: jss.i1, aten.special_ndtr.default: jss.ndtr,
    aten.special_ndtri.default: jss.ndtri, aten.special_log_ndtr.default: jss.log_ndtr,
}


def _make_unary(f):
    def lowering(a):
        return f(a)

    lowering.__name__ = getattr(f, "__name__", "unary")
    lowering.__doc__ = f"`{lowering.__name__}` of a tensor (ints/bool -> the default float dtype)."
    return elementwise(INT_TO_FLOAT)(lowering)


for _op, _f in _SIMPLE.items():
    register(_op)(_make_unary(_f))


@register(aten.atan2.default, aten.arctan2.default)
@elementwise(INT_TO_FLOAT)
def atan2(a, b):
    """The angle of the point `(b, a)`."""
    return jnp.arctan2(a, b)


@register(aten.square.default)
@elementwise(DEFAULT)
def square(a):
    """`a * a` (bool -> int64 as in torch's `pow(a, 2)`)."""
    if _is_bool(a):
        return a.astype(jnp.int32)
    return a * a


@register(aten.deg2rad.default)
@elementwise(INT_TO_FLOAT)
def deg2rad(a):
    """Degrees to radians."""
    return a * (math.pi / 180.0)


@register(aten.rad2deg.default)
@elementwise(INT_TO_FLOAT)
def rad2deg(a):
    """Radians to degrees."""
    return a * (180.0 / math.pi)


@register(aten.logit.default)
@elementwise(INT_TO_FLOAT)
def logit(a, eps=None):
    """`log(a / (1 - a))`, with `a` clamped to `[eps, 1 - eps]` when `eps` is given."""
    if eps is not None:
        a = _clamp(a, eps, 1 - eps)
    return jnp.log(a / (1 - a))


@register(aten.sinc.default, aten.special_sinc.default)
@elementwise(INT_TO_FLOAT)
def sinc(a):
    """`sin(pi a) / (pi a)`, 1 at 0 (zero gradient there)."""
    zero = a == 0
    x = jnp.pi * jnp.where(zero, jnp.ones_like(a), a)
    return jnp.where(zero, jnp.ones_like(a), jnp.sin(x) / x)


@register(aten.special_spherical_bessel_j0.default)
@elementwise(INT_TO_FLOAT)
def spherical_bessel_j0(a):
    """`sin(a) / a`, 1 at 0."""
    zero = a == 0
    x = jnp.where(zero, jnp.ones_like(a), a)
    return jnp.where(zero, jnp.ones_like(a), jnp.sin(x) / x)


@register(aten.special_entr.default)
@elementwise(INT_TO_FLOAT)
def entr(a):
    """`-a log a` for `a > 0`, 0 at 0, -inf below 0."""
    pos = a > 0
    out = -a * jnp.log(jnp.where(pos, a, jnp.ones_like(a)))
    out = jnp.where(pos, out, jnp.where(a == 0, jnp.zeros_like(a), -jnp.inf))
    return jnp.where(jnp.isnan(a), a, out)


# ---- gamma family (ports of ATen's Math.h, so negative arguments agree with torch) -------
_ZETA_A = (12.0, -720.0, 30240.0, -1209600.0, 47900160.0, -1.8924375803183791606e9, 7.47242496e10,
           -2.950130727918164224e12, 1.1646782814350067249e14, -4.5979787224074726105e15,
           1.8152105401943546773e17, -7.1661652561756670113e18)


def _pow_signed(a, e):
    """`a ** e` also for negative `a` when `e` is an integer (as C's pow)."""
    mag = jnp.power(jnp.abs(a), e)
    odd = jnp.mod(e, 2) == 1
    return jnp.where(a < 0, jnp.where(odd, -mag, mag), mag)


def _zeta_value(x, q):
    """Hurwitz zeta by Euler-Maclaurin summation (Cephes `zeta`, as in ATen)."""
    x, q = jnp.broadcast_arrays(x, q)
    s0 = _pow_signed(q, -x)

    def cond(state):
        i, a, _, _ = state
        return (i < 9) | jnp.any(a <= 9.0)

    def body(state):
        i, a, s, b = state
        active = (i < 9) | (a <= 9.0)
        a1 = a + 1
        b1 = _pow_signed(a1, -x)
        return i + 1, jnp.where(active, a1, a), jnp.where(active, s + b1, s), jnp.where(active, b1, b)

    finite_q = jnp.where(jnp.isfinite(q), q, jnp.zeros_like(q))
    _, w, s, b = lax.while_loop(cond, body, (0, finite_q, s0, jnp.zeros_like(s0)))
    s = s + b * w / (x - 1) - 0.5 * b
    a, k = jnp.ones_like(s), 0.0
    for coef in _ZETA_A:
        a = a * (x + k)
        b = b / w
        s = s + a * b / coef
        k += 1.0
        a = a * (x + k)
        b = b / w
        k += 1.0
    s = jnp.where(jnp.isfinite(q), s, s0)
    s = jnp.where((q <= 0) & (q == jnp.floor(q)), jnp.inf, s)
    s = jnp.where((q <= 0) & (x != jnp.floor(x)), jnp.nan, s)
    s = jnp.where(x < 1, jnp.nan, s)
    return jnp.where(x == 1, jnp.inf, s)


@jax.custom_jvp
def _zeta(x, q):
    return _zeta_value(x, q)


@functools.partial(_zeta.defjvp, symbolic_zeros=True)
def _zeta_jvp(primals, tangents):
    x, q = primals
    tx, tq = tangents
    if type(tx) is not jax.custom_derivatives.SymbolicZero:
        raise NotImplementedError("jaxtorch: the derivative of zeta w.r.t. its first argument is not "
                                  "implemented (nor is it in torch).")
    out = _zeta(x, q)
    if type(tq) is jax.custom_derivatives.SymbolicZero:
        return out, jnp.zeros_like(out)
    return out, -x * _zeta(x + 1, q) * tq


def _trigamma_value(x):
    reflect = x < 0.5
    sin_pi_x = jnp.sin(jnp.pi * x)
    result = jnp.where(reflect, -(jnp.pi * jnp.pi) / (sin_pi_x * sin_pi_x), jnp.zeros_like(x))
    x = jnp.where(reflect, 1 - x, x)
    for _ in range(6):
        result = result + 1 / (x * x)
        x = x + 1
    ixx = 1 / (x * x)
    result = result + (1 + 1 / (2 * x) + ixx * (1.0 / 6 - ixx * (1.0 / 30 - ixx * (1.0 / 42)))) / x
    return jnp.where(reflect, -result, result)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _polygamma_value(n: int, x):
    if n == 0:
        return jnp.where(x == 0, jnp.copysign(jnp.full_like(x, jnp.inf), -x), lax.digamma(x))
    if n == 1:
        return _trigamma_value(x)
    return (1.0 if n % 2 else -1.0) * math.exp(math.lgamma(n + 1.0)) * _zeta(jnp.full_like(x, n + 1.0), x)


@_polygamma_value.defjvp
def _polygamma_jvp(n, primals, tangents):
    (x,), (t,) = primals, tangents
    return _polygamma_value(n, x), _polygamma_value(n + 1, x) * t


@register(aten.digamma.default, aten.special_psi.default, aten.special_digamma.default)
@elementwise(INT_TO_FLOAT)
def digamma(a):
    """psi(a); `digamma(±0) = ∓inf` as in torch."""
    return _polygamma_value(0, a)


@elementwise(INT_TO_FLOAT, n=1)
def _polygamma(a, n):
    return _polygamma_value(n, a)


@register(aten.polygamma.default, aten.special_polygamma.default)
def polygamma(n, a):
    """The `n`-th derivative of digamma (torch's formulas, valid for negative `a`)."""
    if n < 0:
        raise RuntimeError("polygamma(n, x) does not support negative n.")
    return _polygamma(a, n)


@register(aten.mvlgamma.default, aten.special_multigammaln.default)
@elementwise(INT_TO_FLOAT, n=1)
def mvlgamma(a, p):
    """Multivariate log-gamma of dimension `p`."""
    i = jnp.arange(p, dtype=a.dtype)
    return jnp.sum(lax.lgamma(a[..., None] - i / 2), axis=-1) + (p * (p - 1) / 4) * math.log(math.pi)


@register(aten.special_zeta.default, aten.special_zeta.self_scalar, aten.special_zeta.other_scalar)
@elementwise(INT_TO_FLOAT)
def zeta(x, q):
    """Hurwitz zeta function (inf at x == 1, NaN for x < 1)."""
    ref = _float_like(x, q)
    return _zeta(*jnp.broadcast_arrays(_like(x, ref), _like(q, ref)))


@register(aten.igamma.default, aten.special_gammainc.default)
@elementwise(INT_TO_FLOAT)
def igamma(a, x):
    """Regularized lower incomplete gamma P(a, x)."""
    return jss.gammainc(a, x)


@register(aten.igammac.default, aten.special_gammaincc.default)
@elementwise(INT_TO_FLOAT)
def igammac(a, x):
    """Regularized upper incomplete gamma Q(a, x)."""
    return jss.gammaincc(a, x)


@register(aten.nan_to_num.default)
@elementwise(DEFAULT)
def nan_to_num(a, nan=None, posinf=None, neginf=None):
    """NaN -> `nan` (0), +inf -> `posinf` (dtype max), -inf -> `neginf` (dtype min)."""
    if _is_int(a):
        return a
    info = jnp.finfo(jnp.real(a).dtype)
    hi = info.max if posinf is None else posinf
    lo = info.min if neginf is None else neginf
    nan = 0.0 if nan is None else nan
    if _is_complex(a):
        re, im = (nan_to_num(p, nan, posinf, neginf) for p in (jnp.real(a), jnp.imag(a)))
        return lax.complex(re, im)
    out = jnp.where(jnp.isnan(a), jnp.asarray(nan, a.dtype), a)
    out = jnp.where(a == jnp.inf, jnp.asarray(hi, a.dtype), out)
    return jnp.where(a == -jnp.inf, jnp.asarray(lo, a.dtype), out)


@register(aten.frexp.Tensor)
def frexp(a):
    """(mantissa in [0.5, 1), int32 exponent)."""
    m, e = jnp.frexp(a)
    return m, e.astype(jnp.int32)


# ---------------------------------------------------------------------------------------
# classification
# ---------------------------------------------------------------------------------------
@register(aten.isnan.default)
@elementwise(ALWAYS_BOOL)
def isnan(a):
    """True where NaN (never for integers)."""
    return jnp.zeros(a.shape, bool) if _is_int(a) else jnp.isnan(a)


@register(aten.isinf.default)
@elementwise(ALWAYS_BOOL)
def isinf(a):
    """True where ±inf."""
    return jnp.zeros(a.shape, bool) if _is_int(a) else jnp.isinf(a)


@register(aten.isfinite.default)
@elementwise(ALWAYS_BOOL)
def isfinite(a):
    """True where neither NaN nor ±inf."""
    return jnp.ones(a.shape, bool) if _is_int(a) else jnp.isfinite(a)


@register(aten.isposinf.default)
@elementwise(ALWAYS_BOOL)
def isposinf(a):
    """True where +inf."""
    return jnp.zeros(a.shape, bool) if _is_int(a) else a == jnp.inf


@register(aten.isneginf.default)
@elementwise(ALWAYS_BOOL)
def isneginf(a):
    """True where -inf."""
    return jnp.zeros(a.shape, bool) if _is_int(a) else a == -jnp.inf


@register(aten.isreal.default)
@elementwise(ALWAYS_BOOL)
def isreal(a):
    """True where the imaginary part is 0 (everywhere for real dtypes)."""
    return jnp.imag(a) == 0 if _is_complex(a) else jnp.ones(a.shape, bool)


# ---------------------------------------------------------------------------------------
# comparison, logical
# ---------------------------------------------------------------------------------------
def _compare(op, fn):
    def lowering(a, b):
        return fn(a, b)

    lowering.__name__ = op.__name__
    lowering.__doc__ = f"`{op.__name__}` after promoting both operands to their common dtype (bool result)."
    return register(getattr(op, "Tensor"), getattr(op, "Scalar"))(elementwise(ALWAYS_BOOL)(lowering))


eq = _compare(aten.eq, lambda a, b: a == b)
ne = _compare(aten.ne, lambda a, b: a != b)
lt = _compare(aten.lt, lambda a, b: a < b)
le = _compare(aten.le, lambda a, b: a <= b)
gt = _compare(aten.gt, lambda a, b: a > b)
ge = _compare(aten.ge, lambda a, b: a >= b)
for _alias, _fn in [(aten.not_equal, ne), (aten.less, lt), (aten.less_equal, le), (aten.greater, gt),
                    (aten.greater_equal, ge)]:
    register(_alias.Tensor, _alias.Scalar)(_fn)


def _truth(x):
    return x if _is_bool(x) else x != 0


@register(aten.logical_and.default)
def logical_and(a, b):
    """Elementwise `a and b` of truth values (bool result)."""
    return jnp.logical_and(_truth(a), _truth(b))


@register(aten.logical_or.default)
def logical_or(a, b):
    """Elementwise `a or b` of truth values."""
    return jnp.logical_or(_truth(a), _truth(b))


@register(aten.logical_xor.default)
def logical_xor(a, b):
    """Elementwise `a xor b` of truth values."""
    return jnp.logical_xor(_truth(a), _truth(b))


@register(aten.logical_not.default)
def logical_not(a):
    """Elementwise `not a` (NaN is truthy)."""
    return jnp.logical_not(_truth(a))


# ---------------------------------------------------------------------------------------
# bitwise
# ---------------------------------------------------------------------------------------
def _check_integral(*xs):
    for x in xs:
        if (is_array(x) and not _is_int(x)) or isinstance(x, float):
            raise RuntimeError("bitwise ops are only defined for integral and boolean tensors")


@register(aten.bitwise_and.Tensor, aten.bitwise_and.Scalar, aten.bitwise_and.Scalar_Tensor,
          aten.__and__.Tensor, aten.__and__.Scalar)
@elementwise(DEFAULT)
def bitwise_and(a, b):
    """`a & b` (logical and for bool)."""
    _check_integral(a, b)
    return jnp.bitwise_and(a, b)


@register(aten.bitwise_or.Tensor, aten.bitwise_or.Scalar, aten.bitwise_or.Scalar_Tensor,
          aten.__or__.Tensor, aten.__or__.Scalar)
@elementwise(DEFAULT)
def bitwise_or(a, b):
    """`a | b`."""
    _check_integral(a, b)
    return jnp.bitwise_or(a, b)


@register(aten.bitwise_xor.Tensor, aten.bitwise_xor.Scalar, aten.bitwise_xor.Scalar_Tensor,
          aten.__xor__.Tensor, aten.__xor__.Scalar)
@elementwise(DEFAULT)
def bitwise_xor(a, b):
    """`a ^ b`."""
    _check_integral(a, b)
    return jnp.bitwise_xor(a, b)


@register(aten.bitwise_not.default)
@elementwise(DEFAULT)
def bitwise_not(a):
    """`~a` (logical not for bool)."""
    _check_integral(a)
    return jnp.invert(a)


def _bits(x) -> int:
    return jnp.iinfo(x.dtype).bits


@register(aten.bitwise_left_shift.Tensor, aten.bitwise_left_shift.Tensor_Scalar,
          aten.bitwise_left_shift.Scalar_Tensor, aten.__lshift__.Tensor, aten.__lshift__.Scalar)
@elementwise(DEFAULT)
def bitwise_left_shift(a, b):
    """`a << b`; 0 when `b` is negative or at least the bit width (torch)."""
    _check_integral(a, b)
    ref = _float_like(a, b)
    a, b = jnp.broadcast_arrays(_like(a, ref), _like(b, ref))
    bits = _bits(a)
    out = lax.shift_left(a, jnp.clip(b, 0, bits - 1).astype(a.dtype))
    return jnp.where((b < 0) | (b >= bits), jnp.zeros_like(a), out)


@register(aten.bitwise_right_shift.Tensor, aten.bitwise_right_shift.Tensor_Scalar,
          aten.bitwise_right_shift.Scalar_Tensor, aten.__rshift__.Tensor, aten.__rshift__.Scalar)
@elementwise(DEFAULT)
def bitwise_right_shift(a, b):
    """`a >> b` (arithmetic for signed types); out-of-range shifts fill with the sign bit."""
    _check_integral(a, b)
    ref = _float_like(a, b)
    a, b = jnp.broadcast_arrays(_like(a, ref), _like(b, ref))
    bits = _bits(a)
    signed = jnp.issubdtype(a.dtype, jnp.signedinteger)
    amount = jnp.where((b < 0) | (b >= bits), bits - 1 if signed else 0, b).astype(a.dtype)
    if signed:
        return lax.shift_right_arithmetic(a, amount)
    return jnp.where((b < 0) | (b >= bits), jnp.zeros_like(a), lax.shift_right_logical(a, amount))


# ---------------------------------------------------------------------------------------
# number theory, misc
# ---------------------------------------------------------------------------------------
@register(aten.heaviside.default)
@elementwise(DEFAULT)
def heaviside(a, values):
    """0 below 0, `values` at 0, 1 above 0."""
    return jnp.where(a == 0, values, (a > 0).astype(a.dtype)).astype(a.dtype)


@register(aten.gcd.default)
@elementwise(DEFAULT)
def gcd(a, b):
    """Greatest common divisor (non-negative)."""
    return jnp.gcd(a, b)


@register(aten.lcm.default)
@elementwise(DEFAULT)
def lcm(a, b):
    """Least common multiple (non-negative)."""
    return jnp.lcm(a, b)


@register(aten.angle.default)
def angle(a):
    """Argument of a complex number; `pi` for negative reals, 0 otherwise (NaN kept)."""
    if _is_complex(a):
        return jnp.angle(a)
    a = a.astype(to_float(a.dtype))
    out = jnp.where(a < 0, jnp.pi, 0.0).astype(a.dtype)
    return lax.stop_gradient(jnp.where(jnp.isnan(a), a, out))


@register(aten.complex.default)
def make_complex(real, imag):
    """`real + i imag`."""
    return lax.complex(real, imag)


@register(aten.polar.default)
def polar(r, theta):
    """`r * (cos(theta) + i sin(theta))`."""
    return lax.complex(r * jnp.cos(theta), r * jnp.sin(theta))
