"""Torch-first compilation: `jaxtorch.compile` / `@jaxtorch.jit`.

`compile(module_or_fn)` returns a callable taking torch tensors (on the `jax` device or
the CPU) that runs the whole call as one `jax.jit` program. Module parameters and
buffers enter the program as arguments (never as baked-in constants), buffers the call
writes (BatchNorm statistics) are written back afterwards, tensors come back as
`JaxTensor`s. Non-tensor arguments are static: each distinct signature (shapes, dtypes,
static values) compiles once, and `compilations` counts how many times that happened.

A whole train step written in torch compiles too: modules and optimizers passed as
arguments (or named in `state=` when the function closes over them) have their
parameters, buffers, `.grad`s, optimizer state and learning rates threaded through the
program as inputs and outputs (`bridge/torch_state.py`), so `loss.backward()` and
`opt.step()` become part of one XLA program and their effects land on the objects.
Random ops draw keys from the eager generator (`torch.manual_seed`) unless `rng=` is given.

Example:
    ```python
    fast = jaxtorch.compile(model)
    y = fast(x)                 # traced and compiled on the first call
    y = fast(x2)                # same shapes: no retrace
    assert fast.compilations == 1

    @jaxtorch.jit
    def train_step(model, opt, x, y):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss
    ```
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable

import jax
import torch

from . import random as _random
from .api import _module_lock, _run_torch, named_state
from .convert import array_to_torch, tensor_to_jax
from .tensor import JaxTensor, write
from .torch_state import Holders, freeze


def _is_tensor(x) -> bool:
    return isinstance(x, torch.Tensor)


class Compiled:
    """A torch module or function compiled into `jax.jit` programs, one per signature."""

    def __init__(self, target: torch.nn.Module | Callable, *, state: tuple = ()):
        self._target = target
        self._module = target if isinstance(target, torch.nn.Module) else None
        self._state_objects = tuple(state)
        self._programs: dict[Any, Callable] = {}
        self._aux: dict[Any, Any] = {}
        self._random: dict[Any, bool] = {}  # signature -> whether its program draws random numbers
        self._lock = threading.RLock()
        self.compilations = 0
        functools.update_wrapper(self, target.forward if self._module is not None else target)

    @contextlib.contextmanager
    def _draws(self, key, rng):
        """Trace under `rng` and record whether the program drew from it."""
        with _random.key_scope(rng) as cell:
            yield
        self._random[key] = cell[0] is not rng

    def _program(self, key, treedef, statics):
        prog = self._programs.get(key)
        if prog is not None:
            return prog
        module = self._module
        target = self._target

        def traced(state: dict, dyn: list, rng):
            self.compilations += 1  # runs once per trace
            args, kwargs = _rebuild(treedef, statics, dyn)
            if module is None:
                with self._draws(key, rng):
                    return _run_torch(target, args, kwargs, None), {}
            tstate = {k: JaxTensor(v) for k, v in state.items()}

            def run(*a, **k):
                return torch.func.functional_call(module, tstate, a, k, tie_weights=True, strict=False)

            with self._draws(key, rng):
                out = _run_torch(run, args, kwargs, None)
            changed = {k: t.elem for k, t in tstate.items() if t._jt_version}
            return out, changed

        prog = jax.jit(traced)
        self._programs[key] = prog
        return prog

    def _step_program(self, key, treedef, statics, holders: Holders, opt_statics, random_key):
        """A program for a function that updates modules/optimizers (a train step)."""
        prog = self._programs.get(key)
        if prog is not None:
            return prog
        target = self._target

        def traced(state, dyn: list, rng):
            self.compilations += 1  # runs once per trace
            args, kwargs = _rebuild(treedef, statics, dyn)
            snap = holders.snapshot()
            try:
                holders.install(state, opt_statics, tracing=True)
                with self._draws(random_key, rng):
                    out = _run_torch(target, args, kwargs, None)
                new_state, _ = holders.read()
                self._aux[key] = holders.state_statics()
            finally:
                holders.restore(snap)
            new_state.lrs = [[None] * len(per) for per in new_state.lrs]  # inputs only
            return out, new_state

        prog = jax.jit(traced)
        self._programs[key] = prog
        return prog

    def __call__(self, *args, rng: jax.Array | None = None, **kwargs):
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs), is_leaf=_is_tensor)
        holders_objs = self._state_objects + tuple(x for x in leaves if _is_holder(x))
        statics = tuple(_DYN if _is_tensor(x) else x for x in leaves)
        dyn = [x.elem if isinstance(x, JaxTensor) else tensor_to_jax(x) for x in leaves if _is_tensor(x)]
        key = (treedef, tuple(freeze(s) for s in statics), self._module.training if self._module else None)
        if rng is None:  # the eager generator, only for programs that draw (or not traced yet)
            rng = _random._eager_key() if self._random.get(key, True) else _no_key()
        if holders_objs:
            return self._call_step(key, treedef, statics, dyn, holders_objs, rng)
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
        return _wrap(out)

    def _call_step(self, key, treedef, statics, dyn, objects, rng):
        if self._module is not None:
            raise TypeError("jaxtorch.compile: pass modules/optimizers to a compiled *function*, not to a "
                            "compiled module's forward")
        holders = Holders.of(objects)
        locks = [_module_lock(m) for m in holders.modules]
        with self._lock:
            for lock in locks:
                lock.acquire()
            try:
                state, signature = holders.read()
                opt_statics = holders.state_statics()
                pkey = (key, tuple(id(o) for o in objects), signature)
                prog = self._step_program(pkey, treedef, statics, holders, opt_statics, random_key=key)
                out, new_state = prog(state, dyn, rng)
                holders.install(new_state, self._aux[pkey], tracing=False)
            finally:
                for lock in reversed(locks):
                    lock.release()
        return _wrap(out)


def _is_holder(x) -> bool:
    return isinstance(x, (torch.nn.Module, torch.optim.Optimizer))


def _rebuild(treedef, statics, dyn):
    it = iter(dyn)
    leaves = [JaxTensor(next(it)) if s is _DYN else s for s in statics]
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _wrap(out):
    return jax.tree_util.tree_map(lambda a: JaxTensor(a) if isinstance(a, jax.Array) else a, out)


class _Dyn:
    def __repr__(self) -> str:
        return "<tensor>"


_DYN = _Dyn()


@functools.cache
def _no_key() -> jax.Array:
    """The key passed to programs that draw no random numbers (made on first use)."""
    return jax.random.key(0)


def compile(target: torch.nn.Module | Callable, *, state: tuple = ()) -> Compiled:  # noqa: A001
    """Compile a torch module or function (a forward, or a whole train step) into `jax.jit` programs.

    **Arguments:**
    - `target`: a `torch.nn.Module` (its parameters and buffers become program inputs) or a
      function of torch tensors. Modules and optimizers among the function's arguments are
      state: their tensors, grads, optimizer state and learning rates go in and come out.
    - `state`: modules and optimizers the function closes over, treated the same way.

    **Returns:** a `Compiled` callable; `.compilations` counts traces.

    **Example:**
        ```python
        fast = jaxtorch.compile(model)
        logits = fast(input_ids.to("jax"))
        ```
    """
    return Compiled(target, state=state)


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
