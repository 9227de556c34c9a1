"""Dtype conversion between torch and JAX, in one place.

A tensor's torch dtype is its own, whatever JAX stores: with JAX's 64-bit mode off (its
default) JAX stores 64-bit integers as 32-bit ones, so a `torch.int64` tensor is held as an
`int32` array (and `uint64` as `uint32`) and is still reported as `torch.int64`, while a
`torch.int32` tensor, held as `int32` too, is `torch.int32`. The torch dtype travels with the
tensor (`JaxTensor`), and op results get torch's own result dtype (see the interpreter). A
bare JAX array copied by `to_torch` is what JAX holds: int32 is `torch.int32` (handed to
torch code by `torch_view`, JAX's default int32 is torch's default `int64`). Values of an
int64/uint64 tensor that do not fit in 32 bits are refused with
`Int64Error` where jaxtorch converts them (`.to("jax")`, `to_jax`, `extract`, factories);
arithmetic done in JAX on int64 data held as int32 wraps at 2**31 as int32 arithmetic does,
and jaxtorch cannot see that (turn 64-bit mode on for exact int64). torch's own int64
sentinels, `torch.iinfo(torch.int64).min/max` (the identity `torch.masked.amax` & co. fill masked
elements with), are refused the same way, with a note saying so: they are not saturated to
int32's bounds, which would change a fully masked row's result; `x.int()` is exact. float64 and complex128 follow
one rule: with 64-bit mode on they are what they say; with it off, jaxtorch never narrows
them silently: float64 data entering JAX (`.to("jax")`, `copy_`, `extract` of a `.double()`
model) and float64 asked for on the jax device (`dtype=torch.float64` in a factory or a
reduction, `.to(torch.float64)`, `.double()`, `torch.set_default_dtype(torch.float64)`)
raise `Float64Error`, which says how to turn 64-bit mode on or to use float32. The one
exception is a 0-dim scalar or a zero-element placeholder (how torch's internals pass
tolerances such as `matrix_rank`'s, wrap Python numbers, or stand in for `batch_norm`'s
unused statistics): no float64 data, and torch's type promotion never lets a 0-dim value
decide a tensor result's dtype; these are held as float32. NumPy arrays given to the
JAX-first functions are JAX's inputs and follow JAX's own conversion, as under `jax.jit`.

Example:
    ```python
    to_jax_dtype(torch.float32)   # dtype('float32')
    to_torch_dtype(jnp.bfloat16)  # torch.bfloat16
    ```
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import torch

from ._errors import Float64Error, Int64Error

_TORCH_TO_NP: dict[torch.dtype, np.dtype] = {
    torch.float32: np.dtype("float32"),
    torch.float64: np.dtype("float64"),
    torch.float16: np.dtype("float16"),
    torch.bfloat16: np.dtype(ml_dtypes.bfloat16),
    torch.int8: np.dtype("int8"),
    torch.int16: np.dtype("int16"),
    torch.int32: np.dtype("int32"),
    torch.int64: np.dtype("int64"),
    torch.uint8: np.dtype("uint8"),
    torch.uint16: np.dtype("uint16"),
    torch.uint32: np.dtype("uint32"),
    torch.uint64: np.dtype("uint64"),
    torch.bool: np.dtype("bool"),
    torch.complex64: np.dtype("complex64"),
    torch.complex128: np.dtype("complex128"),
    torch.float8_e4m3fn: np.dtype(ml_dtypes.float8_e4m3fn),
    torch.float8_e5m2: np.dtype(ml_dtypes.float8_e5m2),
}
_NP_TO_TORCH: dict[np.dtype, torch.dtype] = {v: k for k, v in _TORCH_TO_NP.items()}

_NARROW = {
    np.dtype("int64"): np.dtype("int32"),
    np.dtype("uint64"): np.dtype("uint32"),
    np.dtype("float64"): np.dtype("float32"),
    np.dtype("complex128"): np.dtype("complex64"),
}
_WIDE_FLOAT = (np.dtype("float64"), np.dtype("complex128"))


def x64_enabled() -> bool:
    """Whether JAX's 64-bit mode (`jax_enable_x64`) is on."""
    return bool(jax.config.read("jax_enable_x64"))


@functools.cache
def _to_jax_dtype(dtype: torch.dtype, x64: bool) -> np.dtype:
    try:
        np_dtype = _TORCH_TO_NP[dtype]
    except KeyError:
        raise TypeError(f"jaxtorch: torch dtype {dtype} has no JAX equivalent.") from None
    if not x64:
        if np_dtype in _WIDE_FLOAT:
            raise Float64Error(dtype)
        np_dtype = _NARROW.get(np_dtype, np_dtype)
    return np_dtype


def to_jax_dtype(dtype: torch.dtype) -> np.dtype:
    """The NumPy/JAX dtype that stores a torch tensor of `dtype` (int64 as int32 without x64;
    float64/complex128 without x64 raise `Float64Error`)."""
    return _to_jax_dtype(dtype, x64_enabled())


