"""Eager execution of lowerings through cached `jax.jit`s.

Calling a lowering op-by-op runs each of its `jnp` calls as a separate dispatch; calling
one `jax.jit` of the whole lowering is one cached executable launch. So eagerly (no
tracers among the arguments) the interpreter calls `run(func, lowering, args, kwargs)`,
which keeps one jitted function per op and per static part of the arguments (Python
scalars, int lists, dtypes); arrays are the jitted function's inputs, and jit's own cache
handles their shapes and dtypes.

A lowering that needs concrete values (a data-dependent shape) fails to trace: that
signature is remembered as not jittable and runs op-by-op from then on.
`JAXTORCH_EAGER_JIT=0` turns the cache off.

Example:
    ```python
    out = run(aten.add.Tensor, add_lowering, [x, y], {"alpha": 2})
    ```
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable

import jax

_Array = jax.Array
_ENABLED = os.environ.get("JAXTORCH_EAGER_JIT", "1") != "0"
_MAX = 20000
_cache: dict[Any, Callable | None] = {}
_lock = threading.Lock()
from ._errors import MissingKeyError  # noqa: E402
from ._precision import matmul_precision  # noqa: E402

_NOT_JITTABLE = (
    MissingKeyError,  # a lowering that draws a key only for some arguments (sdpa with dropout)
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerIntegerConversionError,
    jax.errors.TracerBoolConversionError,
)


class _Slot:
    """Marks where an array goes in the static skeleton of the arguments."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<array>"


_SLOT = _Slot()


def _split(x, dyn: list, floats: bool):
    """(hashable key part, skeleton) for one argument; arrays are appended to `dyn`.

    With `floats`, Python floats are traced too (weakly typed), so a new value (a learning
    rate, a step size) reuses the compile; factories keep them static, since there the
    scalar's type decides the result dtype.
    """
    if isinstance(x, _Array) or (floats and type(x) is float):
        dyn.append(x)
        return _SLOT, _SLOT
    if isinstance(x, (list, tuple)):
        parts = [_split(y, dyn, floats) for y in x]
        return (type(x), tuple(p[0] for p in parts)), type(x)(p[1] for p in parts)
    hash(x)
    return (type(x), x), x


def _fill(skel, it):
    if skel is _SLOT:
        return next(it)
    if isinstance(skel, (list, tuple)):
        return type(skel)(_fill(s, it) for s in skel)
    return skel


def run(func, lowering: Callable, jargs: list, jkwargs: dict, floats: bool | None = None):
    """`lowering(*jargs, **jkwargs)`, through a cached `jax.jit` when possible.

    `floats`: whether Python floats are traced (default: when an argument is an array)."""
    if not _ENABLED:
        return lowering(*jargs, **jkwargs)
    dyn: list = []
    if floats is None:
        floats = any(isinstance(a, _Array) for a in jargs)
    try:
        key_a, skel_a = _split(jargs, dyn, floats)
        key_k, skel_k = _split(tuple(jkwargs.items()), dyn, floats) if jkwargs else ((), ())
    except TypeError:  # an unhashable static argument
        return lowering(*jargs, **jkwargs)
    key = (func, key_a, key_k)
    try:
        fn = _cache[key]
    except KeyError:
        fn = _make(lowering, skel_a, skel_k)
        with _lock:
            if len(_cache) > _MAX:
                _cache.clear()
            _cache[key] = fn
    except TypeError:  # unhashable after all (e.g. a list inside a scalar slot)
        return lowering(*jargs, **jkwargs)
    if fn is None:
        return lowering(*jargs, **jkwargs)
    try:
        return fn(dyn)
    except _NOT_JITTABLE:
        _cache[key] = None
        return lowering(*jargs, **jkwargs)


def _make(lowering: Callable, skel_a, skel_k) -> Callable:
    def call(dyn):
        it = iter(dyn)
        args = _fill(skel_a, it)
        kwargs = dict(_fill(skel_k, it)) if skel_k else {}
        with matmul_precision():
            return lowering(*args, **kwargs)

    return jax.jit(call)


NOT_JITTABLE = object()
NOT_JITTABLE_ERRORS = _NOT_JITTABLE


def enabled() -> bool:
    """Whether eager ops run through cached jits (`JAXTORCH_EAGER_JIT`, default on)."""
    return _ENABLED


def jit_positional(lowering: Callable, sig: list) -> Callable:
    """A jit of `lowering` whose array arguments are positional inputs; `sig` holds None for
    an array and `(type, value)` for a static Python scalar."""
    statics = [None if s is None else s[1] for s in sig]

    def call(*arrays):
        it = iter(arrays)
        with matmul_precision():
            return lowering(*[next(it) if s is None else v for s, v in zip(sig, statics)])

    return jax.jit(call)


def clear() -> None:
    """Forget all cached executables (after a lowering is replaced)."""
    with _lock:
        _cache.clear()
