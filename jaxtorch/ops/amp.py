"""Gradient scaling for mixed precision: the kernels behind `torch.amp.GradScaler`.

Lowered from torch's CPU kernels (`aten/src/ATen/native/cpu/AmpGradScalerKernels.cpp`), which the
CUDA ones (`AmpKernels.cu`) match:

- `_amp_foreach_non_finite_check_and_unscale`: each gradient times `inv_scale` (half and bfloat16
  gradients in float32, rounded once), and `found_inf` set to 1.0 when any element is inf or NaN
  (left as it was otherwise);
- `_amp_update_scale`: the scale times `backoff_factor` after an inf/NaN, else the growth tracker
  counts the step and every `growth_interval` steps the scale grows by `growth_factor` (unless that
  would overflow float32).

`f32_reciprocal` (`bridge/core/_float_bits.py`) is the float32 `1 / scale` that GradScaler computes through float64
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

from ..bridge.core._errors import GradScalerError
from ..bridge.core._float_bits import _product_bits
from ..bridge.core._registry import register

aten = torch.ops.aten

_INT32 = np.iinfo(np.int32)


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
