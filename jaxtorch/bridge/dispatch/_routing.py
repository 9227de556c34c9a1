"""The routing table: how each ATen `OpOverload` runs on the `jax` device, decided once.

`route(op)` returns a `Route`: one record per op carrying its route `kind` and everything the
decision read (its lowering, flags, view/mutation schema facts, functional sibling,
decomposition, foreach one-call lowering). The interpreter builds each op's runner from it
(`_interpreter._runner_for`), and `jaxtorch.coverage` reads it to say whether an op is
lowered, decomposed or missing: one classification, read by both.

The kinds, in the order they are tried:

| kind                 | how the op runs                                                         |
|----------------------|-------------------------------------------------------------------------|
| `special`            | the bridge's own implementation (device copies, `.item()`, aliasing)    |
| `foreach`            | one call of the per-element lowering over the lists (`_foreach`)        |
| `view`               | its lowering; the result is a view of the first argument                |
| `mutating`           | its lowering; the results are written into the arguments it mutates      |
| `functional`         | its lowering                                                            |
| `via_sibling`        | in-place / `out=`: the functional sibling's lowering, then write back   |
| `decomposed`         | PyTorch's decomposition, on `JaxTensor`s                                 |
| `foreach_loop`       | the per-tensor op once per list element                                 |
| `sibling_decomposed` | in-place / `out=`: the functional sibling's decomposition, write back   |
| `unsupported`        | raises `UnsupportedOpError`                                              |

Routes are cached per op and forgotten whenever the registry changes (it notifies its
subscribers, see `jaxtorch.bridge.core._registry.subscribe`).

Example:
    ```python
    r = route(torch.ops.aten.add_.Tensor)
    r.kind, r.sibling            # (Kind.VIA_SIBLING, aten.add.Tensor)
    ```
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any

import torch

from ..._compat import decomposition_table, has_kernel_for_dispatch_key
from ..core import _registry as registry
from . import _foreach as foreach

aten = torch.ops.aten
Mutated = tuple[tuple[int, str, bool], ...]

# Ops the bridge itself implements (device moves, copies, scalars, aliasing); the
# implementations live in `_interpreter._SPECIAL`, keyed by exactly these overloads.
SPECIAL_OPS: frozenset = frozenset(
    {
        aten._to_copy.default,
        aten.copy_.default,
        aten._local_scalar_dense.default,
        aten.lift_fresh.default,
        aten.lift_fresh_copy.default,
        aten.detach.default,
        aten.resize_.default,
        aten.resize.default,
        aten.alias.default,
    }
)


class Kind(enum.StrEnum):
    """How an op runs (see the module docstring's table, in the order the kinds are tried)."""

    SPECIAL = "special"
    FOREACH = "foreach"
    VIEW = "view"
    MUTATING = "mutating"
    FUNCTIONAL = "functional"
    VIA_SIBLING = "via_sibling"
    DECOMPOSED = "decomposed"
    FOREACH_LOOP = "foreach_loop"
    SIBLING_DECOMPOSED = "sibling_decomposed"
    UNSUPPORTED = "unsupported"


@dataclasses.dataclass(frozen=True, slots=True)
class Route:
    """Everything dispatch and coverage need to know about one op, computed once.

    **Fields:**
    - `op`: the overload; `kind`: how it runs (`Kind`).
    - `lowering`: its registered lowering (`registry.lookup(op)`), or None.
    - `random`, `data_dependent`, `host_inputs`: its registry flags.
    - `view`: its first result aliases an argument (read-only alias in the schema).
    - `mutated`: (position, name, keyword-only) of each argument it writes.
    - `sibling`: for an op that writes its arguments, the functional overload it derives from.
    - `decomposition`: PyTorch's decomposition of `op` itself when the routing reached that
      step (None for ops with a lowering, the bridge's own ops and `via_sibling` ops).
    - `element`: for a foreach op, the per-element overload (`_foreach_add_.List` -> `add.Tensor`).
    - `multi`: for `Kind.FOREACH`, the lowering over the lists; `fallback`: the route taken
      instead when the lists are not all `JaxTensor`s (or alias each other).

    **Example:** `route(aten.transpose.int).kind` is `Kind.VIEW`.
    """

    op: Any
    kind: Kind
    lowering: Callable | None = None
    random: bool = False
    data_dependent: bool = False
    host_inputs: bool = False
    view: bool = False
    mutated: Mutated = ()
    sibling: Any = None
    decomposition: Callable | None = None
    element: Any = None
    multi: Callable | None = None
    fallback: Route | None = None


_ROUTES: dict[Any, Route] = {}


def route(op) -> Route:
    """The route of `op`, computed on first use and cached until the registry changes.

    **Example:** `route(torch.ops.aten.add.Tensor).kind` is `Kind.FUNCTIONAL`.
    """
    r = _ROUTES.get(op)
    if r is None:
        r = _ROUTES[op] = _classify(op)
    return r


def clear() -> None:
    """Forget every cached route (subscribed to the registry below)."""
    _ROUTES.clear()


# ---- the classification ------------------------------------------------------------------------
def _classify(op) -> Route:
    """`op`'s route: the one-call foreach lowering when it has one, else `_op_route`."""
    base = _op_route(op)
    if base.element is not None and base.kind is not Kind.SPECIAL and base.lowering is None:
        multi = foreach.lowering_for(op)
        if multi is not None:
            return dataclasses.replace(base, kind=Kind.FOREACH, multi=multi, fallback=base)
    return base


def _op_route(op) -> Route:
    """The route of `op` as one op (for a foreach op: ignoring the one-call lowering)."""
    mutated = tuple(mutated_args(op))
    element = foreach.per_element(op) if _is_foreach(op) else None
    facts = Route(
        op=op,
        kind=Kind.UNSUPPORTED,
        lowering=registry.lookup(op),
        random=registry.is_flagged(op, registry.RANDOM),
        data_dependent=registry.is_flagged(op, registry.DATA_DEPENDENT),
        host_inputs=registry.is_flagged(op, registry.HOST_INPUTS),
        view=is_view_op(op),
        mutated=mutated,
        sibling=_sibling_or_none(op) if mutated else None,
        element=element[0] if element is not None else None,
    )
    return _decided(facts)


def _decided(r: Route) -> Route:
    """`r` with the first kind that applies, in the table's order. Decompositions are looked up
    only when reached (some overloads torch lists, such as `aten.ldexp.default`, have no
    dispatcher entry to ask)."""
    if r.op in SPECIAL_OPS:
        return dataclasses.replace(r, kind=Kind.SPECIAL)
    if r.lowering is not None:
        kind = Kind.VIEW if r.view else Kind.MUTATING if r.mutated else Kind.FUNCTIONAL
        return dataclasses.replace(r, kind=kind)
    if r.sibling is not None and registry.lookup(r.sibling) is not None:
        return dataclasses.replace(r, kind=Kind.VIA_SIBLING)
    r = dataclasses.replace(r, decomposition=decomposition(r.op))
    if r.decomposition is not None:
        return dataclasses.replace(r, kind=Kind.DECOMPOSED)
    if _is_foreach(r.op) and per_tensor_packet(r.op) is not None:
        return dataclasses.replace(r, kind=Kind.FOREACH_LOOP)
    if r.sibling is not None and decomposition(r.sibling) is not None:
        return dataclasses.replace(r, kind=Kind.SIBLING_DECOMPOSED)
    return r


def _sibling_or_none(op):
    """`functional_sibling(op)`, None for a schema it cannot read."""
    try:
        return functional_sibling(op)
    except Exception:  # (odd schemas: no functional sibling; none among torch's own ops)
        return None


def _is_foreach(op) -> bool:
    return op._schema.name.startswith("aten::_foreach_")


# ---- schema helpers ----------------------------------------------------------------------------
def is_view_op(op) -> bool:
    """Whether `op`'s first result aliases an argument without writing it.

    **Example:** `is_view_op(aten.transpose.int)` is True; `is_view_op(aten.add_.Tensor)` is False.
    """
    rets = op._schema.returns
    if not rets:
        return False
    ai = rets[0].alias_info
    return ai is not None and not ai.is_write


def mutated_args(op) -> list[tuple[int, str, bool]]:
    """(position, name, kwarg_only) of every argument the op writes to.

    **Example:** `mutated_args(aten.add_.Tensor)` is `[(0, "self", False)]`.
    """
    out = []
    for i, a in enumerate(op._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            out.append((i, a.name, a.kwarg_only))
    return out


def functional_sibling(op):
    """`aten.add_.Tensor` -> `aten.add.Tensor`; `aten.add.out` -> `aten.add.Tensor` (None if none).

    A factory's `out=` overload maps to the factory (`arange.start_out` -> `arange.start_step`),
    whose extra tensor options the out tensor fixes.
    """
    schema = op._schema
    mutated = {m[1] for m in mutated_args(op)}
    name = schema.name.split("::")[1]
    ns = getattr(torch.ops, schema.name.split("::")[0])
    if name.endswith("_") and not name.endswith("__"):
        packet = getattr(ns, name[:-1], None)
        if packet is None:
            return None
        overload = schema.overload_name or "default"
        if overload in packet.overloads():
            return getattr(packet, overload)
        names = [a.name for a in schema.arguments]  # e.g. transpose_.default ~ transpose.int
        for ov in packet.overloads():
            cand = getattr(packet, ov)
            if [a.name for a in cand._schema.arguments] == names:
                return cand
        return None
    kept = [a for a in schema.arguments if a.name not in mutated]
    wanted = [a.name for a in kept]
    types = [str(a.type) for a in kept]
    packet = op.overloadpacket
    by_name = factory = None
    for ov in packet.overloads():
        cand = getattr(packet, ov)
        if cand is op or mutated_args(cand):
            continue
        args = cand._schema.arguments
        names = [a.name for a in args]
        same_types = [str(a.type) for a in args[: len(types)]] == types
        if names == wanted:
            if same_types:
                return cand
            by_name = by_name or cand
        elif _factory_of(names, wanted) and (factory is None or same_types):
            factory = cand  # (`linspace.out` -> `linspace.default`, not `linspace.Tensor_Tensor`)
    return by_name or factory


FACTORY_OPTIONS = frozenset({"dtype", "layout", "device", "pin_memory"})


def _factory_of(names: list[str], wanted: list[str]) -> bool:
    """Whether a factory overload with arguments `names` is the functional form of an `out=`
    overload with arguments `wanted` (out dropped): the same arguments, then only the tensor
    options the out tensor fixes (`arange.start_out` -> `arange.start_step`)."""
    return names[: len(wanted)] == wanted and "dtype" in names and set(names[len(wanted) :]) <= FACTORY_OPTIONS


def is_factory_sibling(op, sibling) -> bool:
    """Whether `sibling` is the factory form of the `out=` overload `op` (it takes a `dtype`
    that the out tensor gives; see `functional_sibling`).

    **Example:** `is_factory_sibling(aten.arange.start_out, aten.arange.start_step)` is True.
    """
    names = {a.name for a in op._schema.arguments}
    return any(a.name == "dtype" for a in sibling._schema.arguments) and "dtype" not in names


def decomposition(op) -> Callable | None:
    """PyTorch's decomposition of `op`: its `decomposition_table` entry, else its
    CompositeImplicitAutograd kernel (`op.decompose`), else None.

    **Example:** `decomposition(aten.addcmul.default)` is torch's `addcmul` reference.
    """
    d = decomposition_table.get(op)
    if d is not None:
        return d
    if has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd"):
        return op.decompose
    return None


def per_tensor_packet(op):
    """For a foreach op, the per-tensor op its loop calls (`_foreach_add_` -> `aten.add`), or None.

    **Example:** `per_tensor_packet(aten._foreach_sqrt.default)` is `aten.sqrt`.
    """
    name = op._schema.name.split("::")[1]
    return getattr(aten, name[len("_foreach_") :], None)
