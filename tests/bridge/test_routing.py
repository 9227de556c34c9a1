"""The routing table (`jaxtorch/bridge/dispatch/_routing.py`) and the one registration path.

`route(op)` is what the interpreter builds its runner from and what `jaxtorch.coverage`
reports; `register`, `register_op` and `unregister` notify every cache built from the registry.
"""

from __future__ import annotations

import pytest
import torch

import jaxtorch
import jaxtorch.coverage as cov
import jaxtorch.xla as xm
from jaxtorch.bridge.core import _registry as registry
from jaxtorch.bridge.dispatch import _interpreter as interpreter
from jaxtorch.bridge.dispatch._routing import SPECIAL_OPS, Kind, route

aten = torch.ops.aten

# A custom op whose packet has the "old" lowering; overrides go on the overload, so removing
# them falls back to the packet's entry (the old route).
_lib = torch.library.Library("jaxtorch_routetest", "DEF")
_lib.define("scaled(Tensor x) -> Tensor")
_lib.impl("scaled", lambda x: x * 2, "CompositeExplicitAutograd")
_lib.impl("scaled", lambda x: torch.empty_like(x), "Meta")
OP = torch.ops.jaxtorch_routetest.scaled


def _twice(x):
    return x * 2


registry.register(OP)(_twice)

REGISTRARS = {
    "register": lambda op, fn: registry.register(op)(fn),
    "register_op": jaxtorch.register_op,
}


@pytest.fixture(autouse=True)
def _env():
    jaxtorch.enable_globally()
    yield
    jaxtorch.disable_globally()


def _values(lazy: bool, x) -> list[float]:
    """`OP(x)` as numbers, run eagerly or recorded and run by `mark_step` (lazy)."""
    if not lazy:
        return OP.default(x).cpu().tolist()
    with jaxtorch.lazy():
        y = OP.default(x)
        xm.mark_step()
        return y.cpu().tolist()


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
@pytest.mark.parametrize("how", list(REGISTRARS))
def test_registering_reroutes_an_op_already_dispatched_and_unregistering_restores_it(how, lazy):
    x = torch.ones(3, device="jax")
    assert _values(lazy, x) == [2.0] * 3  # dispatched: route, runner and compiled program cached
    assert route(OP.default).lowering is _twice

    def thrice(a):
        return a * 3

    try:
        REGISTRARS[how](OP.default, thrice)
        assert route(OP.default).kind is Kind.FUNCTIONAL and route(OP.default).lowering is thrice
        assert _values(lazy, x) == [3.0] * 3
        assert _values(lazy, x) == [3.0] * 3  # (and again, from the rebuilt caches)
    finally:
        registry.unregister(OP.default)
    assert route(OP.default).lowering is _twice
    assert _values(lazy, x) == [2.0] * 3


def test_subscribers_hear_every_change_until_they_unsubscribe():
    heard: list[str] = []

    def listener():
        heard.append("changed")

    assert registry.subscribe(listener) is listener
    registry.subscribe(listener)  # twice: still called once per change
    try:
        registry.register(OP.default)(lambda a: a * 5)
        registry.unregister(OP.default)
        jaxtorch.register_op(OP.default, lambda a: a * 5)
        registry.unregister(OP.default)
        assert heard == ["changed"] * 4
    finally:
        registry.unsubscribe(listener)
    registry.notify()
    assert heard == ["changed"] * 4


def test_routes_are_cached_until_the_registry_changes():
    r = route(aten.add.Tensor)
    assert route(aten.add.Tensor) is r
    registry.notify()
    assert route(aten.add.Tensor) is not r and route(aten.add.Tensor) == r


@pytest.mark.parametrize(
    "op,kind",
    [
        (aten.add.Tensor, Kind.FUNCTIONAL),
        (aten.add_.Tensor, Kind.VIA_SIBLING),
        (aten.add.out, Kind.VIA_SIBLING),
        (aten.index_put_.default, Kind.VIA_SIBLING),
        (aten.transpose.int, Kind.VIEW),
        (aten.bernoulli_.float, Kind.MUTATING),
        (aten._to_copy.default, Kind.SPECIAL),
        (aten._foreach_add_.List, Kind.FOREACH),
        (aten._foreach_add.List_out, Kind.FOREACH_LOOP),
        (aten.linear.out, Kind.SIBLING_DECOMPOSED),
        (aten.__iand__.Tensor, Kind.DECOMPOSED),
        (aten._add_relu.Tensor, Kind.UNSUPPORTED),
    ],
)
def test_route_kinds(op, kind):
    r = route(op)
    assert r.kind is kind and r.op is op


def test_route_records():
    r = route(aten.add_.Tensor)
    assert r.sibling is aten.add.Tensor and r.mutated == ((0, "self", False),) and r.lowering is None
    f = route(aten._foreach_add_.List)
    assert f.element is aten.add.Tensor and f.multi is not None and f.fallback.kind is Kind.FOREACH_LOOP
    assert route(aten.bernoulli.p).random and route(aten.bincount.default).data_dependent
    assert route(aten._pack_padded_sequence.default).host_inputs
    assert route(aten.transpose.int).view and not route(aten.add.Tensor).view


_VERDICTS = {
    cov.LOWERED: {Kind.SPECIAL, Kind.FOREACH, Kind.VIEW, Kind.MUTATING, Kind.FUNCTIONAL, Kind.VIA_SIBLING},
    cov.DECOMPOSED: {Kind.DECOMPOSED, Kind.FOREACH_LOOP, Kind.SIBLING_DECOMPOSED},
    cov.MISSING: {Kind.UNSUPPORTED},
}


def test_coverage_classifies_as_the_route_says():
    assert set().union(*_VERDICTS.values()) == set(Kind)
    ops = cov.universe("all")[::7] + [aten.add_.Tensor, aten._foreach_add_.List, aten.linear.out, OP.default]
    for op in ops:
        assert route(op).kind in _VERDICTS[cov.how(op)], op


def test_the_bridge_implements_exactly_the_special_ops():
    assert set(interpreter._SPECIAL) == SPECIAL_OPS
    assert all(route(op).kind is Kind.SPECIAL for op in SPECIAL_OPS)
