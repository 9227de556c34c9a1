"""Creation lowerings: zeros/ones/full/empty, *_like and new_*, arange/range/linspace/logspace,
eye, tril/triu indices, kaiser_window, fill/zero, complex/polar.

Factories take their shape and scalars as static Python values, so every lowering here
builds a JAX value of static shape. `empty*` returns zeros (JAX has no uninitialized
memory). Dtypes follow torch: with `dtype=None`, `full` and `arange` infer it from their
Python scalars (bool -> bool, int -> int64, float -> the default float, complex -> the
default complex), `*_like`/`new_*` keep the input's dtype, everything else uses the
default float dtype. `device`, `layout`, `pin_memory` and `memory_format` are accepted
and ignored: placement is the JAX array's own.

Example:
    ```python
    jaxtorch.call_torch(lambda: torch.arange(1, 4) * torch.ones(3))   # Array([1., 2., 3.])
    ```
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from ..bridge.core._dtypes import canonical_int, check_int_value, default_float
from ..bridge.core._registry import register

aten = torch.ops.aten


# ---- dtype inference -------------------------------------------------------------------------
def _default_complex() -> np.dtype:
    return np.dtype(np.complex128) if default_float() == np.float64 else np.dtype(np.complex64)


def scalar_dtype(*values) -> np.dtype:
    """The dtype torch infers for a factory from Python scalars (`torch.full((2,), 3)` is int64).

    **Example:** `scalar_dtype(1, 2.5)` is the default float dtype.
    """
    if any(isinstance(v, complex) for v in values):
        return _default_complex()
    if any(isinstance(v, float) for v in values):
        return default_float()
    if all(isinstance(v, bool) for v in values):
        return np.dtype(np.bool_)
    return canonical_int()


def _shape(size: Sequence[int] | int) -> tuple[int, ...]:
    if isinstance(size, int):
        return (size,)
    return tuple(int(s) for s in size)


def _full(shape, value, dtype) -> jax.Array:
    """`jnp.full`, with a complex fill into a real dtype keeping the real part, as torch does."""
    if isinstance(value, complex) and not jnp.issubdtype(dtype, jnp.complexfloating):
        value = value.real
    check_int_value(value, dtype, "a fill value")  # int64 beyond 32 bits without x64: refused, never wrapped
    return jnp.full(shape, value, dtype)


# ---- zeros / ones / full / empty -------------------------------------------------------------
@register(aten.zeros.default)
def zeros(size, dtype=None, layout=None, device=None, pin_memory=None):
    """`torch.zeros(2, 3)`: zeros of the default float dtype unless `dtype` is given."""
    return jnp.zeros(_shape(size), dtype or default_float())


@register(aten.ones.default)
def ones(size, dtype=None, layout=None, device=None, pin_memory=None):
    """`torch.ones(2, 3)`."""
    return jnp.ones(_shape(size), dtype or default_float())


@register(aten.full.default)
def full(size, fill_value, dtype=None, layout=None, device=None, pin_memory=None):
    """`torch.full((2,), 3)`: the dtype follows the fill value (int64 here) unless given."""
    return _full(_shape(size), fill_value, dtype or scalar_dtype(fill_value))


@register(aten.empty.memory_format)
def empty(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    """`torch.empty(2, 3)`: zeros (JAX has no uninitialized memory)."""
    return jnp.zeros(_shape(size), dtype or default_float())


@register(aten.empty_strided.default)
def empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
    """`torch.empty_strided((2, 3), (1, 2))`: zeros; strides are not observable on JAX values."""
    return jnp.zeros(_shape(size), dtype or default_float())


@register(aten.empty_permuted.default)
def empty_permuted(size, physical_layout, dtype=None, layout=None, device=None, pin_memory=None):
    """`torch.empty_permuted((2, 3), (1, 0))`: zeros of the logical shape."""
    return jnp.zeros(_shape(size), dtype or default_float())


@register(aten.scalar_tensor.default)
def scalar_tensor(s, dtype=None, layout=None, device=None, pin_memory=None):
    """`torch.scalar_tensor(3)`: a 0-dim tensor, of the default float dtype unless given."""
    return _full((), s, dtype or default_float())


# ---- *_like and new_* ------------------------------------------------------------------------
@register(aten.zeros_like.default)
def zeros_like(a, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    """`torch.zeros_like(x)`."""
    return jnp.zeros(a.shape, dtype or a.dtype)


@register(aten.ones_like.default)
def ones_like(a, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    """`torch.ones_like(x)`."""
    return jnp.ones(a.shape, dtype or a.dtype)


@register(aten.empty_like.default)
def empty_like(a, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    """`torch.empty_like(x)`: zeros."""
    return jnp.zeros(a.shape, dtype or a.dtype)


@register(aten.full_like.default)
def full_like(a, fill_value, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    """`torch.full_like(x, 2.5)`: keeps `x`'s dtype (the fill value is cast)."""
    return _full(a.shape, fill_value, dtype or a.dtype)


