"""JAX named scopes for torch modules, so profiles and HLO read like the model.

Each ATen op already runs under `jax.named_scope("aten::addmm")` while tracing (see the
interpreter). `module_scopes()` adds one scope per torch module call, named by its
attribute name in the parent (`attn`, `mlp`) or by its class for list members
(`GPT2Block`), giving HLO op names such as `GPT2Block/attn/aten::addmm`.

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
from jax._src import core as _core

_names: "weakref.WeakKeyDictionary[torch.nn.Module, str]" = weakref.WeakKeyDictionary()
_local = threading.local()
_users = 0
_handles: list = []
_lock = threading.Lock()


def name_modules(root: torch.nn.Module) -> None:
    """Remember a scope name for each submodule of `root`."""
    for qualname, mod in root.named_modules():
        last = qualname.rsplit(".", 1)[-1]
        _names[mod] = type(mod).__name__ if (not last or last.isdigit()) else last


def _pre(module, args):
    if _core.trace_ctx.is_top_level():
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
