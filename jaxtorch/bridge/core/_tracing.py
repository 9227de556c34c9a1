"""Carrying JAX's trace into torch's autograd threads.

`loss.backward()` on the `jax` device runs the backward ops on torch's per-device autograd
thread, but JAX's tracing context (inside `jax.jit`, `jax.grad`, ...) is thread-local. So
when backward starts under a JAX trace, `backward_in_trace` publishes that trace, and
`adopted()` lets the autograd thread use it while it runs backward ops, and only while
it runs a graph task (`torch._C._current_graph_task_id() != -1`). The abstract mesh of an
enclosing `jax.shard_map` (thread-local too) travels with it, and so does any other per-thread
state a layer above registers with `carry` (the axes of `jaxtorch.collectives_axis`).

Example:
    ```python
    with backward_in_trace():
        loss.backward()        # backward ops trace into the surrounding jax.jit
    ```
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager

import jax

from ..._compat import current_graph_task_id, trace_ctx

_published: list = []  # stack of (trace, axis_env, carried) of threads running backward under a trace
_lock = threading.Lock()
Capture = Callable[[], Callable[[], AbstractContextManager] | None]
_CARRIERS: list[Capture] = []


def carry(capture: Capture) -> Capture:
    """Carry per-thread state into torch's autograd threads when backward runs under a trace.

    **Arguments:**
    - `capture`: called in the thread that starts backward; returns a function that makes a
      context manager re-establishing that state (entered in the autograd thread while it runs
      the backward ops), or None when there is nothing to carry.

    **Returns:** `capture` (so `carry` also works as a decorator).

    **Example:** `carry(lambda: (lambda v=_VAR.get(): _set_var(v)))`, where `_set_var` is a context manager.
    """
    if capture not in _CARRIERS:
        _CARRIERS.append(capture)
    return capture


def _abstract_mesh() -> Callable[[], AbstractContextManager] | None:
    """The enclosing `jax.shard_map`'s mesh (its manual axes), for the autograd thread."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty else lambda: jax.sharding.use_abstract_mesh(mesh)


@contextlib.contextmanager
def backward_in_trace():
    """Publish this thread's JAX trace for torch's autograd threads while the block runs."""
    ctx = trace_ctx
    if ctx.is_top_level():
        yield
        return
    carried = [c for c in [_abstract_mesh(), *(capture() for capture in _CARRIERS)] if c is not None]
    entry = (ctx.trace, ctx.axis_env, carried)
    with _lock:
        _published.append(entry)
    try:
        yield
    finally:
        with _lock:
            _published.remove(entry)


def pending() -> bool:
    """Cheap check for the dispatch hot path: is any backward running under a trace?"""
    return bool(_published)


@contextlib.contextmanager
def adopted():
    """In an autograd thread, run under the published trace (no-op elsewhere)."""
    ctx = trace_ctx
    if not _published or not ctx.is_top_level() or current_graph_task_id() == -1:
        yield
        return
    trace, axis_env, carried = _published[-1]
    prev_trace, prev_axis = ctx.trace, ctx.axis_env
    ctx.set_trace(trace)
    ctx.set_axis_env(axis_env)
    try:
        with contextlib.ExitStack() as stack:
            for restore in carried:
                stack.enter_context(restore())
            yield
    finally:
        ctx.set_trace(prev_trace)
        ctx.set_axis_env(prev_axis)