@register(aten.new_zeros.default)
def new_zeros(a, size, dtype=None, layout=None, device=None, pin_memory=None):
    """`x.new_zeros(2, 3)`: `x`'s dtype unless given."""
    return jnp.zeros(_shape(size), dtype or a.dtype)


@register(aten.new_ones.default)
def new_ones(a, size, dtype=None, layout=None, device=None, pin_memory=None):
    """`x.new_ones(2, 3)`."""
    return jnp.ones(_shape(size), dtype or a.dtype)


@register(aten.new_empty.default)
def new_empty(a, size, dtype=None, layout=None, device=None, pin_memory=None):
    """`x.new_empty(2, 3)`: zeros."""
    return jnp.zeros(_shape(size), dtype or a.dtype)


@register(aten.new_empty_strided.default)
def new_empty_strided(a, size, stride, dtype=None, layout=None, device=None, pin_memory=None):
    """`x.new_empty_strided((2, 3), (3, 1))`: zeros."""
    return jnp.zeros(_shape(size), dtype or a.dtype)


@register(aten.new_full.default)
def new_full(a, size, fill_value, dtype=None, layout=None, device=None, pin_memory=None):
    """`x.new_full((2,), 7)`: `x`'s dtype unless given (not inferred from the fill value)."""
    return _full(_shape(size), fill_value, dtype or a.dtype)


# ---- fill / zero -----------------------------------------------------------------------------
@register(aten.fill.Scalar, aten.fill.Tensor)
def fill(a, value):
    """`x.fill_(v)` (`v` a number or a 0-dim tensor): `x`'s shape and dtype, every element `v`.

    The interpreter writes the result into `x` for the in-place `fill_`.
    """
    if hasattr(value, "shape"):
        if value.ndim != 0:
            raise RuntimeError(
                f"fill_ only supports 0-dimension value tensor but got tensor with {value.ndim} dimensions."
            )
        if jnp.iscomplexobj(value) and not jnp.iscomplexobj(a):
            value = jnp.real(value)
        return jnp.broadcast_to(value.astype(a.dtype), a.shape)
    return _full(a.shape, value, a.dtype)


@register(aten.zero.default)
def zero(a):
    """`x.zero_()`: zeros of `x`'s shape and dtype."""
    return jnp.zeros(a.shape, a.dtype)


# ---- ranges ----------------------------------------------------------------------------------
def _check_range(start, end, step) -> None:
    if step == 0:
        raise RuntimeError("step must be nonzero")
    if not all(math.isfinite(v) for v in (start, end, step) if not isinstance(v, complex)):
        raise RuntimeError(f"unsupported range: {start} -> {end}")
    if (step > 0 and end < start) or (step < 0 and end > start):
        raise RuntimeError("upper bound and larger bound inconsistent with step sign")


def _as_number(x):
    """A static Python number from a scalar argument (a concrete 0-dim array is accepted)."""
    if isinstance(x, (int, float, bool, complex)):
        return x
    return np.asarray(x).item()


