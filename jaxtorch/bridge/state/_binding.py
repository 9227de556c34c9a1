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

import jax
import torch

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
        return isinstance(root_data(v), jax.core.Tracer)
    if isinstance(v, jax.core.Tracer):
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
