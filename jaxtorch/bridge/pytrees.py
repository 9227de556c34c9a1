"""Container types torch code returns, made into JAX pytrees.

`torch.return_types.*` (what `torch.sort`, `torch.max(dim=...)` return) are registered
with `jax.tree_util` on import; dataclasses and Hugging Face `ModelOutput` subclasses are
registered the first time they cross the bridge (`ensure_registered`), so `jax.jit` can
return them.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
from typing import Any, Callable

import jax
import torch
import torch.return_types

_registered: set[type] = set()
_lock = threading.Lock()


def is_structseq(x) -> bool:
    """Whether `x` is a `torch.return_types.*` value."""
    return isinstance(x, tuple) and type(x).__module__ == "torch.return_types"


def is_model_output(x) -> bool:
    """Whether `x` is a Hugging Face `ModelOutput` (checked without importing transformers)."""
    return any(c.__name__ == "ModelOutput" for c in type(x).__mro__[1:]) and isinstance(x, dict)


def is_namedtuple(x) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def map_container(fn: Callable[[Any], Any], tree: Any) -> Any:
    """Apply `fn` to each child of the container `tree`, rebuilding the same type."""
    if isinstance(tree, list):
        return [fn(x) for x in tree]
    if isinstance(tree, tuple):
        if is_structseq(tree):
            return type(tree)([fn(x) for x in tree])
        if is_namedtuple(tree):
            return type(tree)(*[fn(x) for x in tree])
        return tuple(fn(x) for x in tree)
    if is_model_output(tree):
        return type(tree)(**{k: fn(v) for k, v in tree.items()})
    if isinstance(tree, dict):
        out = {k: fn(v) for k, v in tree.items()}
        return out if type(tree) is dict else type(tree)(out)
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        new = copy.copy(tree)
        for f in dataclasses.fields(tree):
            object.__setattr__(new, f.name, fn(getattr(tree, f.name)))
        return new
    raise TypeError(f"not a container: {type(tree)}")


def _register(cls: type, flatten, unflatten) -> None:
    with _lock:
        if cls in _registered:
            return
        try:
            jax.tree_util.register_pytree_node(cls, flatten, unflatten)
        except ValueError:  # already registered by someone else
            pass
        _registered.add(cls)


def _register_structseq(cls: type) -> None:
    _register(cls, lambda s: (tuple(s), None), lambda _, children: cls(list(children)))


def _register_model_output(cls: type) -> None:
    def flatten(m):
        keys = tuple(m.keys())
        return tuple(m[k] for k in keys), keys

    def unflatten(keys, children):
        return cls(**dict(zip(keys, children)))

    _register(cls, flatten, unflatten)


def _register_dataclass(cls: type) -> None:
    names = tuple(f.name for f in dataclasses.fields(cls))

    def flatten(d):
        return tuple(getattr(d, n) for n in names), None

    def unflatten(_, children):
        obj = object.__new__(cls)
        for n, c in zip(names, children):
            object.__setattr__(obj, n, c)
        return obj

    _register(cls, flatten, unflatten)


def ensure_registered(tree: Any) -> None:
    """Register, with `jax.tree_util`, every dataclass / ModelOutput type found in `tree`."""
    cls = type(tree)
    if isinstance(tree, (list, tuple)):
        if is_structseq(tree) and cls not in _registered:
            _register_structseq(cls)
        for x in tree:
            ensure_registered(x)
    elif isinstance(tree, dict):
        if is_model_output(tree) and cls not in _registered:
            _register_model_output(cls)
        for x in tree.values():
            ensure_registered(x)
    elif dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        if cls not in _registered and cls not in jax.tree_util.default_registry.__class__.__dict__:
            try:
                jax.tree_util.tree_flatten(tree)  # already a pytree node (e.g. eqx.Module)?
                leaves = jax.tree_util.tree_leaves(tree)
                is_leaf = len(leaves) == 1 and leaves[0] is tree
            except Exception:
                is_leaf = True
            if is_leaf:
                _register_dataclass(cls)
        for f in dataclasses.fields(tree):
            ensure_registered(getattr(tree, f.name))


for _name in dir(torch.return_types):
    _cls = getattr(torch.return_types, _name)
    if isinstance(_cls, type) and issubclass(_cls, tuple) and _cls.__module__ == "torch.return_types":
        _register_structseq(_cls)
