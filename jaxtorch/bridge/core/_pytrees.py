"""The one registry of containers: every foreign type is registered once, here, and walked by it.

jaxtorch walks nested values with `jax.tree_util` (the same registry `jax.jit`, `jax.grad`
and `jax.export` use), with torch tensors as leaves. `register` puts a type into JAX's
registry and, kept in step, into `torch.utils._pytree`, so one registration serves every
direction: a container of `jax.Array`s into and out of `jax.jit`, the same container of
torch tensors through `jaxtorch.to_jax` / `torch_view` / `jaxtorch.jit`.

Registered automatically, the first time a value crosses the bridge (`walk` notices
unknown types while it flattens):
- `torch.return_types.*` (`torch.sort`, `torch.max(dim=...)`), by `install` (`import jaxtorch`);
- dataclasses and Hugging Face `ModelOutput`s, field by field;
- every Hugging Face `transformers.cache_utils` cache and cache layer (`DynamicCache`,
  `StaticCache`, sliding-window, hybrid/linear-attention, `EncoderDecoderCache`,
  `QuantizedCache` layers, ...), attribute by attribute (`register_object`): attributes
  holding tensors (directly or in lists, tuples, dicts, nested caches) are children and
  are traced; every other attribute (max length, layer count, Python counters, flags,
  devices, dtypes) is static metadata in the treedef.

A type of your own: a registration made with `jax.tree_util.register_pytree_node` works
with every jaxtorch conversion, because jaxtorch walks JAX's registry; flatten and
unflatten just move children in and out and must not care whether they are torch tensors
or `jax.Array`s. `register_object(MyState)` does it for plain attribute-holding classes
(and registers with torch's pytree as well).

Example:
    ```python
    cache = jaxtorch.to_jax(StaticCache(config=cfg, max_cache_len=64))  # arrays inside
    out = jax.jit(fn)(params, ids, cache=cache)        # the cache goes in and out of jax.jit
    jaxtorch.register_object(MyState)                   # a class of your own, one line
    ```
"""

from __future__ import annotations

import dataclasses
import pickle
import threading
import weakref
from collections.abc import Callable
from typing import Any

import jax
import torch
import torch.return_types

from ..._compat import Tracer, torch_pytree

_registered: set[type] = set()
_not_nodes: set[type] = set()  # types seen and found not to be containers (fast path)
_lock = threading.RLock()


# ---- what a value is ----------------------------------------------------------------------
def is_structseq(x) -> bool:
    """Whether `x` is a `torch.return_types.*` value."""
    return isinstance(x, tuple) and type(x).__module__ == "torch.return_types"


def is_model_output(x) -> bool:
    """Whether `x` is a Hugging Face `ModelOutput` (checked without importing transformers)."""
    return any(c.__name__ == "ModelOutput" for c in type(x).__mro__[1:]) and isinstance(x, dict)


_HF_CACHE_BASES = {"Cache", "CacheLayerMixin", "LinearAttentionCacheLayerMixin", "DummyLayer"}


def is_hf_cache_type(cls: type) -> bool:
    """Whether `cls` is a Hugging Face cache or cache layer (checked without importing transformers)."""
    return any(c.__name__ in _HF_CACHE_BASES and c.__module__ == "transformers.cache_utils" for c in cls.__mro__)


def _is_array(x) -> bool:
    return isinstance(x, (torch.Tensor, jax.Array, Tracer))


# ---- registration -------------------------------------------------------------------------
def register(
    cls: type,
    flatten: Callable,
    unflatten: Callable,
    flatten_with_keys: Callable | None = None,
    *,
    torch_too: bool = True,
) -> None:
    """Register `cls` with JAX's pytree registry and torch's, where it is not registered yet.

    **Arguments:**
    - `cls`: the container type.
    - `flatten`: `obj -> (children, aux)`; `aux` is hashable static metadata.
    - `unflatten`: `(aux, children) -> obj`.
    - `flatten_with_keys`: optional `obj -> ([(key, child), ...], aux)` for readable key paths.
    - `torch_too`: also register with `torch.utils._pytree` (off for types torch walks itself).

    **Returns:** None.

    **Example:**
        ```python
        register(Pair, lambda p: ((p.a, p.b), None), lambda _, c: Pair(*c))
        ```
    """
    with _lock:
        if cls in _registered:
            return
        try:
            if flatten_with_keys is not None:
                jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)
            else:
                jax.tree_util.register_pytree_node(cls, flatten, unflatten)
        except ValueError:  # already registered with JAX (by the user, or a library): theirs wins
            pass
        if torch_too and cls not in torch_pytree.SUPPORTED_NODES:
            try:
                torch_pytree.register_pytree_node(
                    cls,
                    lambda o: _as_list(flatten(o)),
                    lambda children, aux: unflatten(aux, children),
                    serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
                )
            except (ValueError, TypeError):
                pass
        _registered.add(cls)


def _as_list(flat):
    children, aux = flat
    return list(children), aux


def _register_structseq(cls: type) -> None:
    register(cls, lambda s: (tuple(s), None), lambda _, children: cls(list(children)), torch_too=False)


