"""Torch-first compilation: `jaxtorch.compile` / `@jaxtorch.jit`.

`compile(module_or_fn)` returns a callable taking torch tensors (on the `jax` device or
the CPU) that runs the whole call as one `jax.jit` program; tensors come back as
`JaxTensor`s, and `compilations` counts traces.

State semantics (what a compiled call reads and writes):

- Every tensor reachable from the arguments, through lists, tuples, dicts, dataclasses,
  `ModelOutput`s, Hugging Face caches and any registered pytree (`core/_pytrees.py`), is a
  program input (traced, never a baked-in constant). What the function writes in place
  (`cache.update`, `t.add_()`, `x[i] = v`), and new tensors it puts into those containers
  (a `DynamicCache` growing, a cache layer initializing itself), come out of the program
  and are written back into the caller's tensors and containers after the call.
- Modules' parameters and buffers (the compiled module, the module of a compiled bound
  `forward`, modules among the arguments or named in `state=`) are inputs too; buffers the
  call writes (BatchNorm statistics) are written back. Modules and optimizers passed to a
  compiled *function* are a train step's state: parameters, `.grad`s, optimizer state and
  learning rates are threaded through (`state/_holders.py`), so `loss.backward()` and
  `opt.step()` happen inside the program.
- Programs are cached by the arguments' structure, static values (non-tensor leaves) and
  tensor shapes/dtypes: one compilation per distinct signature, never per value.
- A write jaxtorch cannot carry out raises `StateWriteError` naming the tensor: an in-place
  write to a tensor the function reaches only from outside its arguments (a closure or a
  global), or a traced value stored on a module attribute that is not a parameter or
  buffer. No tracer ever stays in a tensor that outlives the trace.
- Modules are left exactly as found (every submodule once, shared ones included): their
  tensors are bound in for the trace and put back (one `state/_binding.Binding`), and
  Python attributes a forward changes while tracing are restored (they are not state;
  such changes happen at trace time only). A forward assigning a parameter or buffer
  (`self.buf = new`, same shape) writes it.

Random ops draw keys from the eager generator (`torch.manual_seed`) unless `rng=` is given.

Example:
    ```python
    fast = jaxtorch.compile(model)
    y = fast(x)                 # traced and compiled on the first call
    y = fast(x2)                # same shapes: no retrace
    assert fast.compilations == 1

    @jaxtorch.jit
    def decode_step(model, tok, cache):      # writes the StaticCache in place
        return model(tok, cache=cache).logits[:, -1:].argmax(-1)

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
import inspect
import threading
from collections.abc import Callable
from typing import Any, cast

import jax
import torch

from ..core import _random
from ..core._errors import StateWriteError
from ..state._binding import Binding, named_state
from ..state._holders import ArgState, Holders
from ..tensor import _tensor
from ..tensor._convert import array_to_torch, tensor_to_jax
from ..tensor._tensor import JaxTensor, labelled, root, root_data, was_written, write
from ._jax_first import _module_lock, _run_torch


class Compiled:
    """A torch module or function compiled into `jax.jit` programs, one per signature."""

    def __init__(self, target: torch.nn.Module | Callable, *, state: tuple = ()):
        self._target = target
        self._module: torch.nn.Module | None
        self._call: Callable | None
        if isinstance(target, torch.nn.Module):
            self._module, self._call = target, None
        elif inspect.ismethod(target) and isinstance(target.__self__, torch.nn.Module):
            # `model.forward = jaxtorch.compile(model.forward)`: the module is state, and the
            # original bound method is what runs (calling the module would come back here)
            self._module, self._call = target.__self__, target
        else:
            self._module, self._call = None, target
        self._state_objects = tuple(state)
        self._programs: dict[Any, Callable] = {}
        self._aux: dict[Any, Any] = {}
        self._random: dict[Any, bool] = {}  # signature -> whether its program draws random numbers
        self._lock = threading.RLock()
        self.compilations = 0
        # no `_call`: `target` is the module
        functools.update_wrapper(self, cast(torch.nn.Module, target).forward if self._call is None else target)

    @contextlib.contextmanager
    def _draws(self, key, rng):
        """Trace under `rng` and record whether the program drew from it."""
        with _random.key_scope(rng) as cell:
            yield
        self._random[key] = cell[0] is not rng

    def _run(self, fn, key, args, kwargs, rng):
        """Run the user's code while tracing: writes to tensors that are not state raise."""
        dtypes: list = []
        with self._draws(key, rng), _refusing_untracked_writes(self._target):
            out = _run_torch(fn, args, kwargs, None, dtypes=dtypes)
        self._aux[("dtypes", key)] = dtypes  # the outputs' torch dtypes (int64 is held as int32)
        return out

    def _program(self, key, argstate: ArgState):
        prog = self._programs.get(key)
        if prog is not None:
            return prog
        module, call = self._module, self._call

        def traced(state: dict, dyn: list, rng):
            self.compilations += 1  # runs once per trace
            args, kwargs, inputs = argstate.rebuild(dyn)
            if module is None:
                out = self._run(call, key, args, kwargs, rng)
                changed = {}
            else:
                dtypes = {k: t.dtype for k, t in named_state(module).items()}  # (int64 held as int32)
                tstate = {k: labelled(v, dtypes[k]) if k in dtypes else JaxTensor(v) for k, v in state.items()}
                with Binding([module]) as binding:
                    binding.bind(module, tstate)
                    out = self._run(call if call is not None else module, key, args, kwargs, rng)
                    for name, value in binding.rebound():  # `self.buf = new` inside the forward: a write too
                        _rebound(tstate[name], value, name)
                    leaked = binding.leaks()
                if leaked:
                    raise StateWriteError(_leak_message(leaked))
                changed = {k: t.elem for k, t in tstate.items() if was_written(t)}
            written, new, aux = argstate.outcome(args, kwargs, inputs)
            self._aux[key] = aux
            return out, changed, written, new

        prog = jax.jit(traced)
        self._programs[key] = prog
        return prog

    def _step_program(self, key, argstate: ArgState, holders: Holders, opt_statics, random_key):
        """A program for a function that updates modules/optimizers (a train step)."""
        prog = self._programs.get(key)
        if prog is not None:
            return prog
        target = self._call

        def traced(state, dyn: list, rng):
            self.compilations += 1  # runs once per trace
            args, kwargs, inputs = argstate.rebuild(dyn)
            with holders.bound(state, opt_statics) as binding:
                out = self._run(target, random_key, args, kwargs, rng)
                new_state, _ = holders.read()
                self._aux[("holders", key)] = holders.state_statics()
                leaked = binding.leaks()
            if leaked:
                raise StateWriteError(_leak_message(leaked))
            new_state.lrs = [[None] * len(per) for per in new_state.lrs]  # inputs only
            # tensors the step did not write (a decode step's weights) do not come back
            new_state.tensors = [None if v is s else v for v, s in zip(new_state.tensors, state.tensors)]
            written, new, aux = argstate.outcome(args, kwargs, inputs)
            self._aux[key] = aux
            return out, new_state, written, new

        prog = jax.jit(traced)
        self._programs[key] = prog
        return prog

    def __call__(self, *args, rng: jax.Array | None = None, **kwargs):
        argstate = ArgState.of(args, kwargs)
        holders_objs = self._state_objects + argstate.holders()
        dyn = argstate.arrays()
        key = (argstate.key(dyn), self._module.training if self._module is not None else None)
        if rng is None:  # the eager generator, only for programs that draw (or not traced yet)
            rng = _random._eager_key() if self._random.get(key, True) else _no_key()
        if holders_objs:
            return self._call_step(key, argstate, dyn, args, kwargs, holders_objs, rng)
        state_tensors = named_state(self._module) if self._module is not None else {}
        state = {k: (t.elem if isinstance(t, JaxTensor) else tensor_to_jax(t)) for k, t in state_tensors.items()}
        lock = _module_lock(self._module) if self._module is not None else contextlib.nullcontext()
        with self._lock, lock:
            prog = self._program(key, argstate)
            out, changed, written, new = prog(state, dyn, rng)
            for name, value in changed.items():
                t = state_tensors[name]
                if isinstance(t, JaxTensor):
                    write(t, value)
                else:
                    with torch.no_grad():
                        t.copy_(array_to_torch(value, copy=False))
            argstate.write_back(args, kwargs, self._aux[key], written, new)
        return _wrap(out, self._aux.get(("dtypes", key)))

    def _call_step(self, key, argstate, dyn, args, kwargs, objects, rng):
        if self._module is not None:
            raise TypeError(
                "jaxtorch.compile: pass modules/optimizers to a compiled *function*, not to a compiled module's forward"
            )
        holders = Holders.of(objects)
        locks = [_module_lock(m) for m in holders.modules]
        with self._lock:
            for lock in locks:
                lock.acquire()
            try:
                state, signature = holders.read()
                opt_statics = holders.state_statics()
                pkey = (key, tuple(id(o) for o in objects), signature)
                prog = self._step_program(pkey, argstate, holders, opt_statics, random_key=key)
                out, new_state, written, new = prog(state, dyn, rng)
                holders.install(new_state, self._aux[("holders", pkey)])
                argstate.write_back(args, kwargs, self._aux[pkey], written, new)
            finally:
                for lock in reversed(locks):
                    lock.release()
        return _wrap(out, self._aux.get(("dtypes", key)))


