"""Torch's autograd meaning for JAX's differentiation: where torch cuts the graph, JAX does too.

`jax.grad` of a jaxtorch function differentiates the JAX values the lowerings compute. torch
would not differentiate through some of them, and those are marked here:

- `stop_gradient(a)`: a value torch computes outside its graph (`.detach()`, `.data`, a result
  made under `torch.no_grad()` / `set_grad_enabled(False)` / `inference_mode`, a module's
  buffers and frozen parameters). JAX sees `lax.stop_gradient`.
- `keep_tangent(new, old)`: a write torch does not record (an in-place op under `no_grad`, a
  write through `.data` or a `.detach()`ed alias). The tensor takes the new values but keeps its
  place in the graph: its derivative is the old value's, as torch's leaf (or non-leaf) keeps
  its gradient identity (`with no_grad(): w.clamp_(-1, 1)` then `w` trains as before).

Both apply only to traced floating values (under `jax.jit`, `jax.grad`, ...): eager and lazy
values are never differentiated by JAX, and integers carry no gradient.

Example:
    ```python
    y = stop_gradient(x)             # d y / d x == 0 under jax.grad
    w = keep_tangent(clipped, w)     # w has the clipped values, w's tangent
    ```
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from ..._compat import Tracer

_Tracer = Tracer
_local = threading.local()


@contextlib.contextmanager
def jax_differentiates() -> Iterator[None]:
    """Marks a trace that JAX differentiates while torch's autograd also records it (a
    `jaxtorch.compile`d call's forward under `jax.vjp`, whose tensors require grad): torch's
    graph is then bookkeeping (which results require grad), and the derivative is JAX's, so
    custom `Function`s and hooks must reach JAX too (`dispatch._custom_function`, `dispatch._hooks`)."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


def differentiated_by_jax() -> bool:
    """Whether this thread is inside `jax_differentiates()`."""
    return getattr(_local, "depth", 0) > 0


def differentiable(a) -> bool:
    """Whether JAX may differentiate `a`: a traced value of a floating or complex dtype."""
    return isinstance(a, _Tracer) and jnp.issubdtype(a.dtype, np.inexact)


def stop_gradient(a):
    """`lax.stop_gradient(a)` for a traced floating value; `a` itself otherwise."""
    return jax.lax.stop_gradient(a) if differentiable(a) else a


@jax.custom_jvp
def _keep_tangent(new, old):
    return new


@_keep_tangent.defjvp
def _keep_tangent_jvp(primals, tangents):
    new, _ = primals
    _, d_old = tangents
    return new, d_old


def keep_tangent(new, old):
    """`new`'s values with `old`'s derivative (a write torch's autograd does not record).

    `new` and `old` have one shape and dtype (the tensor before and after the write)."""
    if not (differentiable(new) or differentiable(old)):
        return new
    if new.shape != old.shape or new.dtype != old.dtype or not jnp.issubdtype(new.dtype, np.inexact):
        return stop_gradient(new)
    return _keep_tangent(new, old)
