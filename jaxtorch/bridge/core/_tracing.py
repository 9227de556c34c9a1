"""Carrying JAX's trace into torch's autograd threads.

`loss.backward()` on the `jax` device runs the backward ops on torch's per-device autograd
thread, but JAX's tracing context (inside `jax.jit`, `jax.grad`, ...) is thread-local. So
when backward starts under a JAX trace, `backward_in_trace` publishes that trace, and
`adopted()` lets the autograd thread use it while it runs backward ops, and only while
it runs a graph task (`torch._C._current_graph_task_id() != -1`).

Example:
    ```python
    with backward_in_trace():
        loss.backward()        # backward ops trace into the surrounding jax.jit
    ```
"""

from __future__ import annotations

import contextlib
import threading

import torch
from jax._src import core as _core

_published: list = []  # stack of (trace, axis_env) of threads running backward under a trace
_lock = threading.Lock()


@contextlib.contextmanager
def backward_in_trace():
    """Publish this thread's JAX trace for torch's autograd threads while the block runs."""
    ctx = _core.trace_ctx
    if ctx.is_top_level():
        yield
        return
    entry = (ctx.trace, ctx.axis_env)
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
    ctx = _core.trace_ctx
    if not _published or not ctx.is_top_level() or torch._C._current_graph_task_id() == -1:
        yield
        return
    trace, axis_env = _published[-1]
    prev_trace, prev_axis = ctx.trace, ctx.axis_env
    ctx.set_trace(trace)
    ctx.set_axis_env(axis_env)
    try:
        yield
    finally:
        ctx.set_trace(prev_trace)
        ctx.set_axis_env(prev_axis)