@register(aten.arange.default, aten.arange.start, aten.arange.start_step)
def arange(start, end=None, step=1, dtype=None, layout=None, device=None, pin_memory=None):
    """`torch.arange(start, end, step)`, with torch's dtype and length rules.

    Integer arguments give int64, any float argument the default float dtype. The length
    is `ceil((end - start) / step)`; for int64 results (or all-integer arguments) the
    arguments are truncated to integers first, as ATen does. (Without JAX's 64-bit mode
    int64 and int32 are both stored as int32, so an explicit `dtype=torch.int32` with float
    arguments follows the int64 rule.)

    **Example:** `torch.arange(0, 1, 0.25)` is `[0., 0.25, 0.5, 0.75]`.
    """
    if end is None:
        start, end = 0, start
    if any(jax.export.is_symbolic_dim(v) for v in (start, end, step)):
        return _symbolic_arange(start, end, step, dtype)
    start, end, step = _as_number(start), _as_number(end), _as_number(step)
    _check_range(start, end, step)
    integer_args = all(isinstance(v, int) for v in (start, end, step))
    dtype = np.dtype(dtype) if dtype is not None else scalar_dtype(start, end, step)
    is_integer = jnp.issubdtype(dtype, jnp.integer)
    if integer_args or dtype == canonical_int():
        istart, iend, istep = int(start), int(end), int(step)
        if istep == 0:
            raise RuntimeError("step must be nonzero")
        sgn = (istep > 0) - (istep < 0)
        length = (iend - istart + istep - sgn) // istep
    else:
        length = math.ceil((end - start) / step)
    length = max(int(length), 0)
    if is_integer:
        for v in (int(start), int(start) + int(step) * max(length - 1, 0)):  # never wrapped (see `_dtypes`)
            check_int_value(v, dtype, "torch.arange")
        return (int(start) + int(step) * lax.iota(canonical_int(), length)).astype(dtype)
    index = lax.iota(np.int32, length)
    if integer_args:
        return (start + step * index).astype(dtype)
    compute = jnp.promote_types(dtype, np.float32)  # half types computed in float32, as ATen's acc type
    return (start + step * index.astype(compute)).astype(dtype)


def _symbolic_arange(start, end, step, dtype):
    """`arange` whose bounds are JAX symbolic sizes (a program of `jax.export` with a dynamic size):
    integer bounds and a concrete integer step, as torch's own sizes are.

    Example: `_symbolic_arange(0, jax.export.symbolic_shape("n")[0], 1, None)` has length `n`.
    """
    bounds = (start, end)
    if type(step) is not int or step == 0 or not all(type(v) is int or jax.export.is_symbolic_dim(v) for v in bounds):
        raise TypeError(f"jaxtorch: torch.arange({start}, {end}, {step}) of symbolic sizes needs integers, step != 0")
    length = (end - start + step - (1 if step > 0 else -1)) // step
    index = lax.iota(canonical_int(), length) * step + start
    return index.astype(np.dtype(dtype) if dtype is not None else canonical_int())


@register(aten.range.step, aten.range.default)
def range_(start, end, step=1, dtype=None, layout=None, device=None, pin_memory=None):
    """`torch.range(start, end, step)` (deprecated in torch): `end` included, the default float
    dtype unless `dtype` is given; values `start + i * step` in double precision, as ATen.

    **Example:** `torch.range(0, 1, 0.25)` is `[0., 0.25, 0.5, 0.75, 1.]`.
    """
    start, end, step = _as_number(start), _as_number(end), _as_number(step)
    _check_range(start, end, step)
    dtype = np.dtype(dtype) if dtype is not None else default_float()
    if jnp.issubdtype(dtype, jnp.integer):
        n = max(int((int(end) - int(start)) / int(step)) + 1, 0)
        for v in (int(start), int(start) + int(step) * max(n - 1, 0)):
            check_int_value(v, dtype, "torch.range")
        return (int(start) + int(step) * lax.iota(canonical_int(), n)).astype(dtype)
    n = max(int((end - start) / step + 1), 0)
    return jnp.asarray((float(start) + np.arange(n, dtype=np.float64) * float(step)).astype(dtype))