def _register_model_output(cls: type) -> None:
    def flatten(m):
        keys = tuple(m.keys())
        return tuple(m[k] for k in keys), keys

    def flatten_with_keys(m):
        keys = tuple(m.keys())
        return tuple((jax.tree_util.DictKey(k), m[k]) for k in keys), keys

    def unflatten(keys, children):
        return cls(**dict(zip(keys, children)))

    register(cls, flatten, unflatten, flatten_with_keys)


def _register_dataclass(cls: type) -> None:
    names = tuple(f.name for f in dataclasses.fields(cls))

    def flatten(d):
        return tuple(getattr(d, n) for n in names), None

    def flatten_with_keys(d):
        return tuple((jax.tree_util.GetAttrKey(n), getattr(d, n)) for n in names), None

    def unflatten(_, children):
        obj: Any = object.__new__(cls)
        for n, c in zip(names, children):
            object.__setattr__(obj, n, c)
        return obj

    register(cls, flatten, unflatten, flatten_with_keys)


# ---- attribute-holding objects (Hugging Face caches, your own state classes) -----------------
class _Static:
    """Static attributes of an object: compared by value, hashed through a frozen copy."""

    __slots__ = ("items", "_hash")

    def __init__(self, items: tuple):
        self.items = items
        self._hash: int | None = None

    def __reduce__(self):
        return _Static, (self.items,)

    def __eq__(self, other):
        if not isinstance(other, _Static) or len(self.items) != len(other.items):
            return False
        for (ka, a), (kb, b) in zip(self.items, other.items):
            if ka != kb or not _same(a, b):
                return False
        return True

    def __hash__(self):
        if self._hash is None:
            self._hash = hash(tuple((k, _frozen(v)) for k, v in self.items))
        return self._hash

    def __repr__(self):
        return "{" + ", ".join(f"{k}={v!r}" for k, v in self.items) + "}"


def _same(a, b) -> bool:
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    try:
        return bool(a == b)
    except Exception:
        return False


def _frozen(v):
    if isinstance(v, dict):
        return tuple((k, _frozen(x)) for k, x in v.items())
    if isinstance(v, (list, tuple)):
        return tuple(_frozen(x) for x in v)
    if isinstance(v, set):
        return frozenset(v)
    try:
        hash(v)
        return v
    except TypeError:
        return id(v)


def holds_arrays(v) -> bool:
    """Whether `v` is an array/tensor or a container (or registered object) holding one."""
    if _is_array(v):
        return True
    if isinstance(v, (list, tuple)):
        return any(holds_arrays(x) for x in v)
    if isinstance(v, dict):
        return any(holds_arrays(x) for x in v.values())
    if type(v) in _registered:
        return True
    return False


def object_split(obj) -> tuple[tuple[str, ...], tuple, _Static]:
    """An object's attributes split into (child names, children, static attributes).

    Children are the attributes holding arrays or tensors (directly or in containers),
    plus, for an object `object_rebuild` made, the attributes that were children then
    (so a tree of shapes or shardings flattens like the tree of arrays it came from);
    the rest is static metadata.
    """
    entry = _rebuilt.get(id(obj))
    was = entry[1] if entry is not None and entry[0]() is obj else ()
    names, children, static = [], [], []
    for k, v in vars(obj).items():
        if k in was or holds_arrays(v):
            names.append(k)
            children.append(v)
        else:
            static.append((k, v))
    return tuple(names), tuple(children), _Static(tuple(static))


_rebuilt: dict[int, tuple] = {}  # id(obj) -> (weakref to obj, its child names when rebuilt)


def object_rebuild(cls: type, names, children, static: _Static):
    """The inverse of `object_split`: a new `cls` instance with those attributes (no `__init__`)."""
    obj: Any = object.__new__(cls)
    d = obj.__dict__
    d.update(static.items)
    d.update(zip(names, children))
    if names:
        key = id(obj)

        def forget(_: object, key: int = key) -> None:
            _rebuilt.pop(key, None)

        _rebuilt[key] = (weakref.ref(obj, forget), frozenset(names))
    return obj


def register_object(cls: type) -> type:
    """Make the attribute-holding class `cls` a pytree (JAX's and torch's): attributes
    holding tensors/arrays are children, the others static metadata in the treedef.

    Hugging Face caches are registered this way automatically.

    **Arguments:**
    - `cls`: a class whose instances keep their state in `__dict__`.

    **Returns:** `cls` (so it works as a class decorator).

    **Example:**
        ```python
        @jaxtorch.register_object
        class KV:
            def __init__(self, k, v, length: int):
                self.k, self.v, self.length = k, v, length
        ```
    """

    def flatten(obj):
        names, children, static = object_split(obj)
        return children, (cls, names, static)

    def flatten_with_keys(obj):
        names, children, static = object_split(obj)
        return tuple((jax.tree_util.GetAttrKey(n), c) for n, c in zip(names, children)), (cls, names, static)

    def unflatten(aux, children):
        _, names, static = aux
        return object_rebuild(cls, names, tuple(children), static)

    register(cls, flatten, unflatten, flatten_with_keys)
    try:  # `jax.export`ed functions taking or returning it serialize (the metadata is pickled)
        jax.export.register_pytree_node_serialization(
            cls,
            serialized_name=f"{cls.__module__}.{cls.__qualname__}",
            serialize_auxdata=pickle.dumps,
            deserialize_auxdata=pickle.loads,
        )
    except ValueError:  # already registered
        pass
    return cls


