"""JAX named scopes for torch modules, so profiles and HLO read like the model.

Each ATen op already runs under `jax.named_scope("aten::addmm")` while tracing (see the
interpreter). `module_scopes()` adds one scope per torch module call, named by its
attribute name in the parent (`attn`, `mlp`) or by its class for list members
(`GPT2Block`), giving HLO op names such as `GPT2Block/attn/aten::addmm`.

On the CPU backend, the output of each repeated block (a member of a `ModuleList` or
`Sequential` that has submodules itself: `GPT2Block`, a ResNet `BasicBlock`) also passes through
`gradient_barrier`: the same value, whose cotangent XLA must compute once at that point
instead of fusing the backward's residual-stream sums into every consumer (which made the
12-layer GPT-2 gradient program quadratic in depth; see benchmarks/README.md, issue 16).

Example:
    ```python
    with module_scopes(model):
        jax.jit(fn).lower(params, x).as_text()   # ... GPT2Block/attn/aten::addmm ...
    ```
"""

from __future__ import annotations

import contextlib
import threading
import weakref

import jax
import torch

from ..._compat import Tracer, trace_ctx
from ..tensor._tensor import JaxTensor, root, root_data, set_same_data

_names: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()
_blocks: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
_local = threading.local()
_users = 0
_handles: list = []
_lock = threading.Lock()


def name_modules(root: torch.nn.Module) -> None:
    """Remember a scope name for each submodule of `root`."""
    for qualname, mod in root.named_modules():
        last = qualname.rsplit(".", 1)[-1]
        _names[mod] = type(mod).__name__ if (not last or last.isdigit()) else last
        if last.isdigit() and next(mod.children(), None) is not None:
            _blocks.add(mod)


@jax.custom_jvp
def gradient_barrier(x: jax.Array) -> jax.Array:
    """`x` itself; its tangent (and so, under `jax.grad`, its cotangent) is rewritten by an exact
    one-element scatter (`t.at[0, ..., 0].set(t[0, ..., 0])`), which XLA cannot fuse, so XLA
    computes the gradient there once instead of duplicating its sum into every consumer.

    (`lax.optimization_barrier` would say this, but XLA:CPU deletes barriers before fusion.)

    **Arguments:** `x`: an array.
    **Returns:** `x`, unchanged (values and derivatives are the identity's).

    **Example:**
        ```python
        jax.grad(lambda x: (gradient_barrier(x * 2) ** 2).sum())(x)   # == 8 * x
        ```
    """
    return x


@gradient_barrier.defjvp
def _gradient_barrier_jvp(primals, tangents):
    t = tangents[0]
    if t.ndim == 0 or t.size == 0:
        return primals[0], t
    first = (0,) * t.ndim
    return primals[0], t.at[first].set(t[first])


def _barrier_outputs(output) -> None:
    """Route the gradient of a block's floating-point output tensors through `gradient_barrier`.

    The tensor object keeps its identity and (equal) value; no version bump, so nothing counts it
    as written and views taken earlier stay valid (they hold the same values). Only where JAX's
    default backend is the CPU: the duplication it prevents is XLA:CPU's fusion, measured there;
    GPU programs stay as they were (unmeasured with the barrier).
    """
    if jax.default_backend() != "cpu":
        return
    for t in output if isinstance(output, (tuple, list)) else (output,):
        if type(t) is JaxTensor and root(t) is t and t.dtype.is_floating_point:
            e = root_data(t)
            if isinstance(e, Tracer):
                set_same_data(t, gradient_barrier(e))


def _pre(module, args):
    if trace_ctx.is_top_level():
        return
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    scope = jax.named_scope(_names.get(module) or type(module).__name__)
    scope.__enter__()
    stack.append((module, scope))


def _post(module, args, output):
    stack = getattr(_local, "stack", None)
    if stack and stack[-1][0] is module:
        stack.pop()[1].__exit__(None, None, None)
        if module in _blocks:
            _barrier_outputs(output)


@contextlib.contextmanager
def module_scopes(root: torch.nn.Module | None = None):
    """While active, every torch module call under a JAX trace opens a named scope."""
    global _users
    if root is not None:
        name_modules(root)
    with _lock:
        if _users == 0:
            _handles.append(torch.nn.modules.module.register_module_forward_pre_hook(_pre))
            _handles.append(torch.nn.modules.module.register_module_forward_hook(_post, always_call=True))
        _users += 1
    try:
        yield
    finally:
        with _lock:
            _users -= 1
            if _users == 0:
                for h in _handles:
                    h.remove()
                _handles.clear()