@register(aten.kaiser_window.default, aten.kaiser_window.periodic, aten.kaiser_window.beta)
def kaiser_window(
    window_length, periodic=True, beta=12.0, *, dtype=None, layout=None, device=None, pin_memory=None
) -> jax.Array:
    """`torch.kaiser_window(n, periodic, beta)`: `I0(beta * sqrt(1 - ((k - a) / a)^2)) / I0(beta)`,
    `a = (m - 1) / 2` over `m = n + 1` points when periodic (the last dropped), `n` otherwise.

    **Example:** `torch.kaiser_window(5, beta=8.0)` matches CPU torch to float32 rounding.
    """
    dtype = np.dtype(dtype) if dtype is not None else default_float()
    if not jnp.issubdtype(dtype, jnp.floating):
        raise RuntimeError("kaiser_window expects floating point dtypes")
    if window_length < 0:
        raise RuntimeError(f"kaiser_window requires non-negative window_length, got window_length={window_length}")
    if window_length <= 1:
        return jnp.ones((window_length,), dtype)
    m = window_length + 1 if periodic else window_length
    compute = jnp.promote_types(dtype, np.float32)  # (half types computed in float32, as ATen's opmath)
    k = lax.iota(compute, m)
    alpha = np.asarray((m - 1) / 2.0, compute)
    b = np.asarray(beta, compute)
    i0 = jax.scipy.special.i0
    w = i0(b * jnp.sqrt(jnp.abs(1 - ((k - alpha) / alpha) ** 2))) / i0(b)
    return w[:window_length].astype(dtype)


def _linspace_values(start, end, steps: int, compute) -> jax.Array:
    """torch's symmetric linspace: `start + i*step` for the first half, `end - (n-1-i)*step` after."""
    rg = lax.iota(np.int32, steps)
    step = (end - start) / (steps - 1)
    fwd = start + step * rg.astype(compute)
    bwd = end - step * ((steps - 1) - rg).astype(compute)
    return jnp.where(rg < steps / 2, fwd, bwd)


def _scalar_arg(x, name: str):
    if hasattr(x, "ndim"):
        if x.ndim != 0:
            raise RuntimeError(
                f"linspace only supports 0-dimensional start and end tensors, got {name} of shape {tuple(x.shape)}"
            )
    return x


@register(aten.linspace.default, aten.linspace.Tensor_Tensor, aten.linspace.Tensor_Scalar, aten.linspace.Scalar_Tensor)
def linspace(start, end, steps, dtype=None, layout=None, device=None, pin_memory=None):
    """`torch.linspace(start, end, steps)`; `start`/`end` may be 0-dim tensors (traced too).

    Integer dtypes truncate the float values, as torch does.
    """
    start, end = _scalar_arg(start, "start"), _scalar_arg(end, "end")
    if steps < 0:
        raise RuntimeError("number of steps must be non-negative")
    is_complex = any(isinstance(v, complex) or (hasattr(v, "dtype") and jnp.iscomplexobj(v)) for v in (start, end))
    dtype = np.dtype(dtype) if dtype is not None else (_default_complex() if is_complex else default_float())
    if steps == 0:
        return jnp.zeros((0,), dtype)
    compute = dtype if jnp.issubdtype(dtype, jnp.inexact) else default_float()
    compute = jnp.promote_types(compute, np.float32)
    if is_complex and not jnp.issubdtype(compute, jnp.complexfloating):
        compute = _default_complex()
    start = jnp.asarray(start).astype(compute) if hasattr(start, "dtype") else start
    end = jnp.asarray(end).astype(compute) if hasattr(end, "dtype") else end
    if steps == 1:
        return jnp.full((1,), start, compute).astype(dtype)
    out = _linspace_values(start, end, steps, compute)
    if not jnp.issubdtype(dtype, jnp.inexact):
        out = jnp.trunc(out) if not jnp.iscomplexobj(out) else out
    return out.astype(dtype)


