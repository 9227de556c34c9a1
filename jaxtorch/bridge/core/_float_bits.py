"""float32 arithmetic, correctly rounded, in int32 arithmetic: GradScaler's scale and its inverse.

`f32_reciprocal` is the float32 `1 / scale` that torch's GradScaler computes through float64
(`scale.double().reciprocal().float()`); `_product_bits` the float32 product torch's scale update
rounds once. Both are exact wherever XLA's float32 arithmetic is not (subnormals flushed on the CPU,
division not correctly rounded on GPUs). The lowerings (`jaxtorch/ops/amp.py`) and the GradScaler
methods (`jaxtorch/bridge/dispatch/_grad_scaler.py`) both use them, so they live in the core.

Example: `f32_reciprocal(jnp.float32(3.0))` is `jnp.float32(1 / 3)` (0.33333334).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


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