def _rebound(slot: JaxTensor, new, name: str) -> None:
    """A forward assigned a new tensor to a parameter/buffer attribute: carry it as a write."""
    value = new.elem if isinstance(new, JaxTensor) else None
    if value is None or tuple(value.shape) != tuple(slot.shape):
        raise StateWriteError(
            f"jaxtorch.compile: the forward replaces `{name}` with a value of another shape or kind; "
            "a compiled module's parameters and buffers keep their shapes (write into them in place)."
        )
    write(slot, value)


def _leak_message(names: list[str]) -> str:
    return (
        "jaxtorch.compile: the function stored a traced tensor in module attribute(s) "
        + ", ".join(f"`{n}`" for n in names)
        + " that are not parameters or buffers, so the value cannot outlive the program; the "
        "module was left as it was found. Register it as a buffer (`register_buffer`) to make it state, "
        "or return it."
    )


# ---- writes jaxtorch cannot carry out --------------------------------------------------------
_tracing = threading.local()


@contextlib.contextmanager
def _refusing_untracked_writes(target):
    """While the user's code is traced, a write to a tensor holding a concrete array (so one
    created outside the program and not passed in as state) raises `StateWriteError`."""
    stack = getattr(_tracing, "stack", None)
    if stack is None:
        stack = _tracing.stack = []
    stack.append(target)
    _tensor.write_checks.append(_refuse_untracked_write)
    try:
        yield
    finally:
        _tensor.write_checks.remove(_refuse_untracked_write)
        stack.pop()


