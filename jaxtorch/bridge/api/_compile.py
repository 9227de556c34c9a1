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
  tensor shapes/dtypes: one compilation per distinct signature, never per tensor value.
- Guards, as `torch.compile`'s (docs/api/torch_first.md lists what is and is not checked):
  tensors a compiled function reaches through its closure cells, the global names its code
  mentions, its default arguments or its bound `self`'s attributes, and tensors in lists,
  tuples and dicts there, are program inputs, read at every call (a new value reuses the
  program, a new shape or dtype compiles again); writes to them are written back as for
  arguments. Python constants there (numbers, strings, dtypes, functions, and containers
  of them) are part of the key, as are every module's class, hooks and constant attributes
  and the global module hooks: a change compiles again, counted by `recompilations` and
  explained by `stats()["reasons"]`. Where the function reaches values is found once per
  function (`_FreeNames`); what is there is looked up again at every call. Assigning a
  global or nonlocal name inside the function raises `StateWriteError`.
- Python values in a result (`x.shape`, `x.dtype`, `x.size(0)`) come back as torch gives
  them; other objects made while tracing (a generator) raise `TypeError`.
- Aliasing is eager torch's: arguments sharing data (overlapping views, a tensor and a
  view of it) enter as one root with views of it, so a write through one is seen through
  the others; a result that is an argument is that argument, and a view of one is the
  same view of the caller's tensor.
- Autograd: when grad mode is on and a parameter (of the compiled module, of a closed-over
  module, of a module argument without optimizers) or a tensor argument requires grad, the
  floating results that depend on them come out of one `torch.autograd.Function`: its
  forward is the jitted program with `jax.vjp` inside (the residuals are outputs) and its
  backward the jitted VJP, so `compiled(x).loss.backward(); opt.step()` trains as eager.
  With nothing requiring grad the program is the plain one (no residuals). Tensors keep
  `requires_grad` inside the program (`torch.autograd.grad` there works); the backward is
  once differentiable (`create_graph=True` through it raises).
- A write jaxtorch cannot carry out raises `StateWriteError` naming the tensor: an in-place
  write to a tensor reached only through an object the function closes over (a cache, a
  list), or a traced value stored on a module attribute that is not a parameter or
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
import dataclasses
import dis
import functools
import inspect
import threading
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any, cast

import jax
import jax.numpy as jnp
import torch

from ..._compat import Tracer
from ..core import _checks, _random
from ..core import _pytrees as pytrees
from ..core._autodiff import jax_differentiates
from ..core._errors import StateWriteError
from ..dispatch import _autocast
from ..dispatch import _writes as writes
from ..state._binding import Binding, named_state
from ..state._holders import ArgState, Holders, is_array_like, wants_grad
from ..tensor._autograd import _to_array
from ..tensor._convert import array_to_torch, tensor_to_jax
from ..tensor._tensor import JaxTensor, labelled, make_view, root, root_data, view_fn, view_key, was_written, write
from ._jax_first import _module_lock, _run_torch


