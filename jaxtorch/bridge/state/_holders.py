"""The state hidden in torch objects, made explicit for a compiled train step.

A train step written in torch (`loss.backward(); opt.step()`) changes tensors that live
inside objects: parameters and buffers (in place), `.grad` slots (backward), optimizer
state (`exp_avg`, `step`, momentum buffers) and the learning rate a scheduler sets.
`jaxtorch.compile` threads all of it through its `jax.jit` program as ordinary inputs
and outputs:

- `Holders.read()` reads the current values into a `State` (a pytree of JAX arrays) and
  its static signature (which grads exist, which optimizer state is set, hyperparameters);
- `with holders.bound(state, statics)` puts values (tracers, while tracing) into the
  objects, the module state through one `Binding` (`_binding.py`); after the step has
  run, `read()` again gives the new values, leaving the block puts the originals back,
  and `install` of the program's results makes the update real.

Optimizers run in their `capturable` form while traced (no `.item()` on the step
counter), and the learning rate of SGD, RMSprop, Adam, AdamW, Adamax, NAdam, RAdam,
Adadelta and ASGD (exact classes, `_TENSOR_LR`) is a traced scalar, so an LR scheduler
between steps does not recompile. Other hyperparameters (momentum, betas, weight decay),
and the learning rate of other optimizers, are part of the static signature: changing one
compiles again (`Compiled.compilations` shows it).

Example:
    ```python
    holders = Holders.of([model, opt])
    state, signature = holders.read()
    ```
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from ..._compat import Tracer
from ..core import _pytrees as pytrees
from ..tensor._convert import array_to_torch, tensor_to_jax
from ..tensor._tensor import JaxTensor, labelled, make_view, root, view_fn, view_key, was_written, write
from ._binding import Binding

# Optimizers whose step accepts a tensor learning rate (checked against eager torch in
# tests/interop/test_compile_train_step.py): an LR scheduler between steps does not recompile.
# Exact types: a subclass may override `step` with code that needs a Python float.
_TENSOR_LR = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adadelta,
    torch.optim.ASGD,
    torch.optim.RMSprop,
    torch.optim.SGD,
)


@dataclasses.dataclass
class State:
    """Arrays of one snapshot: tensors (params and buffers), grads, optimizer state, lrs."""

    tensors: list[jax.Array | None]  # None in a step's results: a tensor the step did not write
    grads: list[jax.Array | None]
    opt_state: list[list[dict[str, jax.Array]]]
    lrs: list[list[jax.Array | None]]


jax.tree_util.register_dataclass(State, data_fields=["tensors", "grads", "opt_state", "lrs"], meta_fields=[])


def _array(t: Any, what: str) -> jax.Array:
    if isinstance(t, JaxTensor):
        return t.elem
    if isinstance(t, torch.Tensor):
        return tensor_to_jax(t.detach())
    raise TypeError(f"jaxtorch.compile: {what} is a {type(t).__name__}, expected a tensor")


def freeze(x: Any) -> Any:
    """A hashable stand-in for a static value (lists become tuples, the unhashable their repr)."""
    if isinstance(x, (list, tuple)):
        return tuple(freeze(v) for v in x)
    try:
        hash(x)
        return x
    except TypeError:
        return repr(x)


@dataclasses.dataclass
class Holders:
    """The modules and optimizers whose tensors one compiled call reads and writes."""

    modules: tuple[torch.nn.Module, ...]
    optimizers: tuple[torch.optim.Optimizer, ...]
    tensors: list[JaxTensor]  # the roots holding the parameters' and buffers' data, each once
    params: list[JaxTensor]  # the subset with requires_grad (their .grad slots are state)

    @classmethod
    def of(cls, objects) -> Holders:
        """Collect the modules' and optimizers' tensors (each once, by identity).

        Raises `TypeError` naming the tensor when one is not on the `jax` device: a train
        step's parameters must be JAX values (`model.to("jax")` before building the
        optimizer).
        """
        modules = tuple(o for o in objects if isinstance(o, torch.nn.Module))
        optimizers = tuple(o for o in objects if isinstance(o, torch.optim.Optimizer))
        found: dict[int, tuple[str, torch.Tensor]] = {}
        for m in modules:
            for name, t in [*m.named_parameters(), *m.named_buffers()]:
                found.setdefault(id(t), (f"{type(m).__name__}.{name}", t))
        for opt in optimizers:
            for g, group in enumerate(opt.param_groups):
                for j, p in enumerate(group["params"]):
                    found.setdefault(id(p), (f"{type(opt).__name__}.param_groups[{g}]['params'][{j}]", p))
        checked: list[JaxTensor] = []
        for name, t in found.values():
            if not isinstance(t, JaxTensor):
                raise TypeError(
                    f"jaxtorch.compile: `{name}` is on {t.device}, not the jax device. A compiled train step "
                    "updates its tensors in place, so they must be JAX values: call `model.to('jax')` "
                    "before creating the optimizer (or use `jaxtorch.compile(model)` for a forward only)."
                )
            checked.append(t)
        # Parameters are usually views of a hidden root (`Parameter(x)` detaches): the roots
        # hold the data, so they are the state; the views replay from them.
        roots: dict[int, JaxTensor] = {}
        for t in checked:
            r = root(t)
            roots.setdefault(id(r), r)
        params = [t for t in checked if t.requires_grad]
        return cls(modules, optimizers, list(roots.values()), params)

    def _opt_params(self):
        for opt in self.optimizers:
            yield opt, [[p for p in group["params"]] for group in opt.param_groups]

    def read(self) -> tuple[State, Any]:
        """Current values as a `State`, plus the static signature they belong to."""
        sig_grads = tuple(p.grad is not None for p in self.params)
        grads = [None if p.grad is None else _array(p.grad, "a .grad") for p in self.params]
        opt_state, lrs, sig_opt = [], [], []
        for opt, groups in self._opt_params():
            per_opt: list[dict[str, jax.Array]] = []
            per_lr: list[jax.Array | None] = []
            sig: list[tuple] = []
            for group, params in zip(opt.param_groups, groups):
                traced_lr = type(opt) in _TENSOR_LR and not isinstance(group["lr"], torch.Tensor)
                per_lr.append(jnp.asarray(group["lr"], jnp.float32) if traced_lr else None)
                hyper = {k: freeze(v) for k, v in group.items() if k != "params" and not (k == "lr" and traced_lr)}
                sig.append(tuple(sorted(hyper.items())))
                for p in params:
                    st = opt.state.get(p, {})
                    arrays = {
                        k: _array(v, f"optimizer state '{k}'") for k, v in st.items() if isinstance(v, torch.Tensor)
                    }
                    statics = tuple(sorted((k, freeze(v)) for k, v in st.items() if not isinstance(v, torch.Tensor)))
                    per_opt.append(arrays)
                    sig.append((tuple(sorted(arrays)), statics))
            opt_state.append(per_opt)
            lrs.append(per_lr)
            sig_opt.append(tuple(sig))
        state = State([t.elem for t in self.tensors], grads, opt_state, lrs)
        signature = (
            len(self.tensors),
            tuple(map(id, self.params)),
            sig_grads,
            tuple(sig_opt),
            tuple(m.training for m in self.modules),
        )
        return state, signature

    @contextlib.contextmanager
    def bound(self, state: State, statics: Any) -> Iterator[Binding]:
        """Inside, the objects hold `state`'s values (tracers: this is for tracing a step); on
        exit they hold what they held before, whatever the step did.

        The modules and the tensors' roots go through one `Binding` (snapshot, bind, restore;
        ask it for `leaks()` before leaving); `.grad` slots and optimizer state are put back
        here. Optimizers are switched to their capturable code path, and traced learning
        rates are installed as tensors.

        **Example:**
            ```python
            with holders.bound(state, statics) as binding:
                step()
                new_state, _ = holders.read()
            ```
        """
        saved = (
            [p.grad for p in self.params],
            [dict(opt.state) for opt in self.optimizers],
            [[dict(g) for g in opt.param_groups] for opt in self.optimizers],
        )
        with Binding(self.modules, self.tensors) as binding:
            try:
                binding.bind_data(state.tensors)
                self._install_rest(state, statics, tracing=True)
                yield binding
            finally:
                self._put_back(*saved)

    def _put_back(self, grads: list, states: list, groups: list) -> None:
        """Give the `.grad` slots and optimizers back what `bound` found (the same objects)."""
        for p, g in zip(self.params, grads):
            p.grad = g
        for opt, st, gs in zip(self.optimizers, states, groups):
            opt.state.clear()
            opt.state.update(st)
            for group, saved in zip(opt.param_groups, gs):
                group.clear()
                group.update(saved)

    def install(self, state: State, statics: Any) -> None:
        """Write a step's results into the objects for good (non-tensor optimizer state from
        `statics`); hyperparameters are left alone."""
        for t, value in zip(self.tensors, state.tensors):
            if value is not None:  # None: not written by the step
                write(t, value)
        self._install_rest(state, statics, tracing=False)

    def _install_rest(self, state: State, statics: Any, *, tracing: bool) -> None:
        """Put `state`'s grads and optimizer state into the objects (`install` and `bound`).

        While tracing, optimizers are switched to their capturable code path and traced
        learning rates are installed as tensors; otherwise hyperparameters are left alone.
        """
        for p, g in zip(self.params, state.grads):
            p.grad = None if g is None else JaxTensor(g)
        opt_statics = iter(statics or [])
        for (opt, groups), per_opt, per_lr in zip(self._opt_params(), state.opt_state, state.lrs):
            arrays = iter(per_opt)
            for group, params, lr in zip(opt.param_groups, groups, per_lr):
                if tracing:
                    if "capturable" in group:
                        group["capturable"] = True
                    if lr is not None:  # (SGD's `add_(g, alpha=-lr)`: see dispatch's `_scaled_by_alpha`)
                        group["lr"] = JaxTensor(lr)
                for p in params:
                    values = {k: JaxTensor(v) for k, v in next(arrays).items()}
                    values.update(next(opt_statics, {}))
                    if values:
                        opt.state[p] = values
                    else:
                        opt.state.pop(p, None)

    def state_statics(self) -> list[dict[str, Any]]:
        """Non-tensor optimizer state per parameter (read after a traced step)."""
        out = []
        for opt, groups in self._opt_params():
            for params in groups:
                for p in params:
                    out.append({k: v for k, v in opt.state.get(p, {}).items() if not isinstance(v, torch.Tensor)})
        return out


# ---- the tensors reachable from a call's arguments ---------------------------------------
class Slot(int):
    """Where a tensor stood among a call's argument leaves: the index of its unique tensor."""

    def __repr__(self) -> str:
        return f"<tensor {int(self)}>"


