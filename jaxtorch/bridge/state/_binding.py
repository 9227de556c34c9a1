"""Module state, one mechanism: snapshot, bind by identity, restore.

Every entry point that runs a torch module on other values (`extract`'s function,
`TorchModule`, `call_torch`, a `jaxtorch.compile`d module or train step, the mesh-axes
region) goes through one `Binding`:

1. **snapshot** (constructing it): the attribute dictionaries of every submodule of the
   given modules (each once, shared ones included), and the data of the given tensors'
   roots (each root once);
2. **bind by identity**: `bind` puts a replacement into every slot (a submodule's
   `_parameters` or `_buffers` entry) that holds the named tensor *object*, which is also
   what ties weights (GPT-2's `lm_head.weight is wte.weight`) and reaches a submodule shared
   under two names (timm's CoaT `cpe`), where `torch.func.functional_call`'s by-name restore
   would read back a swapped tensor; `bind_data` gives the roots other arrays;
3. **restore**: `restore()` (or leaving the `with` block) puts back exactly what was found,
   the same objects, whatever ran since: entries a forward replaced or added (cached
   tensors, re-registered buffers) are undone, the roots get their data back. `carry`
   instead keeps what the run left in the roots, converted (the mesh axes' way back).

What the run did is asked before restoring: `rebound()` (a forward assigned another tensor
to a bound parameter or buffer: `self.buf = new`) and `leaks()` (attributes that now hold a
traced value).

Example:
    ```python
    with Binding([model]) as b:
        b.bind(model, {"fc.weight": JaxTensor(w)})
        out = model(x)
    # model.fc.weight is the original Parameter again

    with bound(model, {"fc.weight": JaxTensor(w)}):   # the same, in one line
        out = model(x)
    ```
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Self

import torch

from ..._compat import Tracer
from ..core._errors import ParamsError
from ..dispatch._writes import read_only
from ..tensor._tensor import JaxTensor, root, root_data, set_root_data

_MISSING = object()
_SLOTS = ("_parameters", "_buffers", "_modules")


def _restore(target: dict, saved: dict) -> None:
    """Make `target` hold exactly `saved`'s entries (the same objects), in place."""
    for key in [k for k in target if k not in saved]:
        del target[key]
    for key, value in saved.items():
        if target.get(key, _MISSING) is not value:
            target[key] = value


def _holds_tracer(v: Any) -> bool:
    """Whether `v` (a tensor, array or container of them) holds a JAX tracer."""
    if isinstance(v, JaxTensor):
        return isinstance(root_data(v), Tracer)
    if isinstance(v, Tracer):
        return True
    if isinstance(v, (list, tuple)):
        return any(_holds_tracer(x) for x in v)
    if isinstance(v, dict):
        return any(_holds_tracer(x) for x in v.values())
    return False