@register(aten.logspace.default, aten.logspace.Tensor_Tensor, aten.logspace.Tensor_Scalar, aten.logspace.Scalar_Tensor)
def logspace(start, end, steps, base=10.0, dtype=None, layout=None, device=None, pin_memory=None):
    """`torch.logspace(start, end, steps, base)`: `base ** linspace(start, end, steps)`.

    For integer dtypes the exponents' endpoints are truncated first, as torch does.
    """
    start, end = _scalar_arg(start, "start"), _scalar_arg(end, "end")
    dtype = np.dtype(dtype) if dtype is not None else None
    is_complex = any(isinstance(v, complex) or (hasattr(v, "dtype") and jnp.iscomplexobj(v)) for v in (start, end))
    if dtype is not None and jnp.issubdtype(dtype, jnp.integer):
        start = int(start) if isinstance(start, float) else (start.astype(dtype) if hasattr(start, "dtype") else start)
        end = int(end) if isinstance(end, float) else (end.astype(dtype) if hasattr(end, "dtype") else end)
    out_dtype = dtype or (_default_complex() if is_complex else default_float())
    compute = _default_complex() if is_complex else jnp.promote_types(default_float(), np.float32)
    exps = linspace(start, end, steps, dtype=compute)
    out = jnp.power(jnp.asarray(base, compute), exps)
    if jnp.issubdtype(out_dtype, jnp.integer):
        out = jnp.trunc(out)
    return out.astype(out_dtype)


# ---- matrices and index sets -----------------------------------------------------------------
@register(aten.eye.default, aten.eye.m)
def eye(n, m=None, dtype=None, layout=None, device=None, pin_memory=None):
    """`torch.eye(n)` / `torch.eye(n, m)`."""
    if n < 0 or (m is not None and m < 0):
        raise RuntimeError(f"n and m must be non-negative, got n={n}, m={m}")
    return jnp.eye(int(n), None if m is None else int(m), dtype=dtype or default_float())


def _tri_indices(row: int, col: int, offset: int, upper: bool) -> np.ndarray:
    r, c = np.indices((row, col))
    mask = (c - r >= offset) if upper else (c - r <= offset)
    return np.stack([r[mask], c[mask]])


@register(aten.tril_indices.default)
def tril_indices(row, col, offset=0, dtype=None, layout=None, device=None, pin_memory=None):
    """`torch.tril_indices(3, 3)`: a `(2, N)` int64 tensor of lower-triangle coordinates, row-major."""
    return jnp.asarray(_tri_indices(row, col, offset, upper=False), dtype or canonical_int())


@register(aten.triu_indices.default)
def triu_indices(row, col, offset=0, dtype=None, layout=None, device=None, pin_memory=None):
    """`torch.triu_indices(3, 3, 1)`: upper-triangle coordinates above diagonal `offset`."""
    return jnp.asarray(_tri_indices(row, col, offset, upper=True), dtype or canonical_int())


# ---- complex construction --------------------------------------------------------------------
def _complex_of(real_dtype) -> np.dtype:
    return np.dtype(np.complex128) if np.dtype(real_dtype) == np.float64 else np.dtype(np.complex64)


@register(aten.complex.default)
def complex_(real, imag):
    """`torch.complex(re, im)`: both float tensors of one dtype, broadcast."""
    if real.dtype != imag.dtype or not jnp.issubdtype(real.dtype, jnp.floating):
        raise RuntimeError(
            f"Expected both inputs to be Half, Float or Double tensors but got {real.dtype} and {imag.dtype}"
        )
    real, imag = jnp.broadcast_arrays(real, imag)
    if real.dtype in (np.float16, jnp.bfloat16):
        real, imag = real.astype(np.float32), imag.astype(np.float32)
    return lax.complex(real, imag)


@register(aten.polar.default)
def polar(abs, angle):
    """`torch.polar(abs, angle)`: `abs * (cos(angle) + i sin(angle))`."""
    if abs.dtype != angle.dtype or not jnp.issubdtype(abs.dtype, jnp.floating):
        raise RuntimeError(f"Expected both inputs to be Float or Double tensors but got {abs.dtype} and {angle.dtype}")
    abs, angle = jnp.broadcast_arrays(abs, angle)
    return lax.complex(abs * jnp.cos(angle), abs * jnp.sin(angle))
