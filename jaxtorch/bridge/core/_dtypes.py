"""Dtype conversion between torch and JAX, in one place.

With JAX's 64-bit mode off (its default), JAX stores 64-bit integers as 32-bit ones:
`torch.int64` tensors are held as `int32` arrays and reported to torch as `torch.int64`,
so torch code that expects `long` indices keeps working. float64 and complex128 follow
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

from ._errors import Float64Error

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
def _to_torch_dtype(dtype: np.dtype, x64: bool) -> torch.dtype:
    if not x64 and dtype == np.dtype("int32"):
        return torch.int64
    if not x64 and dtype == np.dtype("uint32"):
        return torch.uint64
    try:
        return _NP_TO_TORCH[dtype]
    except KeyError:
        raise TypeError(f"jaxtorch: JAX dtype {dtype} has no torch equivalent.") from None


def to_torch_dtype(dtype) -> torch.dtype:
    """The torch dtype reported for a JAX array of `dtype` (int32 reads as int64 without x64)."""
    return _to_torch_dtype(np.dtype(dtype), x64_enabled())


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