class Binding:
    """A snapshot of module state, the values bound into it, and the way back.

    **Arguments:**
    - `modules`: torch modules whose submodules' attribute dictionaries (and their
      `_parameters`, `_buffers`, `_modules`) `restore` puts back.
    - `tensors`: `JaxTensor`s whose roots' data `bind_data` replaces and `restore` puts
      back (other tensors are ignored).

    **Example:**
        ```python
        b = Binding([model])
        try:
            b.bind(model, {"fc.weight": JaxTensor(w)})
            out = model(x)
            leaked = b.leaks()
        finally:
            b.restore()
        ```
    """

    def __init__(self, modules: Iterable[torch.nn.Module] = (), tensors: Iterable[torch.Tensor] = ()):
        self._attrs: list[tuple[torch.nn.Module, dict, list[tuple[dict, dict]]]] = []
        seen: set[int] = set()
        for top in modules:
            for m in top.modules():
                if id(m) not in seen:
                    seen.add(id(m))
                    d = m.__dict__
                    self._attrs.append((m, dict(d), [(d[s], dict(d[s])) for s in _SLOTS if isinstance(d.get(s), dict)]))
        roots: dict[int, JaxTensor] = {}
        for t in tensors:
            if isinstance(t, JaxTensor):
                r = root(t)
                roots.setdefault(id(r), r)
        self._data = [(r, root_data(r)) for r in roots.values()]
        self._slots: list[tuple[dict, str, str, torch.Tensor]] = []  # (slot dict, key, name, bound value)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    @property
    def roots(self) -> list[JaxTensor]:
        """The distinct roots of the `tensors` given, in order: what `bind_data` takes values for."""
        return [r for r, _ in self._data]

    def bind(self, module: torch.nn.Module, values: Mapping[str, torch.Tensor]) -> None:
        """Put `values[name]` into every parameter/buffer slot of `module` holding the tensor
        `named_state(module)[name]` (tied and shared slots all get it); names left out keep
        the module's own tensors. Names `named_state` does not give raise `KeyError`."""
        state = named_state(module)
        unknown = [k for k in values if k not in state]
        if unknown:
            raise KeyError(_unknown_names(unknown, state, module))
        names = {id(state[name]): name for name in values}
        slots: list[tuple[dict, str, str]] = [
            (d, k, names[id(t)])
            for m in module.modules()
            for d in (m._parameters, m._buffers)
            for k, t in d.items()
            if t is not None and id(t) in names
        ]
        for d, k, name in slots:
            d[k] = values[name]
            self._slots.append((d, k, name, values[name]))

    def bind_data(self, values: Sequence[Any]) -> None:
        """Give each of `roots` the array at its position in `values` (None: keep its own);
        views of them replay on it."""
        for (r, _), value in zip(self._data, values):
            if value is not None:
                set_root_data(r, value)

    def rebound(self) -> list[tuple[str, Any]]:
        """`(name, value)` for each bound slot the run assigned another value to (a forward's
        `self.buf = new`); the value is None where the entry was deleted."""
        return [(name, d.get(k)) for d, k, name, value in self._slots if d.get(k, _MISSING) is not value]

    def leaks(self) -> list[str]:
        """`Class.attribute` for each attribute (or parameter/buffer/child entry) changed since
        the snapshot that now holds a traced value; bound slots are `rebound`'s, not leaks."""
        bound = {(id(d), k) for d, k, _, _ in self._slots}
        leaked = []
        for m, attrs, slots in self._attrs:
            for live, saved in [*slots, (m.__dict__, attrs)]:
                leaked += [
                    f"{type(m).__name__}.{k}"
                    for k, v in live.items()
                    if (k not in saved or saved[k] is not v) and (id(live), k) not in bound and _holds_tracer(v)
                ]
        return leaked

    def restore(self) -> None:
        """Put back every attribute dictionary and every root's data as the snapshot found them."""
        for m, attrs, slots in self._attrs:
            _restore(m.__dict__, attrs)
            for slot, entries in slots:
                _restore(slot, entries)
        for r, data in self._data:
            set_root_data(r, data)

    def carry(self, convert: Callable[[JaxTensor, Any], Any]) -> None:
        """Instead of restoring the roots' data, give each root `convert(root, data_now)`: what
        the run left in it, converted (its own sharding back, say). Attributes are not touched."""
        for r, _ in self._data:
            set_root_data(r, convert(r, root_data(r)))


def _unknown_names(unknown: list[str], state: dict, module: torch.nn.Module) -> str:
    return (
        f"jaxtorch: {unknown[:5]} {'is' if len(unknown) == 1 else 'are'} not parameters or buffers "
        f"of this {type(module).__name__} (it has {list(state)[:5]}...)"
        + (
            "; `.kernel` names are convolution weights in Flax's layout, which the function from "
            "`extract(module, conv_layout='flax')` takes"
            if any(k.endswith("kernel") for k in unknown)
            else ""
        )
    )