def _refuse_untracked_write(t: JaxTensor) -> None:
    stack = getattr(_tracing, "stack", None)
    if not stack:  # another thread's trace
        return
    if isinstance(t, JaxTensor) and isinstance(root_data(t), jax.core.Tracer):
        return  # program state (an argument, a module's tensor) or made inside the program
    raise StateWriteError(
        f"jaxtorch.compile: the function writes in place into {_describe(t, stack[-1])}, which is not "
        "program state: it is reached from outside the function's arguments (a closure or a global), so the "
        "write would be lost after the first call and its traced value would leak. Pass the tensor (or the "
        "object holding it: a cache, a list, a dict, a dataclass) as an argument, name its module in "
        "`jaxtorch.compile(fn, state=(module,))`, or write to a copy."
    )


def _describe(t: torch.Tensor, fn) -> str:
    """A name for `t`: where `fn`'s closure or globals reach it, else its shape and dtype."""
    what = f"a tensor of shape {tuple(t.shape)} and dtype {t.dtype}"
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return what
    places = dict(zip(code.co_freevars, [c.cell_contents for c in (fn.__closure__ or ()) if _filled(c)]))
    places.update({n: fn.__globals__[n] for n in code.co_names if n in fn.__globals__})
    for name, value in places.items():
        found = _find(t, value, name)
        if found:
            return f"`{found}` ({what})"
    return what