def scalar_jax_dtype(dtype: torch.dtype) -> np.dtype:
    """`to_jax_dtype` for a 0-dim scalar or zero-element placeholder: float64 narrows to float32
    without x64 (see above)."""
    if not x64_enabled() and dtype in (torch.float64, torch.complex128):
        return _NARROW[_TORCH_TO_NP[dtype]]
    return to_jax_dtype(dtype)


@functools.cache
def _to_torch_dtype(dtype: np.dtype) -> torch.dtype:
    try:
        return _NP_TO_TORCH[dtype]
    except KeyError:
        raise TypeError(f"jaxtorch: JAX dtype {dtype} has no torch equivalent.") from None


def to_torch_dtype(dtype) -> torch.dtype:
    """The torch dtype of a bare JAX array of `dtype`: the same type (int32 is `torch.int32`).

    A tensor's own dtype may differ (a `torch.int64` tensor is held as int32 without x64);
    that one travels with the tensor, see `holds`.
    """
    return _to_torch_dtype(np.dtype(dtype))


def holds(dtype: torch.dtype, jax_dtype) -> bool:
    """Whether a tensor of torch `dtype` is stored as a JAX array of `jax_dtype` (so an array
    of that dtype can be labelled `dtype`): `holds(torch.int64, jnp.int32)` without x64.

    Example: `holds(torch.int32, jnp.int32)` is True; `holds(torch.float32, jnp.int32)` False.
    """
    try:
        return to_jax_dtype(dtype) == jax_dtype
    except (TypeError, Float64Error):
        return False


_NARROWED = {torch.int64: np.iinfo(np.int32), torch.uint64: np.iinfo(np.uint32)}


def narrowed_range(dtype: torch.dtype) -> np.iinfo | None:
    """The 32-bit range that holds `dtype` (int64/uint64) with x64 off; None when nothing narrows."""
    if dtype not in _NARROWED or x64_enabled():
        return None
    return _NARROWED[dtype]


def check_int_range(low, high, dtype: torch.dtype, where: str = "") -> None:
    """Raise `Int64Error` when a value in [low, high] of torch `dtype` would wrap in JAX (int64 or
    uint64 values outside the 32-bit range with x64 off).

    Example: `check_int_range(0, 2**40, torch.int64, "torch.full")` raises without x64.
    """
    info = narrowed_range(dtype)
    if info is None:
        return
    if low < info.min:
        raise Int64Error(dtype, low, where + _sentinel_note(low, dtype))
    if high > info.max:
        raise Int64Error(dtype, high, where + _sentinel_note(high, dtype))


def _sentinel_note(value, dtype: torch.dtype) -> str:
    """Why torch's own code met an int64 sentinel, and the exact way out (no saturation: an int32
    stand-in for `iinfo(int64).min` would change what torch reports, e.g. `torch.masked.amax` of a
    fully masked row is -9223372036854775808, and `argmax` ties with a user value at int32's bound)."""
    info = torch.iinfo(dtype)
    if value not in (info.min, info.max):
        return ""
    which = "min" if value == info.min else "max"
    return (
        f" (torch.iinfo({dtype}).{which}: the identity torch's code fills with, e.g. for the masked-out "
        f"elements of torch.masked.amax/amin/argmax/argmin; it cannot be held in 32 bits, and an int32 "
        f"stand-in would change the result of a fully masked row; cast the input to torch.int32 "
        f"(`x.int()`), whose identity fits, or turn on 64-bit mode)"
    )


def check_int_value(value, dtype, where: str = "") -> None:
    """`check_int_range` for one Python scalar `value` given for a result of `dtype` (a torch
    dtype or the JAX dtype that stores int64/uint64 without x64); other values pass.

    Example: `check_int_value(2**40, torch.int64, "torch.full")` raises without x64.
    """
    if type(value) is not int or -(2**31) <= value < 2**31:  # (the common case: one comparison)
        return
    if not isinstance(dtype, torch.dtype):
        dtype = {np.dtype("int32"): torch.int64, np.dtype("uint32"): torch.uint64}.get(np.dtype(dtype))
        if dtype is None:
            return
    check_int_range(value, value, dtype, where)


def convert_dtype(x):
    """`torch.dtype` -> NumPy dtype and NumPy/JAX dtype -> `torch.dtype`; others unchanged."""
    if isinstance(x, torch.dtype):
        return to_jax_dtype(x)
    if isinstance(x, np.dtype) or (isinstance(x, type) and issubclass(x, np.generic)):
        return to_torch_dtype(x)
    return x


def default_float() -> np.dtype:
    """The JAX dtype of torch's current default float dtype (`torch.get_default_dtype()`)."""
    return to_jax_dtype(torch.get_default_dtype())


def canonical_int() -> np.dtype:
    """The JAX dtype that holds `torch.int64` (int32 without x64)."""
    return jnp.dtype(jnp.int64) if x64_enabled() else np.dtype("int32")