class Compiled:
    """A torch module or function compiled into `jax.jit` programs, one per signature.

    **Arguments:**
    - `target`: a torch module, a module's bound `forward`, or a function of torch values.
    - `state`: modules and optimizers the function closes over (see `compile`).

    **Returns:** calling it runs the compiled program for the arguments' signature (compiling it on first use) and
    returns what `target` returns, as tensors on the `jax` device; `.compilations` counts the traces.

    **Example:**
        ```python
        double = jaxtorch.compile(lambda t: t * 2)
        assert isinstance(double, jaxtorch.Compiled)
        assert double(torch.ones(2, device="jax")).cpu().tolist() == [2.0, 2.0]
        ```
    """

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
        self._free = _FreeNames.of(self._call)  # where the function reaches outside values
        self._programs: dict[Any, Callable] = {}
        self._aux: dict[Any, Any] = {}
        self._random: dict[Any, bool] = {}  # signature -> whether its program draws random numbers
        self._lock = threading.RLock()
        self.compilations = 0
        self._traced: dict[str, Any] | None = None  # what the last trace was keyed on, by part (`_parts`)
        self._reasons: list[str] = []  # why each recompilation happened
        # no `_call`: `target` is the module
        functools.update_wrapper(self, cast(torch.nn.Module, target).forward if self._call is None else target)

    @property
    def recompilations(self) -> int:
        """Traces after the first (a new signature, or a guarded value that changed)."""
        return max(self.compilations - 1, 0)

    def stats(self) -> dict[str, Any]:
        """Compilation statistics: `compilations` (traces), `recompilations` (traces after the
        first), `programs` (cached programs) and `reasons` (why each recompilation happened, the
        latest 100).

        **Example:**
            ```python
            SCALE = 2.0
            f = jaxtorch.jit(lambda x: x * SCALE)
            f(x); SCALE = 3.0; f(x)
            f.stats()  # {'compilations': 2, 'recompilations': 1, 'programs': 2,
                       #  'reasons': ['global `SCALE` changed']}
            ```
        """
        return {
            "compilations": self.compilations,
            "recompilations": self.recompilations,
            "programs": len(self._programs),
            "reasons": list(self._reasons),
        }

    def _count_trace(self, key: tuple, free: _Free) -> None:
        """Count a trace; from the second on, note why (what differs from the last trace's key)."""
        self.compilations += 1
        parts = _parts(key, free, self._free)
        if self._traced is not None:
            changed = [n for n, v in parts.items() if self._traced.get(n, _ABSENT) != v]
            located = [n for n in changed if n.startswith(_LOCATED)]
            why = located + [n for n in changed if n != "arguments" and not n.startswith(_LOCATED)]
            self._reasons.append(", ".join(f"{n} changed" for n in why or changed) or "another autograd path")
            del self._reasons[:-_KEPT_REASONS]
            if self.compilations == _WARN_AFTER + 1:
                warnings.warn(
                    f"jaxtorch.jit: `{getattr(self, '__qualname__', self._target)}` has compiled {self.compilations} "
                    f"times (the last: {self._reasons[-1]}). A value that changes at every call (a Python number "
                    "in a global, a closure or a dict, a growing list) is part of the program's key and compiles "
                    "again each time: pass it as a tensor argument instead. `.stats()` lists every reason.",
                    stacklevel=3,
                )
        self._traced = parts

    @contextlib.contextmanager
    def _draws(self, key: Any, rng: jax.Array | None) -> Iterator[None]:
        """Trace under `rng` and record whether the program drew from it."""
        with _random.key_scope(rng) as cell:
            yield
        self._random[key] = cell[0] is not rng

    def _run(self, fn: Callable[..., Any], key: Any, args: Any, kwargs: Any, rng: jax.Array | None) -> Any:
        """Run the user's code while tracing: writes to tensors that are not state raise."""
        dtypes: list = []
        with self._draws(key, rng), _refusing_untracked_writes(self._target):
            out = _run_torch(fn, args, kwargs, None, dtypes=dtypes)
        self._aux[("dtypes", key)] = dtypes  # the outputs' torch dtypes (int64 is held as int32)
        return out

    def _callee(self, args: tuple, free: _Free) -> tuple[Callable, tuple]:
        """What runs while tracing, and its arguments: with free values, the function reading
        the program's inputs (the last argument `ArgState` carried) in place of the originals."""
        fn = self._call if self._call is not None else self._module
        if not free.values:
            return cast(Callable, fn), args
        *args_, values = args
        return _reading(cast(Callable, fn), dict(zip(free.values, values))), tuple(args_)

    def _program(
        self, key: Any, argstate: ArgState, mods: list[torch.nn.Module], free: _Free, leaves: frozenset, grads: tuple
    ) -> Any:
        """The forward program: `mods`' state and the arguments in, results and writes out.

        `leaves` are the state names whose tensors require grad (so they do inside the
        program); with `grads` (the state names and argument slots to differentiate) the
        program also returns its VJP."""
        prog = self._programs.get(key)
        if prog is not None:
            return prog

        dtypes = {k: t.dtype for k, t in _module_state(mods).items()}  # (int64 held as int32 without x64)

        def traced(state: dict, dyn: list, rng: jax.Array | None) -> Any:
            self._count_trace(key, free)  # runs once per trace
            args, kwargs, inputs = argstate.rebuild(dyn)
            call, call_args = self._callee(args, free)
            tstate = {k: _state_tensor(v, dtypes.get(k), k in leaves) for k, v in state.items()}
            with contextlib.ExitStack() as stack:
                bindings = []
                for i, m in enumerate(mods):
                    binding = stack.enter_context(Binding([m]))
                    binding.bind(m, {name: t for (j, name), t in tstate.items() if j == i})
                    bindings.append((i, binding))
                out = self._run(_noting(call, self._aux, key, inputs), key, call_args, kwargs, rng)
                for i, binding in bindings:  # `self.buf = new` inside the forward: a write too
                    for name, value in binding.rebound():
                        _rebound(tstate[(i, name)], value, name)
                leaked = [n for _, binding in bindings for n in binding.leaks()]
            if leaked:
                raise StateWriteError(_leak_message(leaked))
            changed = {k: t.elem for k, t in tstate.items() if was_written(t)}
            written, new, aux = argstate.outcome(args, kwargs, inputs)
            self._aux[key] = aux
            return out, changed, written, new

        # (checkified in checked mode: `_checks.ON` is in the key)
        prog = _checks.jit(traced if not grads else _with_vjp(traced, grads[0], grads[1], self._aux, key))
        self._programs[key] = prog
        return prog

    def _step_program(
        self,
        key: Any,
        argstate: ArgState,
        holders: Holders,
        opt_statics: Any,
        random_key: Any,
        free: _Free,
        grads: tuple = (),
    ) -> Any:
        """A program for a function that updates modules/optimizers (a train step); with
        `grads` (positions in `holders.tensors`, argument slots) it also returns its VJP."""
        prog = self._programs.get(key)
        if prog is not None:
            return prog

        def traced(state: Any, dyn: list, rng: jax.Array | None) -> Any:
            self._count_trace(key, free)  # runs once per trace
            args, kwargs, inputs = argstate.rebuild(dyn)
            call, call_args = self._callee(args, free)
            with holders.bound(state, opt_statics) as binding:
                out = self._run(_noting(call, self._aux, key, inputs), random_key, call_args, kwargs, rng)
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

        # (checkified in checked mode: `_checks.ON` is in the key)
        prog = _checks.jit(traced if not grads else _with_vjp(traced, grads[0], grads[1], self._aux, key))
        self._programs[key] = prog
        return prog

    def __call__(self, *args: Any, rng: jax.Array | None = None, **kwargs: Any) -> Any:
        free = self._free.read()
        # what the function reaches through closures and globals: tensors are program inputs, like
        # arguments, and constants (and lists/dicts of them) part of the key, like static arguments
        argstate = ArgState.of((*args, list(free.values.values())) if free.values else args, kwargs)
        holders_objs = self._state_objects + argstate.holders() + free.optimizers
        if holders_objs:
            holders_objs += tuple(m for m in free.modules if not any(m is o for o in holders_objs))
        dyn = argstate.arrays()
        grad_mode = torch.is_grad_enabled()
        guarded = [m for m in (self._module, *free.modules, *holders_objs) if isinstance(m, torch.nn.Module)]
        key = (  # (the parts `_KEY_PARTS` names, in order)
            argstate.key(dyn),
            self._module.training if self._module is not None else None,
            grad_mode,
            tuple(free.values),
            free.guards,
            _module_guards(guarded),
            _autocast.state(),  # a program traced under torch.autocast("jax") casts
            _checks.ON[0],  # checked mode: a checkified program
        )
        if holders_objs:
            return self._call_step(key, argstate, dyn, args, kwargs, holders_objs, self._key(key, rng), free)
        mods = ([self._module] if self._module is not None else []) + list(free.modules)
        locks = [_module_lock(m) for m in mods]
        with self._lock, contextlib.ExitStack() as stack:
            for lock in locks:
                stack.enter_context(lock)
            # read under the locks: another thread's trace binds tracers into these modules meanwhile
            state_tensors = _module_state(mods)
            state = {k: (t.elem if isinstance(t, JaxTensor) else tensor_to_jax(t)) for k, t in state_tensors.items()}
            leaves = frozenset(k for k, t in state_tensors.items() if t.requires_grad)
            names = tuple(k for k, t in state_tensors.items() if grad_mode and wants_grad(t))
            slots = argstate.requiring_grad() if grad_mode else ()
            fkey = (key, tuple((id(m), m.training) for m in mods), leaves, names)
            rng = self._key(fkey, rng)
            prog = self._program(fkey, argstate, mods, free, leaves, (names, slots) if names or slots else ())
            ext = (*args, list(free.values.values())) if free.values else args

            def run(outs: Any) -> Any:
                out, changed, written, new = outs
                for name, value in changed.items():
                    _write_state(state_tensors[name], value)
                argstate.write_back(ext, kwargs, self._aux[fkey], written, new)
                return out

            if not (names or slots):
                result = _wrap(run(prog(state, dyn, rng)), self._aux.get(("dtypes", fkey)))
            else:
                diff = [state_tensors[k] for k in names] + [argstate.tensors[j] for j in slots]
                result = _differentiable_call(
                    lambda: prog(state, dyn, rng),
                    run,
                    diff,
                    lambda: self._aux[("vjp", fkey)],
                    self._aux.get(("dtypes", fkey)),
                )
            result = _aliasing(result, self._aux[("aliases", fkey)], argstate.tensors)
            return _with_statics(result, self._aux[("out", fkey)])

    def _key(self, key: Any, rng: jax.Array | None) -> jax.Array:
        """`rng`, else the eager generator's next key for programs that draw (or not traced yet)."""
        if rng is not None:
            return rng
        return _random._eager_key() if self._random.get(key, True) else _no_key()

    def _call_step(
        self,
        key: Any,
        argstate: Any,
        dyn: Any,
        args: Any,
        kwargs: Any,
        objects: Any,
        rng: jax.Array | None,
        free: _Free,
    ) -> Any:
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
                # a forward of modules (no optimizer) under grad mode: differentiable like compile(module)
                params = _differentiable_params(holders) if torch.is_grad_enabled() and not holders.optimizers else []
                slots = argstate.requiring_grad() if torch.is_grad_enabled() else ()
                positions = tuple(i for i, _ in params)
                pkey = (key, tuple(id(o) for o in objects), signature, positions)
                grads = (positions, slots) if positions or slots else ()
                prog = self._step_program(pkey, argstate, holders, opt_statics, key, free, grads)
                ext = (*args, list(free.values.values())) if free.values else args

                def finish(outs: Any) -> Any:
                    out, new_state, written, new = outs
                    holders.install(new_state, self._aux[("holders", pkey)])
                    argstate.write_back(ext, kwargs, self._aux[pkey], written, new)
                    return out

                if not grads:
                    result = _wrap(finish(prog(state, dyn, rng)), self._aux.get(("dtypes", key)))
                else:
                    diff = [p for _, p in params] + [argstate.tensors[j] for j in slots]
                    result = _differentiable_call(
                        lambda: prog(state, dyn, rng),
                        finish,
                        diff,
                        lambda: self._aux[("vjp", pkey)],
                        self._aux.get(("dtypes", key)),
                    )
            finally:
                for lock in reversed(locks):
                    lock.release()
        result = _aliasing(result, self._aux[("aliases", pkey)], argstate.tensors)
        return _with_statics(result, self._aux[("out", pkey)])