def named_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters then buffers by name, tied tensors once (first name, as `named_parameters` gives).

    Example: `named_state(gpt2)` has `transformer.wte.weight` and no `lm_head.weight` (tied).
    """
    state: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, p in module.named_parameters(remove_duplicate=True):
        state[name] = p
        seen.add(id(p))
    for name, b in module.named_buffers(remove_duplicate=True):
        if id(b) not in seen:
            state[name] = b
            seen.add(id(b))
    return state


def is_trainable(t: torch.Tensor) -> bool:
    """Whether a module tensor is a trainable parameter: an `nn.Parameter` with
    `requires_grad=True` and a floating or complex dtype (what `torch.optim` would update)."""
    return isinstance(t, torch.nn.Parameter) and t.requires_grad and (t.dtype.is_floating_point or t.dtype.is_complex)


def split_state(module: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The one rule splitting a module's tensors: `(params, state)`, both by `named_state` names.

    `params` are the trainable parameters (`is_trainable`: floating or complex,
    `requires_grad=True`; tied weights once, under the first name `named_parameters` gives);
    `state` is everything else: buffers (persistent or not), frozen parameters
    (`requires_grad=False`) and non-float parameters. `extract`, `torch_module_to_jax`,
    `make_train_step` and `load_into` all use this rule.

    **Example:**
        ```python
        m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
        m[0].bias.requires_grad_(False)
        params, state = split_state(m)
        # params: 0.weight, 1.weight, 1.bias; state: 0.bias, 1.running_mean, 1.running_var,
        # 1.num_batches_tracked
        ```
    """
    params: dict[str, torch.Tensor] = {}
    state: dict[str, torch.Tensor] = {}
    for name, t in named_state(module).items():
        (params if is_trainable(t) else state)[name] = t
    return params, state


def aliases(module: torch.nn.Module) -> dict[str, str]:
    """`{alias: name}` for every parameter/buffer name that `named_state` leaves out because the
    tensor is tied to (is the same object as) the one under `name` (`lm_head.weight` ->
    `transformer.wte.weight` in GPT-2)."""
    first = {id(t): n for n, t in named_state(module).items()}
    out: dict[str, str] = {}
    for named in (module.named_parameters(remove_duplicate=False), module.named_buffers(remove_duplicate=False)):
        for name, t in named:
            if first.get(id(t), name) != name:
                out[name] = first[id(t)]
    return out


Spec = dict[str, tuple[tuple[int, ...], Any]]


def spec_of(values: Mapping[str, Any]) -> Spec:
    """`{name: (shape, dtype)}` of arrays or tensors: what `check_tree` compares against."""
    return {k: (tuple(v.shape), v.dtype) for k, v in values.items()}


