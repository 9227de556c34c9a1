"""An op's call as the executors see it: its record (`OpCall`) and the one keyer of its arguments.

`signature` is the one place that splits a call's arguments into dynamic inputs (arrays, and
Python floats where they are traced) and a hashable static part; `bind` rebuilds the call from
the dynamic inputs. Both executors (`_eager`, `_lazy`; the interface and the choice between them:
`_executor`) key their caches with it.

Example:
    ```python
    op = OpCall(aten.add.Tensor, add_lowering, "aten::add.Tensor")
    key, dyn, plan = signature([x, 2, 0.5], {}, op.floats)   # dyn == [x, 0.5]
    bind(op.lowering, plan)(*dyn)                              # == add_lowering(x, 2, 0.5)
    ```
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

_ArrayImpl = type(jax.numpy.zeros(()))
_Array = jax.Array
# exact types of the dynamic inputs (`_lazy` adds its `LazyArray`); other `jax.Array`s
# (tracers, subclasses) are dynamic too, found by `isinstance` on the general path
ARRAY_TYPES: set[type] = {_ArrayImpl}


class OpCall:
    """One op's lowering and what the executors need to know about it, built once per op.

    **Arguments:**
    - `func`: the `OpOverload` (for errors, keys and metrics);
    - `lowering`: its JAX lowering (arrays in, arrays out);
    - `name`: `func.name()` (a JAX named scope, a node's name);
    - `random`: the lowering takes a `key=` (drawn per call);
    - `data_dependent`: its output shape depends on values (runs on concrete values);
    - `floats`: whether Python floats are traced inputs (None: when an argument is an array).
    """

    __slots__ = (
        "func",
        "lowering",
        "name",
        "random",
        "data_dependent",
        "floats",
        "floats_static",
        "plain",
        "jits",
        "kinds",
    )

    def __init__(
        self,
        func: Any,
        lowering: Callable,
        name: str,
        random: bool = False,
        data_dependent: bool = False,
        floats: bool | None = None,
    ):
        self.func, self.lowering, self.name = func, lowering, name
        self.random, self.data_dependent, self.floats = random, data_dependent, floats
        self.plain = not (random or data_dependent)  # neither: the executors' common case
        self.floats_static = False  # lazy: set once the lowering is seen to branch on a Python float
        self.jits: dict = {}  # eager: signature key -> jitted function (or NOT_JITTABLE)
        self.kinds: dict = {}  # lazy: signature key -> (node kind id, function)

    def __repr__(self) -> str:
        return f"OpCall({self.name})"


# ---- the argument keyer ------------------------------------------------------------------------
class _Slot:
    """Marks where a dynamic input goes in the static skeleton of the arguments."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<array>"


SLOT = _Slot()
_SIMPLE = frozenset({int, bool, float, type(None), str})
_INT_TYPES = frozenset({int, bool})
_FLOAT_TYPES = frozenset({float})
_DYN_LIST = object()  # in a flat plan: (_DYN_LIST, list or tuple, length): a list of dynamic inputs
_ALL_ARRAYS = [((None,) * n, ()) for n in range(8)]  # the key of n array arguments
_GENERAL = object()  # a plan's tag: (_GENERAL, skeleton of args, skeleton of kwargs)


def signature(jargs: list, jkwargs: dict, floats: bool | None) -> tuple[Any, list, Any] | None:
    """`(key, dyn, plan)` of a call: `dyn` its dynamic inputs, `key` (hashable) the rest, and
    `plan` how `bind` rebuilds the call from `dyn`. None when a static argument is unhashable.

    Arrays are dynamic. Python floats are dynamic when `floats` is true, or when it is None
    and an argument is an array (a factory's floats stay static: their type decides the
    result dtype). Static floats are keyed by their bits (`0.0` and `-0.0` differ), lists
    of ints by value and element types (`[1, 0]` and `[True, False]` differ).

    **Example:**
        ```python
        key, dyn, plan = signature([x, 2, 0.5], {}, None)   # dyn == [x, 0.5]
        fn = bind(lowering, plan); fn(*dyn) == lowering(x, 2, 0.5)
        ```
    """
    arrays_t = ARRAY_TYPES
    if not jkwargs:  # the commonest call, all arrays (`a + b`, `mm(a, b)`): its key is known
        for a in jargs:
            if type(a) not in arrays_t:
                break
        else:
            n = len(jargs)
            key = _ALL_ARRAYS[n] if n < 8 else ((None,) * n, ())
            return key, jargs, key
    allow_floats = floats is not False
    arrays = dyn_floats = False
    keys: list = []  # per argument: None (a dynamic input), (type, key) of a static one, or a dynamic list
    dyn: list = []
    kwnames = tuple(jkwargs) if jkwargs else ()
    for a in (*jargs, *jkwargs.values()) if kwnames else jargs:
        t = type(a)
        if t in arrays_t:
            arrays = True
            dyn.append(a)
            keys.append(None)
        elif t is float:
            if allow_floats:
                dyn_floats = True
                dyn.append(a)
                keys.append(None)
            else:
                keys.append((float, a.hex()))
        elif t in _SIMPLE:
            keys.append((t, a))
        elif t is list or t is tuple:
            types = set(map(type, a))
            if types <= _INT_TYPES:
                keys.append((t, (tuple(a), tuple(map(type, a)))))
            elif types <= arrays_t or (allow_floats and types == _FLOAT_TYPES):  # (a foreach op's lists)
                arrays = arrays or bool(types) and types != _FLOAT_TYPES
                dyn_floats = dyn_floats or types == _FLOAT_TYPES
                dyn.extend(a)
                keys.append((_DYN_LIST, t, len(a)))
            else:
                return _general(jargs, jkwargs, floats)
        elif isinstance(a, _Array):  # a tracer, another array type: the general path decides
            return _general(jargs, jkwargs, floats)
        else:
            try:
                hash(a)  # (a dtype, a device, a layout: static)
            except TypeError:
                return None
            keys.append((t, a))
    if dyn_floats and not arrays and not floats:
        return _general(jargs, jkwargs, False)  # (a factory: its floats stay static)
    key = (tuple(keys), kwnames)
    return key, dyn, key


def _general(jargs: list, jkwargs: dict, floats: bool | None):
    """`signature` for nested arguments and other objects: a recursive walk."""
    if floats is None:
        floats = _has_array(jargs) or _has_array(jkwargs.values())
    dyn: list = []
    try:
        key_a, skel_a = _split(tuple(jargs), dyn, floats)
        key_k, skel_k = _split(tuple(jkwargs.items()), dyn, floats) if jkwargs else ((), ())
        hash(key_a), hash(key_k)
    except TypeError:
        return None
    return (_GENERAL, key_a, key_k), dyn, (_GENERAL, skel_a, skel_k)


def _has_array(xs) -> bool:
    for x in xs:
        if type(x) in ARRAY_TYPES or isinstance(x, _Array):
            return True
        if type(x) in (list, tuple) and _has_array(x):
            return True
    return False


def _split(x, dyn: list, floats: bool):
    """(hashable key part, skeleton) of one argument; dynamic inputs go to `dyn`."""
    t = type(x)
    if t in ARRAY_TYPES or isinstance(x, _Array) or (floats and t is float):
        dyn.append(x)
        return SLOT, SLOT
    if t is list or t is tuple:
        parts = [_split(y, dyn, floats) for y in x]
        return (t, tuple(p[0] for p in parts)), t(p[1] for p in parts)
    hash(x)
    return (t, x.hex() if t is float else x), x


def _fill(skel, it):
    if skel is SLOT:
        return next(it)
    if type(skel) is list or type(skel) is tuple:
        return type(skel)(_fill(s, it) for s in skel)
    return skel


def _static_value(k: tuple):
    """The argument a flat key `(type, key)` stands for."""
    t, v = k
    if t is float:
        return float.fromhex(v)
    if t is list or t is tuple:
        return t(v[0])
    return v


def bind(lowering: Callable, plan, wrap: Callable | None = None) -> Callable:
    """`fn(*dyn)` calling `lowering` with the call that `signature` split into `plan`.

    `wrap` (optional) is a context manager factory entered around the call (the matmul
    precision)."""
    if plan[0] is _GENERAL:
        _, skel_a, skel_k = plan

        def general(*dyn):
            it = iter(dyn)
            args = _fill(skel_a, it)
            kwargs = dict(_fill(skel_k, it)) if skel_k else {}
            if wrap is None:
                return lowering(*args, **kwargs)
            with wrap():
                return lowering(*args, **kwargs)

        return general
    keys, kwnames = plan
    nk = len(kwnames)
    statics = [None if k is None or k[0] is _DYN_LIST else _static_value(k) for k in keys]
    lists = [k[1] if k is not None and k[0] is _DYN_LIST else None for k in keys]
    sizes = [k[2] if k is not None and k[0] is _DYN_LIST else 0 for k in keys]
    simple = all(k is None or k[0] is not _DYN_LIST for k in keys)
    sig = keys

    def flat(*arrays):
        if simple:
            it = iter(arrays)
            vals = [next(it) if s is None else v for s, v in zip(sig, statics)]
        else:
            vals, i = [], 0
            for s, v, lt, n in zip(sig, statics, lists, sizes):
                if lt is not None:
                    vals.append(lt(arrays[i : i + n]))
                    i += n
                elif s is None:
                    vals.append(arrays[i])
                    i += 1
                else:
                    vals.append(v)
        if wrap is None:
            return lowering(*vals[: len(vals) - nk], **dict(zip(kwnames, vals[len(vals) - nk :])))
        with wrap():
            return lowering(*vals[: len(vals) - nk], **dict(zip(kwnames, vals[len(vals) - nk :])))

    return flat
