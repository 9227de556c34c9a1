"""Reduced-precision floats compute in float32 and round once, as torch's CPU kernels do.

torch's CPU kernels compute a float16 or bfloat16 op in its `opmath_t` (float32): the inputs
are widened, the whole op (a sum, a norm, a matmul's dot products, `a * 3.3`, `beta * c +
alpha * (a @ b)`) runs in float32, and the result is rounded to the half dtype once. JAX's
default accumulates in the operand dtype, which loses the low bits of long sums (a bfloat16
sum of 1e5 x 0.01 is 984, not 1000) and overflows float16 norms. This module is the one
place that rule lives; lowerings use `opmath` (a decorator) or `accumulation_dtype` (for the
`preferred_element_type` of a dot or convolution, which keeps half operands on the
accelerator's half units while accumulating in float32). Other dtypes pass through untouched:
a float32 op gets no extra cast.

Example:
    ```python
    @register(aten.sum.default)
    @opmath
    def sum_(a, dim=None, keepdim=False, *, dtype=None):
        return jnp.sum(a, axis=..., dtype=...)   # float32 for half inputs, rounded once after
    ```
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ._semantics import is_array, result_type

HALF = frozenset({np.dtype(jnp.float16), np.dtype(jnp.bfloat16)})
OPMATH = np.dtype(np.float32)


def is_half(dtype) -> bool:
    """Whether `dtype` is float16 or bfloat16."""
    return dtype is not None and np.dtype(dtype) in HALF


def upcast(x):
    """A float16/bfloat16 array as float32 (torch's `opmath_type`); anything else unchanged."""
    return x.astype(OPMATH) if is_array(x) and x.dtype in HALF else x


def accumulation_dtype(dtype):
    """The `preferred_element_type` of a dot or convolution of `dtype` operands: float32 for
    half dtypes, else None (the operand dtype)."""
    return OPMATH if is_half(dtype) else None


def round_to(out, dtype):
    """Every float32 array in `out` (an array or a tuple of them) rounded to `dtype`."""
    return jax.tree_util.tree_map(lambda x: x.astype(dtype) if is_array(x) and x.dtype == OPMATH else x, out)


def _half_result(args, kwargs) -> np.dtype | None:
    """The half dtype an op of these arguments returns (an explicit `dtype=`, else torch's
    promoted dtype of its tensors and scalars), or None when it is not a half dtype."""
    dtype = kwargs.get("dtype")
    if dtype is None:
        dtype = result_type(*args, *(v for v in kwargs.values() if is_array(v)))
    return np.dtype(dtype) if is_half(dtype) else None


def opmath(fn: Callable) -> Callable:
    """Decorator: an op whose result is float16/bfloat16 runs `fn` on float32 inputs and rounds
    its float32 results to that dtype once; every other call runs `fn` as it is.

    An explicit half `dtype=` keyword rounds the float inputs to it first (torch casts the
    input, then accumulates in float32) and reaches `fn` as float32.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        half = _half_result(args, kwargs)
        if half is None:
            return fn(*args, **kwargs)
        if kwargs.get("dtype") is not None:
            kwargs["dtype"] = OPMATH
            args = tuple(a.astype(half) if is_array(a) and jnp.issubdtype(a.dtype, jnp.floating) else a for a in args)
        args = tuple(upcast(a) for a in args)
        kwargs = {k: upcast(v) for k, v in kwargs.items()}
        return round_to(fn(*args, **kwargs), half)

    return wrapper