# ---- autograd through a compiled call ------------------------------------------------------
def _module_state(mods: list[torch.nn.Module]) -> dict[tuple[int, str], torch.Tensor]:
    """Parameters and buffers of `mods` keyed `(module index, name)`, each tensor once."""
    seen: set[int] = set()
    out: dict[tuple[int, str], torch.Tensor] = {}
    for i, m in enumerate(mods):
        for name, t in named_state(m).items():
            if id(t) not in seen:
                seen.add(id(t))
                out[(i, name)] = t
    return out


def _write_state(t: torch.Tensor, value: Any) -> None:
    """Write a program's new value of a module tensor into it (a buffer the forward wrote)."""
    if isinstance(t, JaxTensor):
        write(t, value)
    else:
        with torch.no_grad():
            t.copy_(array_to_torch(value, copy=False))


def _inexact(x: Any) -> bool:
    return isinstance(x, (jax.Array, Tracer)) and jnp.issubdtype(x.dtype, jnp.inexact)


def _differentiable_params(holders: Holders) -> list[tuple[int, JaxTensor]]:
    """`(position in holders.tensors, parameter)` for each parameter requiring grad: a
    gradient with respect to its root's data is its gradient (it is the root, or a view of all of it)."""
    at = {id(r): i for i, r in enumerate(holders.tensors)}
    out = []
    for p in holders.params:
        if not wants_grad(p):
            continue
        fn = view_fn(p)
        r = root(p)
        if fn is not None and (view_key(fn) != ("identity",) or r.shape != p.shape or r.dtype != p.dtype):
            raise NotImplementedError(
                "jaxtorch.jit: a parameter that is a partial view of another tensor cannot be differentiated "
                "through a compiled forward; call the function eagerly, or run `backward()` inside it."
            )
        out.append((at[id(r)], p))
    return out