def is_array_like(x) -> bool:
    """A torch tensor, `jax.Array` or tracer: what an argument walk takes as data."""
    return isinstance(x, (torch.Tensor, jax.Array, Tracer))


def _is_holder(x) -> bool:
    return isinstance(x, (torch.nn.Module, torch.optim.Optimizer))


@dataclasses.dataclass
class ArgState:
    """Every tensor reachable from a call's arguments (through lists, tuples, dicts,
    dataclasses, `ModelOutput`s, Hugging Face caches and any registered pytree), each
    once by identity, and the static rest of the arguments. An argument that is an object
    of an unregistered class keeping tensors in its attributes gets its class registered
    with `pytrees.register_object` (so its tensors are state, not constants).

    They enter the program as inputs; what the program writes in place, or the new
    tensors it puts into the argument containers (a growing `DynamicCache`, a cache
    layer's lazy initialization), comes out and is written back by `write_back`.
    """

    treedef: Any
    statics: tuple  # per leaf: a `Slot` for a tensor, else the (static) value itself
    tensors: list  # the unique tensors, originals (then the roots of aliased views, if not among them)
    views: dict[int, tuple[int, Any]] = dataclasses.field(default_factory=dict)  # j -> (root's j, view fn)

    @classmethod
    def of(cls, args: tuple, kwargs: dict) -> ArgState:
        leaves, treedef = pytrees.flatten((args, kwargs))
        plain = {type(x) for x in leaves if _plain_stateful(x)}
        while plain:  # an object of a class of yours holding tensors: its tensors are state too
            for c in plain:
                pytrees.register_object(c)
            leaves, treedef = pytrees.flatten((args, kwargs))
            plain = {type(x) for x in leaves if _plain_stateful(x)}
        index: dict[int, int] = {}
        tensors: list = []
        statics: list = []
        for x in leaves:
            if is_array_like(x):
                j = index.setdefault(id(x), len(tensors))
                if j == len(tensors):
                    tensors.append(x)
                statics.append(Slot(j))
            else:
                statics.append(x)
        return cls(treedef, tuple(statics), tensors, _aliased_views(tensors))

    def holders(self) -> tuple:
        """The modules and optimizers among the arguments."""
        return tuple(x for x in self.statics if _is_holder(x))

    def arrays(self) -> list:
        """The tensors' current values, as JAX arrays."""
        return [_array(t, "an argument") if isinstance(t, torch.Tensor) else t for t in self.tensors]

    def key(self, arrays) -> tuple:
        """What decides a program: structure, static values, the arrays' shapes and dtypes, and
        which tensors require grad (they keep `requires_grad` inside the program)."""
        return (
            self.treedef,
            tuple(freeze(s) for s in self.statics),
            tuple((tuple(a.shape), str(a.dtype), getattr(t, "dtype", None)) for a, t in zip(arrays, self.tensors)),
            self.requiring_grad(),
            tuple((j, r, view_key(fn) or id(fn)) for j, (r, fn) in self.views.items()),
        )

    def requiring_grad(self) -> tuple[int, ...]:
        """Positions of the tensors that require grad (floating or complex ones)."""
        return tuple(j for j, t in enumerate(self.tensors) if wants_grad(t))

    def rebuild(self, arrays) -> tuple[tuple, dict, list]:
        """Fresh arguments holding `JaxTensor(array)`s (aliases share one); the containers are
        copies, so nothing the traced function does reaches the caller's objects. A tensor
        that requires grad gives a leaf that requires grad (autograd inside the function works
        as in eager torch)."""
        grads = set(self.requiring_grad()) if torch.is_grad_enabled() else set()
        inputs = [_input(a, t, j in grads) for j, (a, t) in enumerate(zip(arrays, self.tensors))]
        for j, (r, fn) in self.views.items():  # arguments aliasing one root: views of one input
            inputs[j] = make_view(inputs[r], fn(inputs[r].elem), fn)
        leaves = [inputs[s] if isinstance(s, Slot) else s for s in self.statics]
        args, kwargs = jax.tree_util.tree_unflatten(self.treedef, leaves)
        return args, kwargs, inputs

    def outcome(self, args, kwargs, inputs) -> tuple[list, list, Any]:
        """After the traced call: (written values, new leaves' values, aux for `write_back`)."""
        written = [j for j, t in enumerate(inputs) if j not in self.views and was_written(t)]
        for j in written:
            if not isinstance(self.tensors[j], torch.Tensor):
                raise TypeError(
                    "jaxtorch.compile: the function writes in place into an argument that is a "
                    "jax.Array, which never changes; pass a torch tensor (`jaxtorch.torch_view(a)`)."
                )
        leaves, treedef = pytrees.flatten((args, kwargs))
        ids = {id(t): j for j, t in enumerate(inputs)}
        after: list = []
        new: list[jax.Array] = []
        for x in leaves:
            if is_array_like(x):
                at = ids.get(id(x))
                if at is not None:
                    after.append(Slot(at))
                else:
                    after.append(_NewLeaf(len(new)))
                    new.append(x.elem if isinstance(x, JaxTensor) else _array(x, "a tensor put into an argument"))
            else:
                after.append(x)
        same = (
            treedef == self.treedef
            and len(after) == len(self.statics)
            and all(
                a is s or (isinstance(a, Slot) and isinstance(s, Slot) and a == s) for a, s in zip(after, self.statics)
            )
        )
        aux = (tuple(written), None if same else (treedef, tuple(after)))
        return [inputs[j].elem for j in written], new, aux

    def write_back(self, args: tuple, kwargs: dict, aux, written_values, new_values) -> None:
        """Put the program's results into the caller's tensors and containers (the one place
        a compiled call changes its arguments)."""
        written, structure = aux
        for j, value in zip(written, written_values):
            t = self.tensors[j]
            if isinstance(t, JaxTensor):
                write(t, value)
            else:
                with torch.no_grad():
                    t.copy_(array_to_torch(value, copy=False))
        if structure is None:
            return
        treedef, after = structure
        leaves = [
            self.tensors[a] if isinstance(a, Slot) else JaxTensor(new_values[a.index]) if isinstance(a, _NewLeaf) else a
            for a in after
        ]
        new_args, new_kwargs = jax.tree_util.tree_unflatten(treedef, leaves)
        _merge(args, new_args)
        _merge(kwargs, new_kwargs)


