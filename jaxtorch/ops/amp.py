"""Gradient scaling for mixed precision: the kernels behind `torch.amp.GradScaler`.

Lowered from torch's CPU kernels (`aten/src/ATen/native/cpu/AmpGradScalerKernels.cpp`), which the
CUDA ones (`AmpKernels.cu`) match:

- `_amp_foreach_non_finite_check_and_unscale`: each gradient times `inv_scale` (half and bfloat16
  gradients in float32, rounded once), and `found_inf` set to 1.0 when any element is inf or NaN
  (left as it was otherwise);
- `_amp_update_scale`: the scale times `backoff_factor` after an inf/NaN, else the growth tracker
  counts the step and every `growth_interval` steps the scale grows by `growth_factor` (unless that
  would overflow float32).

`f32_reciprocal` is the float32 `1 / scale` that GradScaler computes through float64
(`scale.double().reciprocal().float()`): the correctly rounded float32 reciprocal, computed here in
int32 arithmetic, so it needs no 64-bit mode and is exact wherever XLA's float32 division is not.

torch multiplies the float32 scale by the Python (float64) factor in double precision and rounds
the product to float32. That is the correctly rounded float32 product when the factor is a
float32 value (2.0, 0.5, 0.25, ...), computed here in int32 arithmetic too (XLA's float32
arithmetic on the CPU flushes a subnormal scale to zero); any other factor needs JAX's 64-bit
mode, and without it `GradScalerError` is raised instead of a scale that drifts from torch's.
The gradients themselves are unscaled by XLA's multiplication, as every other op computes.

Example:
    ```python
    scale, tracker = amp_update_scale(jnp.float32(65536.0), jnp.int32(0), jnp.float32(1.0), 2.0, 0.5, 2000)
    # scale == 32768.0, tracker == 0
    ```
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from ..bridge.core._errors import GradScalerError
from .registry import register

aten = torch.ops.aten

_INT32 = np.iinfo(np.int32)


# ---- float32 arithmetic, correctly rounded, in int32 arithmetic ----------------------------------
# (XLA on the CPU flushes float32 subnormals to zero, and its float32 division on GPUs is not
# correctly rounded: the scale, which every step depends on, is computed exactly instead)
def _split(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """float32 `x` as (sign bit, exponent field, fraction field, m, e): `|x| = m * 2**e` with the
    integer `m` in [2**23, 2**24) for finite nonzero `x` (subnormals normalized)."""
    u = lax.bitcast_convert_type(x, jnp.uint32)
    sign = u & jnp.uint32(0x80000000)
    e_bits = ((u >> 23) & 0xFF).astype(jnp.int32)
    frac = (u & 0x7FFFFF).astype(jnp.int32)
    sub = e_bits == 0
    raw = jnp.where(sub, frac, frac | 0x800000)
    lz = jnp.where(sub, lax.clz(jnp.maximum(raw, 1)) - 8, 0)
    return sign, e_bits, frac, raw << lz, jnp.where(sub, -149, e_bits - 150) - lz


def _rounded(sign: jax.Array, q: jax.Array, sticky: jax.Array, p: jax.Array) -> jax.Array:
    """The float32 nearest to `sign * (q + f) * 2**p` (ties to even), for an int32 `q` of 25 or 26
    bits and `0 <= f < 1` (`sticky`: `f != 0`); subnormal results and overflow to inf included."""
    nb = 32 - lax.clz(q)  # bit length of q
    eb = nb - 1 + p + 127  # biased exponent of the leading bit
    shift = jnp.clip(jnp.where(eb >= 1, nb - 24, nb - 23 - eb), 1, 31)  # bits dropped (more when subnormal)
    mant = q >> shift
    half = (q >> (shift - 1)) & 1
    rest = (q & ((1 << (shift - 1)) - 1)) | sticky.astype(jnp.int32)
    mant = mant + ((half == 1) & ((rest != 0) | ((mant & 1) == 1))).astype(jnp.int32)
    # a normal result: exponent field + 24-bit significand (its leading 1 adds the field's last unit,
    # and a rounding carry to 2**24 moves to the next binade); a subnormal one: the significand alone
    bits = jnp.where(eb >= 1, ((jnp.clip(eb, 1, 255) - 1) << 23) + mant, mant)
    bits = jnp.minimum(bits, 255 << 23)  # past the largest float32: inf
    return lax.bitcast_convert_type(bits.astype(jnp.uint32) | sign, jnp.float32)


def _reciprocal_bits(s: jax.Array) -> jax.Array:
    """`1 / s` rounded to nearest float32 (ties to even), for float32 `s`; inf/NaN/zero as IEEE.

    With `|s| = m * 2**e`, the 26-bit quotient `q = floor(2**48 / m)` comes from restoring division
    (the remainder `r` stays below 2**25), and `1/|s| = (q + r/m) * 2**(-e - 48)`.
    """
    sign, e_bits, frac, m, e = _split(s)
    r = jnp.full_like(m, 1 << 23)
    q = jnp.zeros_like(m)
    for _ in range(26):  # q = floor(2**48 / m), in (2**24, 2**25]
        bit = r >= m
        q = (q << 1) | bit.astype(jnp.int32)
        r = jnp.where(bit, r - m, r) << 1
    out = _rounded(sign, q, r != 0, -e - 48)
    inf = lax.bitcast_convert_type(sign | jnp.uint32(0x7F800000), jnp.float32)
    zero = lax.bitcast_convert_type(sign, jnp.float32)
    out = jnp.where(e_bits == 255, jnp.where(frac == 0, zero, s), out)  # 1/inf = 0, NaN stays NaN
    return jnp.where((e_bits == 0) & (frac == 0), inf, out)  # 1/0 = inf (with 0's sign)


def _product_bits(a: jax.Array, b: jax.Array) -> jax.Array:
    """`a * b` rounded to nearest float32 (ties to even), subnormals kept, for float32 `a`, `b`.

    The 48-bit product of the significands is formed from 12-bit halves (every partial product
    fits in int32): `P = H * 2**24 + L`; its leading 26 bits are rounded with the rest as sticky bit.
    """
    sa, ea_bits, fa, ma, ea = _split(a)
    sb, eb_bits, fb, mb, eb = _split(b)
    a1, a0, b1, b0 = ma >> 12, ma & 0xFFF, mb >> 12, mb & 0xFFF
    mid = a1 * b0 + a0 * b1  # < 2**25
    t = ((mid & 0xFFF) << 12) + a0 * b0  # < 2**25
    hi = a1 * b1 + (mid >> 12) + (t >> 24)  # P >> 24, in [2**22, 2**24)
    lo = t & 0xFFFFFF
    q = (hi << 2) | (lo >> 22)  # P >> 22: 25 or 26 bits
    sign = sa ^ sb
    out = _rounded(sign, q, (lo & 0x3FFFFF) != 0, ea + eb + 22)
    zero_a, zero_b = (ea_bits == 0) & (fa == 0), (eb_bits == 0) & (fb == 0)
    inf_a, inf_b = (ea_bits == 255) & (fa == 0), (eb_bits == 255) & (fb == 0)
    nan = ((ea_bits == 255) & (fa != 0)) | ((eb_bits == 255) & (fb != 0)) | (inf_a & zero_b) | (zero_a & inf_b)
    out = jnp.where(zero_a | zero_b, lax.bitcast_convert_type(sign, jnp.float32), out)
    out = jnp.where(inf_a | inf_b, lax.bitcast_convert_type(sign | jnp.uint32(0x7F800000), jnp.float32), out)
    return jnp.where(nan, jnp.float32(jnp.nan), out)


@jax.jit
def f32_reciprocal(x: jax.Array) -> jax.Array:
    """The float32 reciprocal of float32 `x`, rounded as `x.double().reciprocal().float()` rounds it.

    That is the correctly rounded float32 `1/x` (float64 holds enough bits that rounding twice
    rounds as once); it is computed in int32 arithmetic, so it needs no 64-bit mode and does not
    depend on how the backend divides (XLA's float32 division on GPUs is not correctly rounded).
    Checked against NumPy's float64 path on all 2**32 float32 bit patterns.

    **Arguments:** `x`: a float32 array.

    **Returns:** a float32 array of `x`'s shape.

    **Example:** `f32_reciprocal(jnp.float32(3.0))` is `jnp.float32(1 / 3)` (0.33333334).
    """
    return _reciprocal_bits(jnp.asarray(x, jnp.float32))


# ---- _amp_foreach_non_finite_check_and_unscale --------------------------------------------------
def _check_one_element_float(t, name: str) -> None:
    if t.size != 1:
        raise RuntimeError(f"{name} must be a 1-element tensor.")
    if t.dtype != jnp.float32:
        raise RuntimeError(f"{name} must be a float tensor.")


def _unscaled(g: jax.Array, inv_scale: jax.Array) -> jax.Array:
    """`g * inv_scale` as torch's kernel computes it: half types in float32 (rounded once),
    float32 in float32, float64 with the float32 inv_scale widened; `g` itself when inv_scale is 1."""
    if not jnp.issubdtype(g.dtype, jnp.floating):
        raise RuntimeError(f'"_amp_foreach_non_finite_check_and_unscale_cpu" not implemented for {g.dtype}')
    opmath = jnp.float32 if g.dtype in (jnp.float16, jnp.bfloat16) else g.dtype
    prod = (g.astype(opmath) * inv_scale.astype(opmath)).astype(g.dtype)
    return jnp.where(inv_scale == 1, g, prod)


@register(aten._amp_foreach_non_finite_check_and_unscale.default)
def amp_foreach_non_finite_check_and_unscale(grads, found_inf, inv_scale):
    """Unscale `grads` by `inv_scale`; `found_inf` becomes 1.0 if any element is inf or NaN.

    **Returns:** `(unscaled grads, found_inf)`.

    **Example:** `amp_foreach_non_finite_check_and_unscale([g], jnp.zeros(()), jnp.float32(0.5))`.
    """
    if not grads:
        return [], found_inf
    _check_one_element_float(inv_scale, "inv_scale")
    _check_one_element_float(found_inf, "found_inf")
    inv = inv_scale.reshape(())
    bad = jnp.zeros((), jnp.bool_)
    for g in grads:
        bad = bad | ~jnp.all(jnp.isfinite(g))
    return [_unscaled(g, inv) for g in grads], jnp.where(bad, jnp.ones_like(found_inf), found_inf)


# ---- _amp_update_scale -------------------------------------------------------------------------
def _is_float32(value: float) -> bool:
    """Whether float32 holds the Python float `value` exactly (NaN and the infinities included)."""
    with np.errstate(over="ignore"):
        return float(np.float32(value)) == value or value != value


def _factor(value, name: str) -> float:
    """The Python float `value`, checked to be one float32 holds exactly (or 64-bit mode on)."""
    value = float(value)  # (a traced float: ConcretizationTypeError; the executors then keep it static)
    if not _is_float32(value) and not jax.config.read("jax_enable_x64"):
        raise GradScalerError.inexact_factor(name, value)
    return value


def _times(scale: jax.Array, factor: float) -> jax.Array:
    """`float(scale * factor)` as torch computes it: the float32 scale times the float64 factor,
    in float64, rounded to float32 (the correctly rounded float32 product when the factor is a
    float32 value: float64 holds the product of two float32s exactly)."""
    if _is_float32(factor):
        return _product_bits(scale, jnp.float32(factor))
    return (scale.astype(jnp.float64) * jnp.float64(factor)).astype(jnp.float32)


@functools.partial(jax.jit, static_argnums=(3, 4, 5))
def _update_scale(scale, tracker, found_inf, growth_factor: float, backoff_factor: float, interval: int):
    found = found_inf != 0  # (NaN counts as found, as in C++)
    successful = tracker + 1
    at_interval = (successful == interval) if _INT32.min <= interval <= _INT32.max else jnp.zeros((), jnp.bool_)
    grown = _times(scale, growth_factor)
    grown_scale = jnp.where(jnp.isfinite(grown), grown, scale)  # never grow past float32 to inf
    new_scale = jnp.where(found, _times(scale, backoff_factor), jnp.where(at_interval, grown_scale, scale))
    new_tracker = jnp.where(found | at_interval, jnp.zeros_like(tracker), successful)
    return new_scale, new_tracker


@register(aten._amp_update_scale.default)
def amp_update_scale(scale, growth_tracker, found_inf, scale_growth_factor, scale_backoff_factor, growth_interval):
    """The new `(scale, growth_tracker)` after a step (`found_inf` nonzero: an inf/NaN was found).

    Raises `GradScalerError` for a factor float32 cannot hold exactly while 64-bit mode is off.

    **Example:** `amp_update_scale(jnp.float32(8.0), jnp.int32(1), jnp.float32(0.0), 2.0, 0.5, 2)`
    gives `(16.0, 0)`.
    """
    for t, name, dtype, what in (
        (growth_tracker, "growth_tracker", jnp.int32, "an int"),
        (scale, "current_scale", jnp.float32, "a float"),
        (found_inf, "found_inf", jnp.float32, "a float"),
    ):
        if t.size != 1:
            raise RuntimeError(f"{name} must be a 1-element tensor.")
        if t.dtype != dtype:
            raise RuntimeError(f"{name} must be {what} tensor.")
    growth = _factor(scale_growth_factor, "growth_factor")
    backoff = _factor(scale_backoff_factor, "backoff_factor")
    new_scale, new_tracker = _update_scale(
        scale.reshape(()), growth_tracker.reshape(()), found_inf.reshape(()), growth, backoff, int(growth_interval)
    )
    return new_scale.reshape(scale.shape), new_tracker.reshape(growth_tracker.shape)