def _pick(state: Any, names: tuple) -> list:
    """The arrays of `state` (a dict by name, or a train step's `State` by position) at `names`."""
    return [state[k] for k in names] if isinstance(state, dict) else [state.tensors[k] for k in names]


def _put(state: Any, names: tuple, values: list) -> Any:
    """`state` with `values` at `names` (see `_pick`)."""
    if isinstance(state, dict):
        return {**state, **dict(zip(names, values))}
    tensors = list(state.tensors)
    for k, v in zip(names, values):
        tensors[k] = v
    return dataclasses.replace(state, tensors=tensors)


def _with_vjp(traced: Callable, names: tuple, slots: tuple, aux: dict, key: Any) -> Callable:
    """`traced` as a forward that also returns its VJP (`jax.vjp` inside the program: the
    residuals come out as arrays) with respect to the state `names` and argument `slots`.

    Returns `(outs, vjp, others, rest)`: the floating results (what torch differentiates),
    the VJP (a pytree of residuals), the other results and `traced`'s remaining outputs; the
    structure of the results goes into `aux[("vjp", key)]`.
    """

    def forward(state: dict, dyn: list, rng: jax.Array | None) -> Any:
        def f(diff: Any) -> Any:
            full_state = _put(state, names, diff[0])
            full_dyn = list(dyn)
            for j, a in zip(slots, diff[1]):
                full_dyn[j] = a
            with jax_differentiates():  # JAX's VJP, not torch's graph, gives this call's gradients
                out, *rest = traced(full_state, full_dyn, rng)
            leaves, tree = jax.tree_util.tree_flatten(out)
            flags = aux.get(("grad_flags", key))
            if flags is None or len(flags) != len(leaves):  # (a structure the note cannot follow)
                flags = [True] * len(leaves)
            # the results autograd would track: floating, and depending on a tensor requiring grad
            at = tuple(i for i, x in enumerate(leaves) if _inexact(x) and flags[i])
            aux[("vjp", key)] = (tree, at, len(leaves))
            others = [x for i, x in enumerate(leaves) if i not in at]
            return [leaves[i] for i in at], (others, rest)

        primal = (_pick(state, names), [dyn[j] for j in slots])
        outs, vjp, (others, rest) = jax.vjp(f, primal, has_aux=True)
        return outs, vjp, others, rest

    return forward