def check_tree(
    given: Any,
    expected: Spec,
    *,
    what: str,
    other: Spec | None = None,
    other_what: str = "",
    tied: Mapping[str, str] | None = None,
    renamed: Mapping[str, str] | None = None,
) -> None:
    """Raise `ParamsError` unless `given` is a dict with exactly `expected`'s names, each a
    JAX/NumPy array (or tracer) of the expected shape. Cheap: set comparisons, then one pass.

    **Arguments:**
    - `given`: what the caller passed.
    - `expected`: `spec_of` the right values.
    - `what`: how the message calls `given` (`"params"`, `"state="`).
    - `other`, `other_what`: the other dict's spec and name, to say where a name belongs.
    - `tied`: `aliases(module)`, to say what a tied alias is tied to.
    - `renamed`: `{torch name: kernel name}` of weights taken in Flax's layout.
    """
    if not isinstance(given, Mapping):
        raise ParamsError(
            f"jaxtorch: {what} must be the dict of JAX arrays `jaxtorch.extract` gave (name -> array); "
            f"got {type(given).__name__}" + (": pass `params` as the first argument" if given is None else "")
        )
    if given.keys() != expected.keys():
        problems = []
        for name in given.keys() - expected.keys():
            if tied and name in tied:
                problems.append(f"`{name}` is tied to `{tied[name]}` (one tensor): give it once, as `{tied[name]}`")
            elif other is not None and name in other:
                problems.append(f"`{name}` is not a trainable parameter: it belongs in {other_what}")
            elif renamed and name in renamed:
                problems.append(f"`{name}` is taken in Flax's layout, as `{renamed[name]}`: give that one only")
            elif name.endswith("kernel"):
                problems.append(
                    f"`{name}` is a convolution weight in Flax's layout, which the function from "
                    "`extract(module, conv_layout='flax')` takes"
                )
            else:
                problems.append(f"`{name}` is not a name of this module's {what}")
        missing = sorted(expected.keys() - given.keys())
        if missing:
            problems.append(
                f"missing {missing[:8]}{'...' if len(missing) > 8 else ''} ({len(missing)} of {len(expected)})"
            )
        raise ParamsError(
            f"jaxtorch: {what} do not match the module: " + "; ".join(sorted(problems)) + ". Pass exactly "
            f"the names `jaxtorch.extract` gave in {what} (trainable parameters in params, buffers and frozen "
            "parameters in `state=`, which defaults to `fn.state`)."
        )
    for name, value in given.items():
        if isinstance(value, torch.Tensor) and not isinstance(value, JaxTensor):
            raise ParamsError(
                f"jaxtorch: {what}[{name!r}] is a torch.Tensor; {what} hold JAX arrays: convert it with "
                "`jaxtorch.to_jax(t)` (zero-copy on the CPU)"
            )
        shape = getattr(value, "shape", None)
        if shape is None or not hasattr(value, "dtype"):
            raise ParamsError(
                f"jaxtorch: {what}[{name!r}] is {type(value).__name__}, not an array; give a jax.Array of "
                f"shape {expected[name][0]}"
            )
        if tuple(shape) != expected[name][0]:
            raise ParamsError(
                f"jaxtorch: {what}[{name!r}] has shape {tuple(shape)}; the module's is {expected[name][0]}"
            )


@contextlib.contextmanager
def training_modes(modes: Sequence[tuple[torch.nn.Module, bool]]) -> Iterator[None]:
    """Inside, each module has the given `training` flag; on exit each has its own flag back.

    Example: `with training_modes(modes_of(model, False)): model(x)` runs in eval mode.
    """
    saved = [(m, m.training) for m, _ in modes]
    try:
        for m, flag in modes:
            m.training = flag
        yield
    finally:
        for m, flag in saved:
            m.training = flag


def modes_of(module: torch.nn.Module, train: bool | None = None) -> tuple[tuple[torch.nn.Module, bool], ...]:
    """`(submodule, flag)` for every submodule: `train` for all, or (None) each one's flag now
    (mixed modes kept: a backbone in `eval()` under a head in `train()`)."""
    return tuple((m, m.training if train is None else bool(train)) for m in module.modules())


@contextlib.contextmanager
def as_found(modules: Iterable[torch.nn.Module]) -> Iterator[None]:
    """On exit, every submodule of `modules` has the attributes, parameters, buffers and
    children it had on entry (the same objects), whatever ran inside: a `Binding` with
    nothing bound.

    Example: `with as_found([model]): model(x)`.
    """
    with Binding(modules):
        yield


@contextlib.contextmanager
def bound(module: torch.nn.Module, tensors: Mapping[str, torch.Tensor], *, mutable: bool = True) -> Iterator[None]:
    """Inside, `module`'s parameters and buffers named in `tensors` are those tensors (in
    every slot that holds the same tensor object); on exit the module is exactly as found.

    **Arguments:**
    - `module`: the torch module.
    - `tensors`: replacements by the names `named_state` gives; names it does not give raise
      `KeyError`, names left out keep the module's own tensors.
    - `mutable`: False: a write to them raises `StateWriteError` (`dispatch._writes.read_only`).

    **Example:** `with bound(model, {"fc.weight": JaxTensor(w)}): out = model(x)`.
    """
    with Binding([module]) as binding:
        binding.bind(module, tensors)
        with contextlib.nullcontext() if mutable else read_only(tensors, type(module).__name__):
            yield
