"""Peak live memory of a jaxpr run in order: what remat changes, independent of a backend's scheduler.

XLA's own figure (`compiled.memory_analysis()`) depends on how the backend schedules the
program: on the CPU it shows no saving even for `jax.checkpoint` in pure JAX. This measure
runs the program's equations in their traced order (forward, then backward), frees each
value after its last use, and counts a nested program (a `jax.checkpoint` region, a `pjit`,
a loop body) by its own peak while it runs. Arguments are not counted (the caller owns
them); results stay live to the end.

Example:
    ```python
    closed = jax.make_jaxpr(jax.grad(loss))(params, x)
    peak_live_bytes(closed.jaxpr)       # bytes, arguments excluded
    ```
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import numpy as np
from jax.extend import core as jex


def _bytes(v: Any) -> int:
    aval = getattr(v, "aval", None)
    shape = getattr(aval, "shape", None)
    if shape is None:
        return 0
    try:
        itemsize = np.dtype(aval.dtype).itemsize
    except TypeError:  # (an extended dtype: PRNG keys)
        itemsize = 8
    return int(np.prod(shape, dtype=np.int64)) * itemsize


def _nested(eqn) -> list:
    found = []
    for p in eqn.params.values():
        for q in p if isinstance(p, (tuple, list)) else (p,):
            if isinstance(q, jex.ClosedJaxpr):
                found.append(q.jaxpr)
            elif isinstance(q, jex.Jaxpr):
                found.append(q)
    return found


def peak_live_bytes(jaxpr) -> int:
    """Peak bytes of the values `jaxpr` (a `Jaxpr` or `ClosedJaxpr`) computes, run in order."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    n = len(jaxpr.eqns)
    last: dict = {}
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if isinstance(v, jex.Var):
                last[v] = i
    for v in jaxpr.outvars:
        if isinstance(v, jex.Var):
            last[v] = n
    args = set(jaxpr.invars) | set(jaxpr.constvars)
    live, peak = 0, 0
    for i, eqn in enumerate(jaxpr.eqns):
        inner = max((peak_live_bytes(j) for j in _nested(eqn)), default=0)
        made = sum(_bytes(v) for v in eqn.outvars)
        peak = max(peak, live + max(inner, made))
        live += sum(_bytes(v) for v in eqn.outvars if last.get(v, -1) > i)
        for v in {v for v in eqn.invars if isinstance(v, jex.Var) and v not in args and last.get(v) == i}:
            live -= _bytes(v)
    return peak


@contextlib.contextmanager
def programs_recorded(record: list):
    """Record each program `jaxtorch.jit` compiles and calls, with its arguments, in `record`
    (to trace or lower it again): `with programs_recorded(rec): step(...)`, then `rec[-1]`."""
    original = jax.jit

    def spy(fn, **kw):
        jitted = original(fn, **kw)
        if not any(s in getattr(fn, "__qualname__", "") for s in ("traced", "_with_vjp")):  # (eager ops' own jits)
            return jitted

        def call(*args):
            record.append((jitted, args))
            return jitted(*args)

        return call

    jax.jit = spy
    try:
        yield
    finally:
        jax.jit = original
