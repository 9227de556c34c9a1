"""Torch semantics shared by many lowerings: type promotion, dims, dtype categories.

Follows `torch._prims_common.elementwise_dtypes`: dimensioned tensors outrank
zero-dim tensors, which outrank Python scalars, within a category (bool < int < float <
complex); a higher category from a lower-ranked operand lifts the result to that
category's default dtype.

Example:
    ```python
    @register(aten.atan2)
    @elementwise(promote=INT_TO_FLOAT)
    def atan2(a, b):
        return jnp.arctan2(a, b)
    ```
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from .._compat import Tracer
from ..bridge.core._dtypes import canonical_int, default_float

DEFAULT, INT_TO_FLOAT, ALWAYS_BOOL, COMPLEX_TO_FLOAT, BOOL_TO_LONG, NO_PROMOTE = (
    "default",
    "int_to_float",
    "always_bool",
    "complex_to_float",
    "bool_to_long",
    "none",
)

_BOOL, _INT, _FLOAT, _COMPLEX = 0, 1, 2, 3


def category(dtype) -> int:
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return _BOOL
    if jnp.issubdtype(dtype, jnp.integer):
        return _INT
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return _COMPLEX
    return _FLOAT


def _scalar_category(x) -> int:
    if isinstance(x, bool):
        return _BOOL
    if isinstance(x, int):
        return _INT
    if isinstance(x, complex):
        return _COMPLEX
    return _FLOAT


def _default_for(cat: int):
    if cat == _BOOL:
        return np.dtype(np.bool_)
    if cat == _INT:
        return canonical_int()
    f = default_float()
    if cat == _COMPLEX:
        return np.dtype(np.complex128) if f == np.float64 else np.dtype(np.complex64)
    return f


def is_array(x) -> bool:
    return isinstance(x, (jax.Array, Tracer, np.ndarray))


def broadcast_shapes(*shapes: tuple) -> tuple:
    """NumPy's broadcast shape, also of shapes with JAX symbolic dimensions (`jax.export`).

    Example: `broadcast_shapes((2, 1), (3,))` is `(2, 3)`.
    """
    try:
        return tuple(np.broadcast_shapes(*shapes))
    except TypeError:  # a symbolic dimension: JAX's rule, which knows them
        return tuple(jax.lax.broadcast_shapes(*shapes))


def broadcast_to(x: jax.Array | np.ndarray, shape: tuple[int, ...]) -> jax.Array | np.ndarray:
    """NumPy-style broadcast of `x` to `shape` as one `lax.broadcast_in_dim`."""
    if x.shape == shape:
        return x
    return jax.lax.broadcast_in_dim(x, shape, tuple(range(len(shape) - x.ndim, len(shape))))


def binary(prim: Callable, fallback: Callable, a, b) -> jax.Array:
    """`prim(a, b)` with NumPy broadcasting for operands of one dtype, else `fallback(a, b)`.

    The `lax` primitive directly: `jnp`'s operators are jitted functions, and under a trace
    each call costs a jit cache lookup and an inline (most of the time of tracing a model).
    A Python scalar becomes a constant of the array operand's dtype when it fits; mixed
    dtypes and scalars that do not fit go to `fallback` (the `jnp` operator).

    Example: `binary(lax.add, operator.add, jnp.ones((2, 3)), jnp.ones(3))` -> 2x3 array of 2.0.
    """
    try:
        if not is_array(a):
            a = np.asarray(a, b.dtype) if type(a) is not complex or b.dtype.kind == "c" else a
        elif not is_array(b):
            b = np.asarray(b, a.dtype) if type(b) is not complex or a.dtype.kind == "c" else b
    except (OverflowError, ValueError):
        return fallback(a, b)
    if not (is_array(a) and is_array(b)) or a.dtype != b.dtype:
        return fallback(a, b)
    if a.shape != b.shape:
        shape = broadcast_shapes(a.shape, b.shape)
        a, b = broadcast_to(a, shape), broadcast_to(b, shape)
    return prim(a, b)


def result_type(*args) -> np.dtype:
    """torch's promoted dtype of tensors (JAX arrays) and Python scalars in `args`."""
    dim_t, zero_t, scalars = None, None, -1
    for a in args:
        if a is None:
            continue
        if is_array(a):
            if a.ndim > 0:
                dim_t = a.dtype if dim_t is None else jnp.promote_types(dim_t, a.dtype)
            else:
                zero_t = a.dtype if zero_t is None else jnp.promote_types(zero_t, a.dtype)
        elif isinstance(a, (bool, int, float, complex)):
            scalars = max(scalars, _scalar_category(a))
    result = dim_t
    if zero_t is not None:
        if result is None or category(zero_t) > category(result):
            result = zero_t if result is None or category(zero_t) > category(result) else result
    if scalars >= 0:
        if result is None:
            result = _default_for(scalars)
        elif scalars > category(result):
            if scalars == _COMPLEX and category(result) == _FLOAT:
                result = np.dtype(np.complex128) if np.dtype(result) == np.float64 else np.dtype(np.complex64)
            else:
                result = _default_for(scalars)
    if result is None:
        result = default_float()
    return np.dtype(result)