@dataclasses.dataclass(frozen=True)
class _Strided:
    """The view `as_strided(shape, stride, offset)` of a flat root array (a CPU tensor's memory)."""

    shape: tuple
    stride: tuple
    offset: int

    def __call__(self, flat):
        idx = np.full(self.shape, self.offset, np.int64)
        for d, (n, st) in enumerate(zip(self.shape, self.stride)):
            idx = idx + (np.arange(n) * st).reshape((-1,) + (1,) * (len(self.shape) - d - 1))
        return flat[jnp.asarray(idx, jnp.int32)]

    @property
    def key(self) -> tuple:
        return ("as_strided", self.shape, self.stride, self.offset)


def _aliased_views(tensors: list) -> dict[int, tuple[int, Any]]:
    """Argument tensors sharing a root with another one (overlapping views, a tensor and a
    view of it): each becomes a view of the root, which is the program input (appended to
    `tensors` when not an argument itself), so a write through one is seen through the others
    as in eager torch. Groups with a tensor requiring grad are left apart (their gradients
    flow to each input)."""
    groups: dict[int, list[int]] = {}
    for j, t in enumerate(tensors):
        if isinstance(t, JaxTensor):
            groups.setdefault(id(root(t)), []).append(j)
    views: dict[int, tuple[int, Any]] = {}
    cpu: dict[tuple, list[int]] = {}  # CPU tensors sharing memory: a flat tensor over it is their root
    for j, t in enumerate(tensors):
        if isinstance(t, torch.Tensor) and not isinstance(t, JaxTensor) and t.device.type == "cpu" and t.numel():
            cpu.setdefault((t.untyped_storage().data_ptr(), t.dtype), []).append(j)
    for js in cpu.values():
        if len(js) < 2 or any(wants_grad(tensors[j]) for j in js):
            continue
        first = tensors[js[0]]
        flat = first.as_strided((first.untyped_storage().nbytes() // first.element_size(),), (1,), 0)
        rj = len(tensors)
        tensors.append(flat)
        for j in js:
            t = tensors[j]
            views[j] = (rj, _Strided(tuple(t.shape), tuple(t.stride()), t.storage_offset()))
    for js in groups.values():
        if len(js) < 2 or any(wants_grad(tensors[j]) for j in js):
            continue
        r = root(tensors[js[0]])
        at = next((j for j in js if tensors[j] is r), None)
        if at is None:
            at = len(tensors)
            tensors.append(r)
        for j in js:
            if j != at:
                views[j] = (at, view_fn(tensors[j]))
    return views


def wants_grad(t) -> bool:
    """A torch tensor that requires grad and can have a gradient (floating or complex)."""
    return isinstance(t, torch.Tensor) and t.requires_grad and (t.dtype.is_floating_point or t.dtype.is_complex)


def _plain_stateful(x) -> bool:
    """An instance of an unregistered class keeping tensors in its attributes."""
    if is_array_like(x) or _is_holder(x) or isinstance(x, type) or callable(x):
        return False
    d = getattr(x, "__dict__", None)
    return isinstance(d, dict) and type(x).__module__ != "builtins" and any(pytrees.holds_arrays(v) for v in d.values())


@dataclasses.dataclass(frozen=True)
class _NewLeaf:
    index: int


def _merge(orig, new):
    """Make `orig` hold what `new` holds, mutating `orig`'s containers in place (so the
    caller's objects keep their identity); returns what belongs in `orig`'s slot."""
    if orig is new:
        return orig
    if type(orig) is not type(new) or is_array_like(orig):
        return new
    if isinstance(orig, list):
        merged = [_merge(o, n) for o, n in zip(orig, new)] + list(new[len(orig) :])
        orig[:] = merged
        return orig
    if isinstance(orig, dict) and not pytrees.is_model_output(orig):
        entries = {k: (_merge(orig[k], v) if k in orig else v) for k, v in new.items()}
        for k in [k for k in orig if k not in entries]:
            del orig[k]
        orig.update(entries)
        return orig
    if isinstance(orig, tuple):
        merged = [_merge(o, n) for o, n in zip(orig, new)]
        return orig if len(orig) == len(new) and all(m is o for m, o in zip(merged, orig)) else new
    if (
        hasattr(orig, "__dict__")
        and not dataclasses.is_dataclass(orig)
        or (dataclasses.is_dataclass(orig) and not _frozen_dataclass(orig))
    ):
        od, nd = vars(orig), vars(new)
        for k, v in nd.items():
            merged = _merge(od[k], v) if k in od else v
            if k not in od or merged is not od[k]:
                object.__setattr__(orig, k, merged)
        for k in [k for k in od if k not in nd]:
            delattr(orig, k)
        return orig
    return new


def _frozen_dataclass(obj: object) -> bool:
    """Whether `obj` is an instance of a frozen dataclass (a dataclass itself, a class, counts as frozen:
    it is replaced, never written to). Example: for `@dataclass(frozen=True) class P: x: int`,
    `_frozen_dataclass(P(1))` is True."""
    params = getattr(type(obj), "__dataclass_params__", None)
    return isinstance(obj, type) or (params is not None and params.frozen)


def _input(a, t, requires_grad: bool) -> JaxTensor:
    """An argument's array as a fresh tensor of the argument's torch dtype (int64 held as int32)."""
    x = labelled(a, t.dtype) if isinstance(t, torch.Tensor) else JaxTensor(a)
    if requires_grad:
        x.requires_grad_(True)
    return x