def _register_hf_caches(seen: type) -> None:
    """Register `seen` and every cache / cache-layer class transformers has defined so far."""
    import transformers.cache_utils as cu

    roots = ("Cache", "CacheLayerMixin", "LinearAttentionCacheLayerMixin", "DummyLayer")  # those this version has
    stack = [c for c in (getattr(cu, name, None) for name in roots) if c is not None] + [seen]
    while stack:
        cls = stack.pop()
        if cls not in _registered:
            register_object(cls)
        stack.extend(cls.__subclasses__())


def ensure_node(x: Any) -> bool:
    """Register `type(x)` if it is a container jaxtorch knows how to walk; `False` always.

    Used as the `is_leaf` of every jaxtorch walk: unknown dataclasses, `ModelOutput`s and
    Hugging Face caches become registered nodes the first time they are seen.
    """
    cls = type(x)
    if cls in _registered or cls in _not_nodes or _is_array(x):
        return False
    with _lock:
        if is_structseq(x):
            _register_structseq(cls)
        elif is_model_output(x):
            _register_model_output(cls)
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            if _is_jax_leaf(x):
                _register_dataclass(cls)
            else:
                _not_nodes.add(cls)  # JAX already knows it (e.g. an equinox Module)
        elif is_hf_cache_type(cls):
            _register_hf_caches(cls)
        else:
            _not_nodes.add(cls)
    return False


def _is_jax_leaf(x) -> bool:
    try:
        leaves = jax.tree_util.tree_leaves(x)
    except Exception:
        return True
    return len(leaves) == 1 and leaves[0] is x


def _leaf(x) -> bool:
    return _is_array(x) or ensure_node(x)


def flatten(tree: Any) -> tuple[list, Any]:
    """`jax.tree_util.tree_flatten` with torch tensors as leaves and unknown containers registered.

    **Returns:** `(leaves, treedef)`; `jax.tree_util.tree_unflatten(treedef, leaves)` rebuilds.
    """
    return jax.tree_util.tree_flatten(tree, is_leaf=_leaf)


def flatten_with_path(tree: Any) -> tuple[list, Any]:
    """`flatten` with each leaf's key path (for error messages)."""
    return jax.tree_util.tree_flatten_with_path(tree, is_leaf=_leaf)


def tree_map(fn: Callable[[Any], Any], tree: Any) -> Any:
    """Map `fn` over the leaves of `tree` (torch tensors and arrays are leaves), keeping every
    container type; `None` stays `None`.

    **Example:**
        ```python
        tree_map(lambda x: x * 2 if isinstance(x, torch.Tensor) else x, {"a": [t, 3]})
        ```
    """
    leaves, treedef = flatten(tree)
    return jax.tree_util.tree_unflatten(treedef, [fn(x) for x in leaves])


# ---- Hugging Face caches are registered as soon as transformers defines them ---------------
import importlib.abc as _abc  # noqa: E402
import importlib.util as _util  # noqa: E402
import sys as _sys  # noqa: E402

_CACHE_MODULE = "transformers.cache_utils"


class _AfterImport(_abc.MetaPathFinder, _abc.Loader):
    """Runs `_register_hf_caches` right after `transformers.cache_utils` is imported."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _CACHE_MODULE:
            return None
        _sys.meta_path.remove(self)  # find the real spec with the other finders
        try:
            spec = _util.find_spec(fullname)
        finally:
            _sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        self._loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _sys.meta_path[:] = [f for f in _sys.meta_path if f is not self]
        _register_hf_caches(module.Cache)


def install() -> None:
    """Register torch's own containers in JAX's pytree registry, and Hugging Face's caches as
    soon as transformers defines them (idempotent; `jaxtorch._install` calls it).

    `torch.Size` (a shape returned by torch code, e.g. `torch.broadcast_shapes`) has its ints as
    children, as torch's own pytree has it; each `torch.return_types` structseq is a node; and
    `transformers.cache_utils`' caches are registered now if it is imported, else by a finder put
    first in `sys.meta_path` that registers them right after its import (and removes itself).

    **Example:** `install(); jax.tree_util.tree_leaves(torch.Size([2, 3]))` is `[2, 3]`.
    """
    register(torch.Size, lambda s: (tuple(s), None), lambda _, c: torch.Size(c), torch_too=False)  # (once)
    for name in dir(torch.return_types):
        cls = getattr(torch.return_types, name)
        if isinstance(cls, type) and issubclass(cls, tuple) and cls.__module__ == "torch.return_types":
            _register_structseq(cls)
    if _CACHE_MODULE in _sys.modules:  # imported before jaxtorch: register its caches now
        _register_hf_caches(_sys.modules[_CACHE_MODULE].Cache)
    elif not any(isinstance(f, _AfterImport) for f in _sys.meta_path):
        _sys.meta_path.insert(0, _AfterImport())