def _filled(cell) -> bool:
    try:
        _ = cell.cell_contents
        return True
    except ValueError:
        return False


def _find(t, value, name: str) -> str | None:
    roots = {id(t), id(root(t)) if isinstance(t, JaxTensor) else id(t)}
    if isinstance(value, torch.Tensor):
        return name if id(value) in roots else None
    if isinstance(value, torch.nn.Module):
        for n, x in [*value.named_parameters(remove_duplicate=False), *value.named_buffers(remove_duplicate=False)]:
            if id(x) in roots or (isinstance(x, JaxTensor) and id(root(x)) in roots):
                return f"{name}.{n}"
        return None
    if isinstance(value, (list, tuple, dict)) or hasattr(value, "__dict__"):
        try:
            from ..core._pytrees import flatten_with_path

            for path, leaf in flatten_with_path(value)[0]:
                if isinstance(leaf, torch.Tensor) and id(leaf) in roots:
                    return name + jax.tree_util.keystr(path)
        except Exception:
            return None
    return None


def _wrap(out, dtypes: list | None = None):
    """The program's outputs as tensors, with the torch dtypes the traced code gave them."""
    leaves, treedef = jax.tree_util.tree_flatten(out)
    arrays = [a for a in leaves if isinstance(a, jax.Array)]
    labels = iter(dtypes if dtypes is not None and len(dtypes) == len(arrays) else [None] * len(arrays))
    wrapped = []
    for a in leaves:
        if isinstance(a, jax.Array):
            d = next(labels)
            wrapped.append(JaxTensor(a) if d is None else labelled(a, d))
        else:
            wrapped.append(a)
    return jax.tree_util.tree_unflatten(treedef, wrapped)


@functools.cache
def _no_key() -> jax.Array:
    """The key passed to programs that draw no random numbers (made on first use)."""
    return jax.random.key(0)


def compile(target: torch.nn.Module | Callable, *, state: tuple = ()) -> Compiled:  # noqa: A001
    """Compile a torch module, a module's bound `forward`, or a function (a forward, a decode
    step, a whole train step) into `jax.jit` programs.

    Every tensor reachable from the arguments (modules, optimizers, caches, lists, dicts,
    dataclasses, registered pytrees) is a program input, and what the call writes in place
    is program state: carried out and written back into the caller's objects. Writes
    jaxtorch cannot carry out (to tensors reached only through a closure or a global) raise
    `StateWriteError` naming the tensor; modules are left as found. One compilation per
    argument structure, static values and shapes (see the module docstring).

    **Arguments:**
    - `target`: a `torch.nn.Module` (its parameters and buffers become program inputs), a
      module's bound `forward` (`model.forward = jaxtorch.compile(model.forward)`, as
      `torch.compile` users write; then `model.generate(..., cache_implementation="static")`
      compiles the prefill once per prompt length and decoding once per cache length), or
      a function of torch values. Modules and optimizers among the function's arguments are
      a train step's state: their tensors, grads, optimizer state and learning rates go in
      and come out.
    - `state`: modules and optimizers the function closes over, treated the same way.

    **Returns:** a `Compiled` callable; `.compilations` counts traces.

    **Example:**
        ```python
        fast = jaxtorch.compile(model)
        logits = fast(input_ids.to("jax"))
        model.forward = jaxtorch.compile(model.forward)
        out = model.generate(ids, max_new_tokens=32, do_sample=False, cache_implementation="static")
        ```
    """
    return Compiled(target, state=state)


def jit(fn: Callable) -> Compiled:
    """Decorator form of `compile` for torch functions (same state semantics).

    **Arguments:**
    - `fn`: a function of torch values (tensors, modules, optimizers, caches, containers).

    **Returns:** a `Compiled` callable.

    **Example:**
        ```python
        @jaxtorch.jit
        def f(x, y):
            return torch.relu(x @ y).sum(-1)

        @jaxtorch.jit
        def step(model, tok, cache):             # one compilation for every decode step
            return model(tok, cache=cache).logits[:, -1:].argmax(-1)
        ```
    """
    return Compiled(fn)