def _noting(call: Callable, aux: dict, key: Any, inputs: list) -> Callable:
    """`call`, noting which tensors of its result require grad (`aux[("grad_flags", key)]`) and
    which are arguments or views of one (`aux[("aliases", key)]`: position, argument, view fn)."""

    def noted(*args: Any, **kwargs: Any) -> Any:
        out = call(*args, **kwargs)
        leaves, tree = pytrees.flatten(out)
        # Python values in the result (`x.shape`, `x.dtype`, `x.size(0)`) are static: kept here, put back
        # by `_with_statics`; the program returns the arrays only
        for x in leaves:
            if not is_array_like(x) and not isinstance(x, _OUT_CONSTANTS):
                raise TypeError(
                    f"jaxtorch.jit: the function returns a {type(x).__name__} ({x!r:.80}), which is neither a "
                    "tensor nor a constant (a number, a string, a dtype, a shape): it was made while tracing, "
                    "so every call would get that same object. Return tensors (and containers of them), or "
                    "call this part eagerly."
                )
        aux[("out", key)] = (tree, tuple(None if is_array_like(x) else x for x in leaves))
        leaves = [x for x in leaves if is_array_like(x)]
        aux[("grad_flags", key)] = [isinstance(x, torch.Tensor) and x.requires_grad for x in leaves]
        by_id = {id(t): j for j, t in enumerate(inputs)}
        aliases: list[tuple[int, int, Callable[..., Any] | None]] = []
        for i, x in enumerate(leaves):
            if not isinstance(x, JaxTensor):
                continue
            j = by_id.get(id(x))
            if j is not None:
                aliases.append((i, j, None))
            elif (j := by_id.get(id(root(x)))) is not None:
                aliases.append((i, j, view_fn(x)))
        aux[("aliases", key)] = aliases
        return leaves

    # the module it runs (a module, or a bound method's), so `_run_torch`'s explicit-axes region
    # (`state._mesh_axes.auto_axes`) finds that module's sharded tensors through the wrapper
    noted.__self__ = getattr(call, "__self__", call)  # type: ignore[attr-defined]
    return noted


def _with_statics(arrays: list, noted: tuple) -> Any:
    """The function's result: the program's `arrays` put back among the Python values `_noting` kept.

    Example: arrays `[t]`, noted `(tree of (x, x.shape), (None, 3, 2))` -> `(t, torch.Size([3, 2]))`."""
    tree, statics = noted
    it = iter(arrays)
    return jax.tree_util.tree_unflatten(tree, [next(it) if s is None else s for s in statics])


def _aliasing(out: Any, aliases: list, originals: list) -> Any:
    """`out` with each result that was an argument (or a view of one) inside the program made
    that argument (or the same view of it), as eager torch returns them. A view of a CPU
    argument stays a jax tensor holding the values (torch memory cannot alias a JAX array)."""
    if not aliases:
        return out
    leaves, tree = jax.tree_util.tree_flatten(out)
    for i, j, fn in aliases:
        if i >= len(leaves) or not isinstance(leaves[i], JaxTensor):  # (a structure the note cannot follow)
            continue
        t = originals[j]
        if fn is None:
            if not leaves[i].requires_grad or t.requires_grad:  # (else: the differentiable result)
                leaves[i] = t
        elif isinstance(t, JaxTensor) and not leaves[i].requires_grad:
            leaves[i] = make_view(t, leaves[i].elem, fn)
    return jax.tree_util.tree_unflatten(tree, leaves)


@jax.jit
def _apply_vjp(vjp: Any, cotangents: Any) -> Any:
    """The backward program: one compiled VJP (a cache entry per forward program)."""
    (grads,) = vjp(cotangents)
    return grads


class _CompiledCall(torch.autograd.Function):
    """forward: the compiled forward, keeping the residuals; backward: the compiled VJP."""

    @staticmethod
    def forward(ctx: Any, run: Callable, *tensors: Any) -> Any:
        outs, vjp = run()
        ctx.vjp = vjp
        ctx.meta = [(o.shape, o.dtype) for o in outs]
        ctx.cpu = [not isinstance(t, JaxTensor) for t in tensors]
        return tuple(JaxTensor(o) for o in outs)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        if torch.is_grad_enabled():  # create_graph=True: a silent constant would be wrong
            raise RuntimeError(
                "jaxtorch.compile: a compiled call's backward is once differentiable (its VJP program gives "
                "constants), so `create_graph=True` through it cannot give higher derivatives. Compute the "
                "higher derivative inside the compiled function (`torch.autograd.grad(..., create_graph=True)` "
                "there), or run this part eagerly."
            )
        cots = [
            jnp.zeros(shape, dtype) if g is None else _to_array(g).astype(dtype)
            for g, (shape, dtype) in zip(grads, ctx.meta)
        ]
        state_grads, arg_grads = _apply_vjp(ctx.vjp, cots)
        return (
            None,
            *[array_to_torch(g) if cpu else JaxTensor(g) for g, cpu in zip([*state_grads, *arg_grads], ctx.cpu)],
        )


def _differentiable_call(
    program: Callable, finish: Callable, diff: list, structure_of: Callable, dtypes: list | None = None
) -> Any:
    """Run a VJP program as one `torch.autograd.Function` whose inputs are `diff` (the tensors
    requiring grad): its floating results carry a `grad_fn` whose backward runs the compiled VJP."""
    held: dict[str, Any] = {}

    def run() -> Any:
        with torch.enable_grad():  # (a Function's forward runs without): the trace sees the caller's mode
            outs, vjp, others, rest = program()
        held["others"] = others
        finish((None, *rest))  # writes back what the call wrote (buffers, arguments)
        return outs, vjp

    outs = _CompiledCall.apply(run, *diff)
    tree, at, n = structure_of()
    others = iter(held["others"])
    by_pos = dict(zip(at, outs))
    labels = dtypes if dtypes is not None and len(dtypes) == n else [None] * n  # the traced code's torch dtypes
    leaves = [by_pos[i] if i in by_pos else _wrap(next(others), [labels[i]]) for i in range(n)]
    return jax.tree_util.tree_unflatten(tree, leaves)