def to_float(dtype) -> np.dtype:
    """int/bool -> the default float dtype; float/complex unchanged."""
    return default_float() if category(dtype) < _FLOAT else np.dtype(dtype)


def to_real(dtype) -> np.dtype:
    """complex -> its real dtype."""
    dtype = np.dtype(dtype)
    if category(dtype) == _COMPLEX:
        return np.dtype(np.float64) if dtype == np.complex128 else np.dtype(np.float32)
    return dtype


def _cast(x, dtype):
    if is_array(x):
        return x if x.dtype == dtype else x.astype(dtype)
    return x


def elementwise(promote: str = DEFAULT, n: int | None = None) -> Callable:
    """Decorator: promote the array/scalar arguments torch's way, then cast the result.

    `n` limits promotion to the first `n` positional arguments (the rest pass through).
    Python scalars stay Python scalars (JAX treats them as weakly typed).
    """

    def deco(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            operands = args if n is None else args[:n]
            dtype = result_type(*operands)
            if promote == INT_TO_FLOAT:
                compute = to_float(dtype)
            elif promote in (DEFAULT, ALWAYS_BOOL, COMPLEX_TO_FLOAT, BOOL_TO_LONG):
                compute = dtype
            else:
                compute = None
            if compute is not None:
                cast = [_cast(a, compute) for a in operands]
                args = tuple(cast) + tuple(args[len(operands) :])
            out = fn(*args, **kwargs)
            if promote == ALWAYS_BOOL:
                return out.astype(np.bool_) if out.dtype != np.bool_ else out
            want: np.dtype | None
            if promote == COMPLEX_TO_FLOAT:
                want = to_real(compute)
            elif promote == BOOL_TO_LONG and category(compute) == _BOOL:
                want = canonical_int()
            else:
                want = compute
            if want is not None and is_array(out) and out.dtype != want:
                out = out.astype(want)
            return out

        return wrapper

    return deco


def canon_dim(dim: int, ndim: int) -> int:
    """Torch's negative dim, with 0-dim tensors accepting dims 0 and -1."""
    n = max(ndim, 1)
    if not -n <= dim < n:
        raise IndexError(f"Dimension out of range (expected to be in range of [{-n}, {n - 1}], but got {dim})")
    return dim % n


def canon_dims(dims, ndim: int) -> tuple[int, ...]:
    """A dim, list of dims, or None (all dims) -> a sorted tuple of non-negative dims."""
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return tuple(range(ndim))
    if isinstance(dims, int):
        dims = [dims]
    return tuple(sorted({canon_dim(d, ndim) for d in dims}))
