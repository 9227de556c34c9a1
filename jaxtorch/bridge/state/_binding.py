"""Run a torch module with other tensors in its parameters and buffers, and leave it as found.

`torch.func.functional_call` restores a module after the call by name, so a submodule
reachable under two names (timm's CoaT shares its `cpe` convolutions between stages) gets
its "original" read back after the first name was already swapped, and keeps the traced
tensors. Here the swap goes by *identity*: every slot (a submodule's `_parameters` or
`_buffers` entry) that holds a given tensor object gets its replacement, which is also
what ties weights (GPT-2's `lm_head.weight is wte.weight`). Afterwards every submodule's
attribute dictionaries are put back exactly: entries the forward replaced or added
(cached tensors, re-registered buffers) are undone, and the same objects are back.

Example:
    ```python
    with bound(model, {"fc.weight": JaxTensor(w)}):
        out = model(x)
    # model.fc.weight is the original Parameter again
    ```
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator

import jax
import torch

_MISSING = object()
_SLOTS = ("_parameters", "_buffers", "_modules")


def _restore(target: dict, saved: dict) -> None:
    """Make `target` hold exactly `saved`'s entries (the same objects), in place."""
    for key in [k for k in target if k not in saved]:
        del target[key]
    for key, value in saved.items():
        if target.get(key, _MISSING) is not value:
            target[key] = value


class Snapshot:
    """The attribute dictionaries of every submodule of `modules` (each once, shared ones
    included): `restore()` puts back the same objects, whatever ran since; `leaks()` names
    the attributes changed since that now hold a traced value."""

    def __init__(self, modules: Iterable[torch.nn.Module]):
        self.saved = []
        seen: set[int] = set()
        for root in modules:
            for m in root.modules():
                if id(m) not in seen:
                    seen.add(id(m))
                    d = m.__dict__
                    self.saved.append((m, dict(d), [(d[s], dict(d[s])) for s in _SLOTS if isinstance(d.get(s), dict)]))

    def leaks(self) -> list[str]:
        leaked = []
        for m, attrs, slots in self.saved:
            for live, saved in [*slots, (m.__dict__, attrs)]:
                leaked += [f"{type(m).__name__}.{k}" for k, v in live.items()
                           if (k not in saved or saved[k] is not v) and _holds_tracer(v)]
        return leaked

    def restore(self) -> None:
        for m, attrs, slots in self.saved:
            _restore(m.__dict__, attrs)
            for slot, entries in slots:
                _restore(slot, entries)


def _holds_tracer(v) -> bool:
    from ..tensor._tensor import JaxTensor

    if isinstance(v, JaxTensor):
        root = v._jt_base if v._jt_base is not None else v
        return isinstance(root._jt_elem, jax.core.Tracer)
    if isinstance(v, jax.core.Tracer):
        return True
    if isinstance(v, (list, tuple)):
        return any(_holds_tracer(x) for x in v)
    if isinstance(v, dict):
        return any(_holds_tracer(x) for x in v.values())
    return False


@contextlib.contextmanager
def as_found(modules: Iterable[torch.nn.Module]) -> Iterator[None]:
    """On exit, every submodule of `modules` has the attributes, parameters, buffers and
    children it had on entry (the same objects), whatever ran inside."""
    snap = Snapshot(modules)
    try:
        yield
    finally:
        snap.restore()


def swap_in(module: torch.nn.Module, values: dict[str, torch.Tensor], names: dict[int, str]) -> list:
    """Put `values[name]` into every parameter/buffer slot holding the tensor named `name`
    (`names` maps `id(tensor)` to its name; tied and shared slots all get it). Returns the
    slots `(dict, key, name)`; a `Snapshot` taken before puts the originals back."""
    slots = [(d, k, names[id(t)]) for m in module.modules() for d in (m._parameters, m._buffers)
             for k, t in d.items() if t is not None and id(t) in names]
    for d, k, name in slots:
        d[k] = values[name]
    return slots


def named_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters then buffers by name, tied tensors once (first name, as `named_parameters` gives)."""
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
def bound(module: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> Iterator[None]:
    """Inside, `module`'s parameters and buffers named in `tensors` are those tensors (in
    every slot that holds the same tensor object); on exit the module is exactly as found.

    **Arguments:**
    - `module`: the torch module.
    - `tensors`: replacements by the names `named_state` gives; names it does not give raise
      `KeyError`, names left out keep the module's own tensors.
    """
    state = named_state(module)
    unknown = [k for k in tensors if k not in state]
    if unknown:
        raise KeyError(f"jaxtorch: {unknown[:5]} {'is' if len(unknown) == 1 else 'are'} not parameters or buffers "
                       f"of this {type(module).__name__} (it has {list(state)[:5]}...)"
                       + ("; `.kernel` names are convolution weights in Flax's layout, which the function from "
                          "`extract(module, conv_layout='flax')` takes" if any(k.endswith("kernel") for k in unknown) else ""))
    with as_found([module]):
        swap_in(module, tensors, {id(state[name]): name for name in tensors})
        yield