# ---- values, tensors and modules reached through closures and globals (the guards) -----------
# Python values read afresh at every call and compared with the ones a program was traced with (a
# change compiles again), as `torch.compile`'s guards do
_CONSTANTS = (int, float, complex, str, bytes, type(None), torch.dtype, torch.device, torch.Size, types.FunctionType)
_CONSTANT_TYPES = frozenset((bool, *_CONSTANTS))  # exact types: the per-call module walk's fast test
_OUT_CONSTANTS = tuple(c for c in _CONSTANTS if c is not types.FunctionType)  # what a result may hold
_MAX_GUARDED = 1000  # items of one closed-over list/tuple/dict; a bigger one is not guarded (documented)


def _guardable(v: Any, budget: list[int]) -> bool:
    """`v` is a tensor, a constant, or a list/tuple/dict (string keys) of them: what `jaxtorch.jit`
    reads afresh at every call (tensors as program inputs, the rest as part of the program's key).

    Example: `_guardable({"scale": 2.0, "bias": t}, [1000])` -> True; a module -> False."""
    if isinstance(v, (torch.Tensor, *_CONSTANTS)):
        budget[0] -= 1
        return budget[0] >= 0
    if type(v) is dict:
        return all(type(k) is str for k in v) and all(_guardable(x, budget) for x in v.values())
    if type(v) in (list, tuple):
        return all(_guardable(x, budget) for x in v)
    return False


class _Identity:
    """A key entry equal only to the same object (a tensor's `==` is elementwise)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Identity) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


def _plain_object(v: Any) -> bool:
    """An instance of a user class (a config, a namespace) whose attributes a function may read."""
    return (
        hasattr(v, "__dict__")
        and not isinstance(v, (torch.nn.Module, torch.optim.Optimizer, type, types.ModuleType, types.FunctionType))
        and not callable(v)
    )


def _attribute_guards(found: list, names: tuple[str, ...]) -> tuple:
    """For each plain object the function reaches, its attributes the code names (`cfg.scale`):
    constants by value, tensors by identity and version (a new tensor there, or an in-place write to
    it, compiles again)."""
    out: list[tuple[Any, str, Any]] = []
    for loc, v in found:
        if not _plain_object(v):
            continue
        d = vars(v)
        for n in names:
            x = d.get(n, _ABSENT)
            if isinstance(x, torch.Tensor):
                out.append((loc, n, _tensor_guard(x)))
            elif isinstance(x, _CONSTANTS):
                out.append((loc, n, x))
    return tuple(out)


def _tensor_guard(x: torch.Tensor) -> tuple:
    """A key entry for a tensor held outside the program's inputs: its identity and its versions (torch's
    counter, and for a jax tensor its root's write count, which `.data` writes bump too), so a new tensor
    or any write to it compiles again rather than reading a stale constant."""
    written = root(x)._jt_version if isinstance(x, JaxTensor) else None
    return (_Identity(x), x._version, written)


_ABSENT = object()
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_HOOKS = tuple(
    n
    for n in (
        "_global_forward_hooks",
        "_global_forward_pre_hooks",
        "_global_backward_hooks",
        "_global_backward_pre_hooks",
    )
    if hasattr(torch.nn.modules.module, n)
)


def _module_guards(mods: Any) -> tuple:
    """What decides a module's traced forward besides its tensors: each submodule's class, hooks
    (`register_forward_hook` after the first call compiles again) and Python attributes that are
    constants (`training`, `eps`, `momentum`, a flag), and the global module hooks. It runs at
    every call, so it walks `_modules` itself and compares exact types.

    Example: `_module_guards([nn.Linear(2, 2)])` -> `((), (Linear, (), (('training', True), ...)))`."""
    g = torch.nn.modules.module
    out: list = [tuple((n, tuple(h)) for n in _GLOBAL_HOOKS if (h := getattr(g, n)))]
    seen: set[int] = set()
    stack = list(reversed(mods))
    while stack:
        sub = stack.pop()
        if id(sub) in seen:
            continue
        seen.add(id(sub))
        d = sub.__dict__
        hooks = tuple((n, tuple(h)) for n in _HOOKS if (h := d.get(n)))
        consts = tuple([(k, v) for k, v in d.items() if type(v) in _CONSTANT_TYPES or _constant_tuple(v)])
        out.append((type(sub), hooks, consts))
        stack += [c for c in reversed(d["_modules"].values()) if c is not None]
    return tuple(out)


_KEY_PARTS = (
    "arguments",
    "train mode",
    "grad mode",
    "closure/global names",
    "attributes of closed-over objects",
    "module classes, hooks or attributes",
    "autocast",
    "checked mode",
)
_LOCATED = ("global", "closure", "self.", "default")
_WARN_AFTER = 8  # recompilations before `Compiled` warns (as torch.compile's cache size limit)
_KEPT_REASONS = 100  # `stats()["reasons"]` keeps the latest ones


def _parts(key: tuple, free: _Free, names: _FreeNames) -> dict[str, Any]:
    """A program key by named part, with each value the function reached by where it is (computed
    only when tracing, to say why a recompilation happened)."""
    base, *rest = key
    out: dict[str, Any] = dict(zip(_KEY_PARTS, base))
    out["state (requires_grad, grads, optimizer state or hyperparameters)"] = tuple(rest)
    func = names.function
    for (kind, at), v in free.values.items():
        where = {"global": f"global `{at}`", "attr": f"self.{at}", "default": f"default argument {at}"}.get(
            kind, f"closure `{func.__code__.co_freevars[at]}`" if kind == "cell" else f"default argument `{at}`"
        )
        out[where] = _summary(v)
    return out


def _summary(v: Any) -> Any:
    """What a guard compares of `v`: a tensor's shape, dtype and requires_grad; a constant; containers'."""
    if isinstance(v, torch.Tensor):
        return ("tensor", tuple(v.shape), v.dtype, v.requires_grad)
    if type(v) is dict:
        return ("dict", tuple((k, _summary(x)) for k, x in v.items()))
    if type(v) in (list, tuple):
        return (type(v).__name__, tuple(_summary(x) for x in v))
    return v


def _constant_tuple(v: Any) -> bool:
    return type(v) is tuple and all(type(x) in _CONSTANT_TYPES for x in v)


@dataclasses.dataclass
class _Free:
    """What a function reaches outside its arguments at this call: values by where they are
    (`("cell", i)`, `("global", name)`, `("attr", name)`: tensors, constants and lists/tuples/dicts of
    them; program inputs or part of the key), guards on plain objects' attributes, modules and optimizers."""

    values: dict[tuple[str, Any], Any]
    guards: tuple
    modules: tuple[torch.nn.Module, ...]
    optimizers: tuple[torch.optim.Optimizer, ...]


