"""Torch-first compilation: `jaxtorch.compile` / `@jaxtorch.jit`.

`compile(module_or_fn)` returns a callable taking torch tensors (on the `jax` device or
the CPU) that runs the whole call as one `jax.jit` program. Module parameters and
buffers enter the program as arguments (never as baked-in constants), buffers the call
writes (BatchNorm statistics) are written back afterwards, tensors come back as
`JaxTensor`s. Non-tensor arguments are static: each distinct signature (shapes, dtypes,
static values) compiles once, and `compilations` counts how many times that happened.

Example:
    ```python
    fast = jaxtorch.compile(model)
    y = fast(x)                 # traced and compiled on the first call
    y = fast(x2)                # same shapes: no retrace
    assert fast.compilations == 1
    ```
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable

import jax
import torch

from .api import _run_torch, named_state
from .convert import array_to_torch, tensor_to_jax
from .tensor import JaxTensor, write


def _is_tensor(x) -> bool:
    return isinstance(x, torch.Tensor)


def _freeze(x):
    try:
        hash(x)
        return x
    except TypeError:
        return repr(x)


class Compiled:
    """A torch module or function compiled into `jax.jit` programs, one per signature."""

    def __init__(self, target: torch.nn.Module | Callable, *, rng: bool = False):
        self._target = target
        self._module = target if isinstance(target, torch.nn.Module) else None
        self._programs: dict[Any, Callable] = {}
        self._lock = threading.Lock()
        self.compilations = 0
        functools.update_wrapper(self, target.forward if self._module is not None else target)

    def _program(self, key, treedef, statics):
        prog = self._programs.get(key)
        if prog is not None:
            return prog
        module = self._module
        target = self._target

        def traced(state: dict, dyn: list, rng):
            self.compilations += 1  # runs once per trace
            leaves = list(statics)
            it = iter(dyn)
            leaves = [JaxTensor(next(it)) if s is _DYN else s for s in leaves]
            args, kwargs = jax.tree_util.tree_unflatten(treedef, leaves)
            if module is None:
                return _run_torch(target, args, kwargs, rng), {}
            tstate = {k: JaxTensor(v) for k, v in state.items()}

            def run(*a, **k):
                return torch.func.functional_call(module, tstate, a, k, tie_weights=True, strict=False)

            out = _run_torch(run, args, kwargs, rng)
            changed = {k: t.elem for k, t in tstate.items() if t._jt_version}
            return out, changed

        prog = jax.jit(traced)
        self._programs[key] = prog
        return prog

    def __call__(self, *args, rng: jax.Array | None = None, **kwargs):
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs), is_leaf=_is_tensor)
        for x in leaves:
            if isinstance(x, (torch.nn.Module, torch.optim.Optimizer)):
                raise TypeError(
                    f"jaxtorch.compile: a {type(x).__name__} passed as an argument would be baked into the "
                    "program (and writes to it would leak traced values). Compile the module itself, "
                    "`jaxtorch.compile(model)`, or close over it and pass only tensors; compiling a whole "
                    "torch train step (backward + optimizer.step) is not supported yet."
                )
        statics = tuple(_DYN if _is_tensor(x) else x for x in leaves)
        dyn = [x.elem if isinstance(x, JaxTensor) else tensor_to_jax(x) for x in leaves if _is_tensor(x)]
        key = (treedef, tuple(_freeze(s) for s in statics), self._module.training if self._module else None)
        state_tensors = named_state(self._module) if self._module is not None else {}
        state = {k: (t.elem if isinstance(t, JaxTensor) else tensor_to_jax(t)) for k, t in state_tensors.items()}
        with self._lock:
            prog = self._program(key, treedef, statics)
        out, changed = prog(state, dyn, rng)
        for name, value in changed.items():
            t = state_tensors[name]
            if isinstance(t, JaxTensor):
                write(t, value)
            else:
                with torch.no_grad():
                    t.copy_(array_to_torch(value))
        return jax.tree_util.tree_map(lambda a: JaxTensor(a) if isinstance(a, jax.Array) else a, out)


class _Dyn:
    def __repr__(self) -> str:
        return "<tensor>"


_DYN = _Dyn()


def compile(target: torch.nn.Module | Callable) -> Compiled:  # noqa: A001 - mirrors torch.compile
    """Compile a torch module or function into cached `jax.jit` programs.

    **Arguments:**
    - `target`: a `torch.nn.Module` (its parameters and buffers become program inputs) or a
      function of torch tensors.

    **Returns:** a `Compiled` callable; `.compilations` counts traces.

    **Example:**
        ```python
        fast = jaxtorch.compile(model)
        logits = fast(input_ids.to("jax"))
        ```
    """
    return Compiled(target)


def jit(fn: Callable) -> Compiled:
    """Decorator form of `compile` for torch functions.

    **Example:**
        ```python
        @jaxtorch.jit
        def f(x, y):
            return torch.relu(x @ y).sum(-1)
        ```
    """
    return Compiled(fn)
