"""Eager execution of lowerings through cached `jax.jit`s: the `EAGER` executor.

Calling a lowering op-by-op runs each of its `jnp` calls as a separate dispatch; calling
one `jax.jit` of the whole lowering is one cached executable launch. So eagerly (no
tracers among the arguments) `EAGER.call(op, args, kwargs)` keeps, per op, one jitted
function per static part of the arguments (Python scalars, int lists, dtypes; see
`_executor.signature`); arrays (and Python floats next to arrays) are the jitted
function's inputs, and jit's own cache handles their shapes and dtypes.

Under a JAX trace (tracers among the arguments) the lowering is called directly, in a
named scope, so it joins the trace. Random ops draw their key per call and, like
data-dependent ops, run op-by-op. A lowering that needs concrete values (a data-dependent
shape) fails to trace: that signature is remembered as not jittable and runs op-by-op from
then on. `JAXTORCH_EAGER_JIT=0` turns the cache off.

Example:
    ```python
    out = EAGER.call(OpCall(aten.add.Tensor, add_lowering, "aten::add.Tensor"), [x, y], {"alpha": 2})
    ```
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import jax

from ..._compat import Tracer
from . import _checks
from ._errors import DataDependentError, MissingKeyError
from ._matmul_precision import matmul_precision
from ._random import next_key, take_generator
from ._signature import OpCall, bind, signature

_ENABLED = os.environ.get("JAXTORCH_EAGER_JIT", "1") != "0"
_MAX = 2000  # cached signatures per op
_Tracer = Tracer
_CHECKS = _checks.ON

NOT_JITTABLE_ERRORS = (
    MissingKeyError,  # a lowering that draws a key only for some arguments (sdpa with dropout)
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerIntegerConversionError,
    jax.errors.TracerBoolConversionError,
)
NOT_JITTABLE = object()  # a cached signature whose lowering runs op-by-op


def _has_tracer(jargs: list, jkwargs: dict) -> bool:
    for a in jargs:
        if isinstance(a, _Tracer):
            return True
        if isinstance(a, (list, tuple)) and any(isinstance(b, _Tracer) for b in a):
            return True
    return bool(jkwargs) and any(isinstance(v, _Tracer) for v in jkwargs.values())


class EagerExecutor:
    """Runs each call now: a cached `jax.jit` per op and signature; directly under a JAX trace."""

    pending = False  # tensors are read executed

    def call(self, op: OpCall, jargs: list, jkwargs: dict) -> Any:
        """`op.lowering(*jargs, **jkwargs)`, run (or traced into the surrounding JAX trace)."""
        if op.plain and _ENABLED and not _CHECKS[0]:  # the common case, inline: a known signature
            sig = signature(jargs, jkwargs, op.floats)
            if sig is not None:
                fn = op.jits.get(sig[0])
                if fn is not None and fn is not NOT_JITTABLE and sig[2] is sig[0]:  # (flat: no tracer)
                    try:
                        return fn(*sig[1])
                    except NOT_JITTABLE_ERRORS:
                        op.jits[sig[0]] = NOT_JITTABLE
        elif op.random:
            jkwargs["key"] = next_key(op.func, take_generator(jargs, jkwargs))
        try:
            if _has_tracer(jargs, jkwargs):
                if op.data_dependent:
                    raise DataDependentError(op.func)
                with jax.named_scope(op.name):
                    return op.lowering(*jargs, **jkwargs)
            if op.random or op.data_dependent:
                return op.lowering(*jargs, **jkwargs)
            return run(op, jargs, jkwargs)
        except jax.errors.ConcretizationTypeError as e:
            raise DataDependentError(op.func, str(e).splitlines()[0]) from e

    def run(self, runner: Callable, args: Any, kwargs: Any) -> Any:
        """`runner(self, args, kwargs)`."""
        return runner(self, args, kwargs)

    def apply(self, key: Any, fn: Callable, *inputs: Any) -> Any:
        """`fn(*inputs)`, now (`_executor.executor` gives no pending input to this executor)."""
        return fn(*inputs)

    def nullary(self, key: Any, fn: Callable[[], Any]) -> Any:
        """`fn()`, now."""
        return fn()


EAGER = EagerExecutor()


def run(op: OpCall, jargs: list, jkwargs: dict) -> Any:
    """`op.lowering(*jargs, **jkwargs)` on concrete arrays, through a cached `jax.jit` when possible."""
    lowering = op.lowering
    if not _ENABLED:
        return lowering(*jargs, **jkwargs)
    sig = signature(jargs, jkwargs, op.floats)
    if sig is None:  # an unhashable static argument
        return lowering(*jargs, **jkwargs)
    key, dyn, plan = sig
    cache = op.jits
    if _CHECKS[0]:  # checked mode: its own programs (see `_checks.jit`)
        key = ("checked", key)
    try:
        fn = cache.get(key)
    except TypeError:  # unhashable after all
        return lowering(*jargs, **jkwargs)
    if fn is None:
        if len(cache) > _MAX:
            cache.clear()
        fn = cache[key] = _checks.jit(bind(lowering, plan, matmul_precision))
    if fn is NOT_JITTABLE:
        return lowering(*jargs, **jkwargs)
    try:
        return fn(*dyn)
    except NOT_JITTABLE_ERRORS:
        cache[key] = NOT_JITTABLE
        return lowering(*jargs, **jkwargs)


def enabled() -> bool:
    """Whether eager ops run through cached jits (`JAXTORCH_EAGER_JIT`, default on)."""
    return _ENABLED