_NOTHING_FREE = _Free({}, (), (), ())


@dataclasses.dataclass(frozen=True)
class _FreeNames:
    """Where a function can reach values from outside: its closure cells and the global names
    its code (nested code included: comprehensions, lambdas) mentions, found once per function;
    `read()` looks them up again at every call, so a new value, tensor or module there is seen."""

    function: Any  # the plain function (a bound method's `__func__`), or None
    cells: tuple[int, ...]
    names: tuple[str, ...]
    owner: Any = None  # a bound method's `__self__` when it is not a module (its attributes are read)
    stores: tuple[str, ...] = ()  # globals and closed-over names the code assigns (refused at call)

    @classmethod
    def of(cls, fn: Callable | None) -> _FreeNames:
        owner = getattr(fn, "__self__", None)
        func = getattr(fn, "__func__", fn)
        code = getattr(func, "__code__", None)
        if code is None or not isinstance(func, types.FunctionType):
            return cls(None, (), ())
        names: list[str] = []
        stack = [code]
        while stack:
            c = stack.pop()
            names += [n for n in c.co_names if n not in names]
            stack += [k for k in c.co_consts if isinstance(k, types.CodeType)]
        owner = owner if owner is not None and not isinstance(owner, torch.nn.Module) else None
        return cls(func, tuple(range(len(func.__closure__ or ()))), tuple(names), owner, _stores(code))

    def read(self) -> _Free:
        """The values, tensors, modules and optimizers the function reaches now."""
        func = self.function
        if func is None:
            return _NOTHING_FREE
        if self.stores:
            raise StateWriteError(_store_message(func, self.stores))
        found: list[tuple[tuple[str, Any], Any]] = []
        closure = func.__closure__ or ()
        for i in self.cells:
            try:
                found.append((("cell", i), closure[i].cell_contents))
            except ValueError:  # an empty cell
                pass
        g = func.__globals__
        found += [(("global", n), g[n]) for n in self.names if n in g]
        found += [(("default", i), v) for i, v in enumerate(func.__defaults__ or ())]
        found += [(("kwdefault", n), v) for n, v in (func.__kwdefaults__ or {}).items()]
        if self.owner is not None:
            found += [(("attr", n), v) for n, v in vars(self.owner).items()]
        values = {k: v for k, v in found if _guardable(v, [_MAX_GUARDED])}
        modules: dict[int, torch.nn.Module] = {}
        for _, v in found:
            if isinstance(v, torch.nn.Module):
                modules.setdefault(id(v), v)
        optimizers = tuple({id(v): v for _, v in found if isinstance(v, torch.optim.Optimizer)}.values())
        return _Free(values, _attribute_guards(found, self.names), tuple(modules.values()), optimizers)


def _stores(code: types.CodeType) -> tuple[str, ...]:
    """Globals the code (nested code included) assigns or deletes, and closed-over names it assigns."""
    out = [i.argval for i in dis.get_instructions(code) if i.opname == "STORE_DEREF" and i.argval in code.co_freevars]
    stack = [code]
    while stack:
        c = stack.pop()
        out += [i.argval for i in dis.get_instructions(c) if i.opname in ("STORE_GLOBAL", "DELETE_GLOBAL")]
        stack += [k for k in c.co_consts if isinstance(k, types.CodeType)]
    return tuple(dict.fromkeys(out))


def _store_message(func: Any, names: tuple[str, ...]) -> str:
    return (
        f"jaxtorch.jit: `{func.__qualname__}` assigns "
        + ", ".join(f"`{n}`" for n in names)
        + " (a `global` or `nonlocal` name). A compiled function's Python runs only while it is traced "
        "(once per compilation), not at every call, so the assignment would happen once and the value "
        "would be wrong afterwards. Return the value from the function instead, or keep it in a tensor "
        "passed as an argument (`count.add_(1)` is written back at every call)."
    )


def _reading(fn: Callable, values: dict[tuple[str, Any], Any]) -> Callable:
    """A copy of `fn` that sees `values` in the closure cells, globals and default arguments they came from
    (while tracing: the program's inputs in place of the caller's tensors)."""
    owner = getattr(fn, "__self__", None)
    func = cast(types.FunctionType, getattr(fn, "__func__", fn))
    cells = list(func.__closure__ or ())
    g = func.__globals__
    new_globals = {n: v for (kind, n), v in values.items() if kind == "global"}
    for (kind, i), v in values.items():
        if kind == "cell":
            cells[i] = types.CellType(v)
    defaults = list(func.__defaults__ or ())
    kwdefaults = dict(func.__kwdefaults__ or {})
    for (kind, at), v in values.items():
        if kind == "default":
            defaults[at] = v
        elif kind == "kwdefault":
            kwdefaults[at] = v
    copy = types.FunctionType(
        func.__code__,
        {**g, **new_globals} if new_globals else g,
        func.__name__,
        tuple(defaults) or None,
        tuple(cells) or None,
    )
    copy.__kwdefaults__ = kwdefaults or None
    attrs = {n: v for (kind, n), v in values.items() if kind == "attr"}
    if owner is None:
        return copy
    if attrs:
        owner = _Shadow(owner, attrs)
    return types.MethodType(copy, owner)


class _Shadow:
    """`obj` with some attributes read from `values` instead (a bound method's `self`)."""

    def __init__(self, obj: Any, values: dict[str, Any]):
        object.__setattr__(self, "_obj", obj)
        object.__setattr__(self, "_values", values)

    def __getattr__(self, name: str) -> Any:
        values = object.__getattribute__(self, "_values")
        if name in values:
            return values[name]
        return getattr(object.__getattribute__(self, "_obj"), name)


def _rebound(slot: JaxTensor, new: Any, name: str) -> None:
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
def _refusing_untracked_writes(target: Any) -> Iterator[None]:
    """While the user's code is traced, a write to a tensor holding a concrete array (so one
    created outside the program and not passed in as state) raises `StateWriteError`."""
    stack = getattr(_tracing, "stack", None)
    if stack is None:
        stack = _tracing.stack = []
    stack.append(target)
    try:
        with writes.checking(_refuse_untracked_write):
            yield
    finally:
        stack.pop()


def _refuse_untracked_write(t: torch.Tensor) -> None:
    stack = getattr(_tracing, "stack", None)
    if not stack:  # another thread's trace
        return
    if isinstance(t, JaxTensor) and writes.made_in(root_data(t)):
        return  # program state (an argument, a module's tensor) or made inside the program
    raise StateWriteError(
        f"jaxtorch.compile: the function writes in place into {_describe(t, stack[-1])}, which is not "
        "program state: it is reached from outside the function's arguments (a closure or a global), so the "
        "write would be lost after the first call and its traced value would leak. Pass the tensor (or the "
        "object holding it: a cache, a list, a dict, a dataclass) as an argument, name its module in "
        "`jaxtorch.compile(fn, state=(module,))`, or write to a copy."
    )


def _describe(t: torch.Tensor, fn: Callable[..., Any]) -> str:
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


def _filled(cell: Any) -> bool:
    try:
        _ = cell.cell_contents
        return True
    except ValueError:
        return False


def _find(t: Any, value: Any, name: str) -> str | None:
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


def _state_tensor(value: Any, dtype: torch.dtype | None, requires_grad: bool) -> JaxTensor:
    """A module tensor inside the program: its torch dtype (int64 held as int32), a leaf requiring grad if it does."""
    t = JaxTensor(value) if dtype is None else labelled(value, dtype)
    if requires_grad:
        t.requires_grad_(True)
    return t


def _wrap(out: Any, dtypes: list | None = None) -> Any:
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


def compile(target: torch.nn.Module | Callable, *, state: tuple = ()) -> Compiled:
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

    **Returns:** a `Compiled` callable; `.compilations` counts traces, `.stats()` gives the
    recompilations and their reasons (a guarded global, closure value, hook or module
    attribute that changed; see the module docstring).

    **Example:**
        ```python
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).to("jax")
        fast = jaxtorch.compile(model)
        y = fast(torch.ones(3, 4, device="jax"))    # traced and compiled once
        y = fast(torch.zeros(3, 4, device="jax"))   # the same program
        assert fast.compilations == 1
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
        def affine(x, w):
            return x @ w + 1

        y = affine(torch.ones(2, 3, device="jax"), torch.ones(3, 4, device="jax"))  # a (2, 4) tensor of 4.0
        ```
    """
    return Compiled(fn)
