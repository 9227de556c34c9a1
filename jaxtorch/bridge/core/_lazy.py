"""Lazy execution: torch ops on the `jax` device build a graph, run as one XLA program.

torch_xla's model, on jaxtorch's interpreter. With lazy mode on (`jaxtorch.lazy()`,
`jaxtorch.enable_globally(lazy=True)`, `jaxtorch.xla.xla_device()`), a `JaxTensor`
holds a `LazyArray` instead of a `jax.Array`: a pending output of a graph node (an op's
JAX lowering, its argument nodes and leaf arrays, its static arguments). Recording an op
infers its output shapes and dtypes with `jax.eval_shape` (cached per op signature), so a
shape or dtype error is raised at the op's line, not later.

Execution points:
- `sync()` / `jaxtorch.xla.mark_step()`: everything pending for all live tensors, as one
  program (dead tensors were never tracked strongly: their nodes are dropped unless a
  live value needs them);
- reading a value (`.item()`, `.cpu()`, `print`, `bool()`, a data-dependent op such as
  `nonzero`): just the subgraph that value needs; recording then continues.

A program is keyed by the graph's structure: each node's op and static arguments, how
nodes connect, and the shapes/dtypes/shardings of the leaf arrays (parameters, grads,
optimizer state, batches, PRNG keys). Leaf arrays are program inputs, never constants, so
a steady training loop hits the cache from its third step on (step 1 creates optimizer
state, step 2 is the steady shape). Python floats are constants of the program (XLA folds
them: `x ** 3.0` is two multiplies) until one changes value between executions (a
learning rate, AdamW's bias corrections): from then on that float is an input, all such
floats in one vector; the values of the constant floats are part of the key, so a new
value never reuses an old program. `metrics()` and
`metrics_report()` count compilations, cache hits, executions and unplanned executions
with the op and source line that forced each.

An op that cannot be recorded (its lowering needs concrete values) runs eagerly after
executing what it reads, and is counted as a fallback: lazy mode never answers
differently from eager mode.

Example:
    ```python
    with jaxtorch.lazy():
        loss = loss_fn(model(x), y); loss.backward(); opt.step()
        jaxtorch.sync()                      # one XLA program
    print(jaxtorch.xla.metrics_report())
    ```
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import sys
import threading
import time
import types
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..._compat import convert_element_type
from . import _eager as eager
from ._matmul_precision import matmul_precision
from ._random import next_key, take_generator
from ._signature import ARRAY_TYPES, OpCall, bind, signature

# ACTIVE[0]: whether ops on the jax device are recorded. One process-wide switch (torch's
# autograd runs backward ops on its own thread, which must record too).
ACTIVE = [False]
DEFAULT_MAX_OPS = int(os.environ.get("JAXTORCH_LAZY_MAX_OPS", "100000"))
_lock = threading.RLock()
# Held while an op changes tensors (an in-place op, every op in lazy mode) and while a sync
# gives tensors their values: tensors shared by threads see each change whole.
STATE_LOCK = _lock


class LazyGraphWarning(UserWarning):
    """The pending graph grew past its limit and was executed (call `mark_step` in the loop).

    **Example:**
        ```python
        import warnings

        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with jaxtorch.lazy(max_graph_ops=10):
                t = torch.zeros(3, device="jax")
                for _ in range(30):          # no mark_step in the loop
                    t = t + 1
        caught = next(w.message for w in seen if isinstance(w.message, jaxtorch.xla.LazyGraphWarning))
        ```
    """


# ---- the graph ------------------------------------------------------------------------
class _Node:
    """One recorded call: `fn(*inputs)`; `kid` names `fn` and its static arguments."""

    __slots__ = ("kid", "fn", "inputs", "name", "__weakref__")

    def __init__(self, kid: int, fn: Callable, inputs: tuple, name: str):
        self.kid = kid
        self.fn = fn
        self.inputs = inputs
        self.name = name


class LazyArray:
    """A pending array: output `index` of a recorded node, with its shape and dtype known.

    Once executed, `value` holds the `jax.Array` and the node is dropped.
    """

    __slots__ = ("node", "index", "shape", "dtype", "weak_type", "aval", "value", "__weakref__")

    def __init__(self, node: _Node | None, index: int, aval: tuple):
        self.node = node
        self.index = index
        self.shape, self.dtype, self.weak_type = self.aval = aval  # aval: (shape, dtype, weak_type)
        self.value = None

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def __repr__(self) -> str:
        state = "executed" if self.value is not None else f"pending {self.node.name if self.node else '?'}"
        return f"LazyArray({self.dtype}{list(self.shape)}, {state})"


# ---- metrics --------------------------------------------------------------------------
@dataclasses.dataclass
class LazyMetrics:
    """Counters of the lazy mode since the last `clear_metrics()`.

    **Arguments:**
    - `compiles`: programs traced and compiled (a new graph structure);
    - `cache_hits`: executions whose structure had been compiled before;
    - `executions`: programs run (planned or not);
    - `mark_steps`: `mark_step()`/`sync()` calls;
    - `ops_recorded`: ops recorded in each step (between two `mark_step`s), most recent last;
    - `graph_sizes`: nodes of each executed program, most recent last;
    - `unplanned`: reason (forcing op and source line) -> count, for executions not made
      by `mark_step` (value reads, data-dependent ops, graph limit);
    - `fallbacks`: op -> count of ops run eagerly because they cannot be recorded;
    - `compile_seconds` / `execute_seconds`: wall time spent tracing+compiling / running;
    - `floats_made_inputs`: Python-float sites that changed value and so became program
      inputs (the others are baked in as constants; each change compiles once);
    - `float_inputs`: Python floats passed as inputs to the last executed program.

    **Returns:** the counters; made by `jaxtorch.xla.metrics()`, not by hand.

    **Example:**
        ```python
        jaxtorch.xla.clear_metrics()
        with jaxtorch.lazy():
            for _ in range(3):
                t = torch.ones(4, device="jax") * 2
                jaxtorch.xla.mark_step()
        m = jaxtorch.xla.metrics()
        assert isinstance(m, jaxtorch.xla.LazyMetrics) and m.compiles == 1 and m.cache_hits == 2
        ```
    """

    compiles: int = 0
    cache_hits: int = 0
    executions: int = 0
    mark_steps: int = 0
    ops_recorded: list = dataclasses.field(default_factory=list)
    graph_sizes: list = dataclasses.field(default_factory=list)
    unplanned: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    fallbacks: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    compile_seconds: float = 0.0
    execute_seconds: float = 0.0
    floats_made_inputs: int = 0
    float_inputs: int = 0


_M = LazyMetrics()
_pending_ops = [0]  # ops recorded since the last mark_step
_HISTORY = 1000


def metrics() -> LazyMetrics:
    """A snapshot of the lazy-mode counters (see `LazyMetrics`).

    **Arguments:**
    None.

    **Returns:** a `LazyMetrics` (a copy: later work does not change it).

    **Example:**
        ```python
        with jaxtorch.lazy():
            t = torch.ones(2, device="jax") + 1
        m = jaxtorch.xla.metrics()
        assert m.executions >= 1
        ```
    """
    with _lock:
        return dataclasses.replace(
            _M,
            ops_recorded=list(_M.ops_recorded),
            graph_sizes=list(_M.graph_sizes),
            unplanned=collections.Counter(_M.unplanned),
            fallbacks=collections.Counter(_M.fallbacks),
        )


def clear_metrics() -> None:
    """Reset every counter (compiled programs stay cached).

    **Arguments:**
    None.

    **Returns:** None.

    **Example:**
        ```python
        jaxtorch.xla.clear_metrics()
        assert jaxtorch.xla.metrics().executions == 0
        ```
    """
    global _M
    with _lock:
        _M = LazyMetrics()


def metrics_report() -> str:
    """A short human-readable report of `metrics()`, like torch_xla's `metrics_report()`.

    **Arguments:**
    None.

    **Returns:** a multi-line str.

    **Example:**
        ```python
        print(jaxtorch.xla.metrics_report())
        ```
    """
    m = metrics()
    steps = m.ops_recorded[-5:]
    lines = [
        f"lazy mode: {'on' if ACTIVE[0] else 'off'}",
        f"compiled programs: {m.compiles}  (compile time {m.compile_seconds:.2f}s)",
        f"cache hits: {m.cache_hits}",
        f"executions: {m.executions}  (mark_step: {m.mark_steps}, unplanned: {sum(m.unplanned.values())}; "
        f"run time {m.execute_seconds:.2f}s)",
        f"ops recorded per step (last {len(steps)}): {steps}",
        f"graph sizes (last 5): {m.graph_sizes[-5:]}",
        f"Python floats: {m.float_inputs} program inputs in the last program; "
        f"{m.floats_made_inputs} sites made inputs after a change (the rest are constants)",
    ]
    if m.unplanned:
        lines.append("unplanned executions (what forced them):")
        lines += [f"  {n} x {reason}" for reason, n in m.unplanned.most_common(10)]
    if m.fallbacks:
        lines.append("ops run eagerly (not recordable):")
        lines += [f"  {n} x {op}" for op, n in m.fallbacks.most_common(10)]
    return "\n".join(lines)


# ---- where in the user's code ----------------------------------------------------------
_PKG_DIRS = tuple(
    os.path.dirname(os.path.abspath(f)) + os.sep
    for f in (
        os.path.dirname(os.path.dirname(os.path.dirname(__file__))) + os.sep + "x",
        str(jax.__file__),
        str(__import__("torch").__file__),
    )
)
_SKIP = (os.sep + "contextlib.py", os.sep + "threading.py")


def user_frame() -> tuple[str, int, str] | None:
    """(file, line, function) of the innermost caller outside jaxtorch, torch and jax."""
    f: types.FrameType | None = sys._getframe(1)
    while f is not None:
        name = f.f_code.co_filename
        if not name.startswith(_PKG_DIRS) and not name.endswith(_SKIP) and not name.startswith("<frozen"):
            return name, f.f_lineno, f.f_code.co_name
        f = f.f_back
    return None


def _where() -> str:
    fr = user_frame()
    return f"{os.path.basename(fr[0])}:{fr[1]} in {fr[2]}" if fr else "<unknown>"


# ---- recording ----------------------------------------------------------------------------
_KINDS: dict[Any, tuple] = {}  # structural key of an `apply`/`nullary` call -> its kind
_next_kid = [0]  # never reused (pending nodes keep their kid across `clear_cache`)
_EAGER = object()
_FLOAT = ("float",)
_NOT_RECORDABLE = eager.NOT_JITTABLE_ERRORS
_Array = jax.Array
_ArrayImpl = type(jnp.zeros(()))
ARRAY_TYPES.add(LazyArray)  # pending values are dynamic inputs of a recorded call


def _new_kind(fn: Callable) -> tuple[int, Callable, dict]:
    """A node kind: (id, function, inferred output avals per input avals)."""
    with _lock:
        kid = _next_kid[0]
        _next_kid[0] += 1
    return kid, fn, {}


def _kind(key, make_fn: Callable) -> tuple[int, Callable, dict]:
    entry = _KINDS.get(key)
    if entry is None:
        with _lock:
            entry = _KINDS.get(key)
            if entry is None:
                entry = _KINDS[key] = _new_kind(make_fn())
    return entry


class LazyExecutor:
    """Records each call into the pending graph (lazy mode); see the module docstring.

    Random ops draw their key now (a program input); data-dependent ops execute what they
    read and run eagerly (their output shape needs values)."""

    pending = True  # tensors are read as they are: pending values stay pending

    def call(self, op: OpCall, jargs: list, jkwargs: dict) -> Any:
        """Record `op.lowering(*jargs, **jkwargs)`; `LazyArray` outputs."""
        if op.plain:
            pass
        elif op.random:
            jkwargs["key"] = next_key(op.func, take_generator(jargs, jkwargs))
        else:  # data-dependent
            jargs, jkwargs = force_tree((jargs, jkwargs), f"{op.name} (output shape depends on values)")
            return op.lowering(*jargs, **jkwargs)
        if not op.floats_static:  # the common case, inline: a known signature
            sig = signature(jargs, jkwargs, op.floats)
            if sig is not None:
                entry = op.kinds.get(sig[0])
                if entry is not None:
                    out = _record(entry, sig[1], op.name)
                    if out is not _EAGER:
                        return out
        return record(op, jargs, jkwargs)

    def run(self, runner: Callable, args: Any, kwargs: Any) -> Any:
        """`runner(self, args, kwargs)` holding the graph's lock: the pending graph and tensors'
        views are shared by all threads."""
        with _lock:
            return runner(self, args, kwargs)

    def apply(self, key: Any, fn: Callable, *inputs: Any) -> Any:
        """`fn(*inputs)`, recorded when an input is pending (see `apply`)."""
        return apply(key, fn, *inputs)

    def nullary(self, key: Any, fn: Callable[[], Any]) -> Any:
        """`fn()`, recorded (see `nullary`)."""
        return nullary(key, fn)


LAZY = LazyExecutor()


def record(op: OpCall, jargs: list, jkwargs: dict):
    """Record `op.lowering(*jargs, **jkwargs)` (arrays or `LazyArray`s); LazyArray outputs.

    Python floats are inputs of the node when an argument is an array (or when
    `op.floats`). An unhashable static argument, or a lowering that needs concrete values,
    runs eagerly on executed inputs instead (counted in `metrics().fallbacks`).
    """
    while True:
        floats = False if op.floats_static else op.floats
        sig = signature(jargs, jkwargs, floats)
        if sig is None:
            return _fallback(op, jargs, jkwargs, "unhashable static argument")
        key, dyn, plan = sig
        entry = op.kinds.get(key)
        if entry is None:
            entry = op.kinds[key] = _new_kind(bind(op.lowering, plan, matmul_precision))
        out = _record(entry, dyn, op.name)
        if out is not _EAGER:
            return out
        if floats is False or not any(type(x) is float for x in dyn):
            return _fallback(op, jargs, jkwargs, "needs concrete values")
        # the lowering branches on a Python float: keep floats static for this op (a new
        # value compiles a new program, which `metrics()` shows)
        with _lock:
            op.floats_static = True
            _M.fallbacks[f"{op.name} (Python float arguments made static)"] += 1


def apply(key, fn: Callable, *inputs):
    """Record `fn(*inputs)`; `key` (hashable) must identify `fn` and its static arguments.

    Eager (a plain call) when no input is a `LazyArray`.
    """
    if not any(type(x) is LazyArray for x in inputs):
        return fn(*inputs)
    out = _record(_kind(key, lambda: fn), list(inputs), str(key[0]))
    if out is _EAGER:
        return fn(*force_tree(list(inputs), f"{key[0]} (not recordable)"))
    return out


def nullary(key, fn: Callable):
    """Record `fn()`, a value with no inputs (`torch.empty` on the device); `key` (hashable)
    identifies `fn`. Recording it instead of running it keeps the step free of JAX
    dispatches, which on the CPU wait for the previous step's program to finish."""
    out = _record(_kind(key, lambda: fn), [], str(key[0]))
    return fn() if out is _EAGER else out


def _fallback(op: OpCall, jargs, jkwargs, why: str):
    with _lock:
        _M.fallbacks[f"{op.name} ({why})"] += 1
    jargs, jkwargs = force_tree((list(jargs), jkwargs), f"{op.name} (runs eagerly: {why})")
    return eager.run(op, jargs, jkwargs)


def _record(entry, dyn: list, name: str):
    kid, fn, shapes_of = entry
    ins = []
    avals = []
    for x in dyn:
        t = type(x)
        if t is LazyArray:
            if x.value is None:
                ins.append(x)
                avals.append(x.aval)
                continue
            x = x.value
        elif t is float:
            ins.append(x)
            avals.append(_FLOAT)
            continue
        ins.append(x)
        avals.append((x.shape, x.dtype, x.weak_type if type(x) is _ArrayImpl else getattr(x, "weak_type", False)))
    akey = tuple(avals)
    shapes = shapes_of.get(akey)
    if shapes is None:
        shapes = shapes_of[akey] = _infer(fn, ins)
    if shapes is _EAGER:
        return _EAGER
    if _pending_ops[0] >= _max_ops[0]:
        _graph_limit()
    _pending_ops[0] += 1
    outs, treedef = shapes
    node = _Node(kid, fn, tuple(ins), name)
    if treedef is None:
        return LazyArray(node, 0, outs[0])
    return jax.tree_util.tree_unflatten(treedef, [LazyArray(node, i, a) for i, a in enumerate(outs)])


def _infer(fn: Callable, ins: list):
    """(output avals (shape, dtype, weak_type), treedef or None for a single array), or _EAGER."""
    args = [jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=x.weak_type) if type(x) is LazyArray else x for x in ins]
    try:
        out = jax.eval_shape(fn, *args)
    except _NOT_RECORDABLE:
        return _EAGER
    leaves, treedef = jax.tree_util.tree_flatten(out)
    if not all(isinstance(s, jax.ShapeDtypeStruct) for s in leaves):
        return _EAGER
    avals = tuple((s.shape, s.dtype, s.weak_type) for s in leaves)
    if treedef.num_leaves == 1 and not treedef.children():  # type: ignore[attr-defined]
        return avals, None
    return avals, treedef


# ---- execution --------------------------------------------------------------------------
_PROGRAMS: dict[Any, Callable] = {}
_MAX_PROGRAMS = 2000


def _leaf_aval(x):
    if type(x) is float:
        return _FLOAT
    return (x.shape, x.dtype, getattr(x, "weak_type", False), x.sharding)


def _linearize(targets: list[LazyArray]):
    """Topological order of the nodes the targets need, the leaves, and the structure key.

    Leaves are merged by identity (a parameter read twice is one input), except Python
    floats: their identity is no part of the structure.
    """
    node_pos: dict[int, int] = {}
    order: list[_Node] = []
    parts: list = []
    leaves: list = []
    leaf_pos: dict[int, int] = {}
    uses: list[int] = []  # per leaf: how many node inputs hold it directly
    sites: list = []  # per Python-float leaf (in leaf order): (kid, occurrence of kid, input position)
    kid_seen: dict[int, int] = {}
    lazy_t = LazyArray
    for t in targets:
        stack: list[Any] = [t.node]  # (pending targets have nodes)
        while stack:
            n = stack[-1]
            if id(n) in node_pos:
                stack.pop()
                continue
            pushed = False
            for x in n.inputs:
                if type(x) is lazy_t and x.value is None and id(x.node) not in node_pos:
                    stack.append(x.node)
                    pushed = True
            if pushed:
                continue
            stack.pop()
            refs: list[Any] = []
            occ = -1
            for j, x in enumerate(n.inputs):
                direct = 1
                if type(x) is lazy_t:
                    v = x.value
                    if v is None:
                        refs.append((node_pos[id(x.node)], x.index))
                        continue
                    x, direct = v, 0
                if type(x) is float:
                    if occ < 0:
                        occ = kid_seen.get(n.kid, 0)
                        kid_seen[n.kid] = occ + 1
                    sites.append((n.kid, occ, j))
                    leaves.append(x)
                    uses.append(direct)
                    refs.append(-len(leaves))
                    continue
                i = leaf_pos.get(id(x))
                if i is None:
                    leaves.append(x)
                    uses.append(0)
                    i = leaf_pos[id(x)] = -len(leaves)
                uses[-1 - i] += direct
                refs.append(i)
            node_pos[id(n)] = len(order)
            order.append(n)
            parts.append((n.kid, tuple(refs)))
    outs = tuple((node_pos[id(t.node)], t.index) for t in targets)
    key = (tuple(parts), tuple(_leaf_aval(x) for x in leaves), outs)
    return order, leaves, uses, sites, outs, key


# Python floats (a GELU's 0.5, a softmax scale, a `pow` exponent, AdamW's betas and its
# per-step bias corrections) are baked into a program as constants, so XLA folds them (a
# `pow(x, 3.0)` becomes two multiplies), until one changes: then that float's site (the
# op kind, its occurrence in the graph, the argument position) becomes a program input
# for good. A steady loop's per-step floats (AdamW's step sizes) differ between its first
# and second step, which compile anyway, so from the third step on nothing compiles.
_VARYING = object()
_FLOAT_SITES: dict[Any, Any] = {}  # site -> the value seen (as float.hex) or _VARYING


def _float_plan(leaves: list, sites: list) -> tuple[tuple[bool, ...], tuple[str, ...]]:
    """(per float leaf: whether it is a program input, hex of the floats baked in)."""
    dynamic = []
    static = []
    table = _FLOAT_SITES
    i = 0
    for x in leaves:
        if type(x) is not float:
            continue
        site = sites[i]
        i += 1
        h = x.hex()
        seen = table.get(site)
        if seen is None:
            table[site] = h
        elif seen is not _VARYING and seen != h:
            table[site] = seen = _VARYING
            _M.floats_made_inputs += 1
        if seen is _VARYING:
            dynamic.append(True)
        else:
            dynamic.append(False)
            static.append(h)
    return tuple(dynamic), tuple(static)


def _donatable(leaves: list, uses: list[int]) -> tuple[bool, ...]:
    """Which leaves no one but the graph holds (their owners moved on to new values), so the
    program may reuse their buffers: only the graph's node inputs refer to them."""
    mask = []
    for i in range(len(leaves)):
        x = leaves[i]
        # references: `leaves`, `x`, getrefcount's argument, the node inputs; any other
        # holder (a tensor, a view's cache, the user's `t.jax()`) keeps the array intact
        mask.append(type(x) is _ArrayImpl and sys.getrefcount(x) == 3 + uses[i] and x.size > 0)
    return tuple(mask)


_KEPT, _DONATED, _BAKED, _FLOATS = 0, 1, 2, 3  # how a leaf reaches the program


def _weak_scalars(vector) -> Iterator:
    """The elements of `vector` as weakly typed scalars, as JAX traces a Python float."""
    for i in range(vector.shape[0]):
        yield convert_element_type(vector[i], weak_type=True)


def _build(order: list[_Node], outs: tuple, parts: tuple, how: tuple[int, ...], baked: list) -> Callable:
    """The `jax.jit` program of a linearised graph; `how[i]` says how leaf i arrives:
    `_KEPT`/`_DONATED` array inputs, `_BAKED` (the next of the constants `baked`) or
    `_FLOATS` (the next element of one vector input holding every changing float: one
    transfer per step instead of one per float)."""
    plan = [(n.fn, refs, n.name) for n, (_, refs) in zip(order, parts)]
    del order

    def program(donated, kept, floats):
        _M.compiles += 1  # runs once per trace
        its = (iter(kept), iter(donated), iter(baked), _weak_scalars(floats))
        leaves = [next(its[h]) for h in how]
        vals: list[list[Any]] = []
        for fn, refs, name in plan:
            args = [leaves[-1 - r] if type(r) is int else vals[r[0]][r[1]] for r in refs]
            with jax.named_scope(name):
                vals.append(jax.tree_util.tree_leaves(fn(*args)))
        return [vals[p][i] for p, i in outs]

    return jax.jit(program, donate_argnums=0 if _DONATED in how else ())


# Donate the inputs only the graph holds: "1" always, "0" never, unset/"auto" off the CPU
# only. On the CPU donation buys memory but costs time: XLA copies each aliased parameter
# before the program reads it, and dispatching a GPT-2 step with its ~80 donated buffers
# took ~13 ms instead of ~2 ms (benchmarks/README.md, issue 15).
_DONATE_ENV = os.environ.get("JAXTORCH_LAZY_DONATE", "auto")


def _donating() -> bool:
    if _DONATE_ENV in ("0", "1"):
        return _DONATE_ENV == "1"
    return jax.default_backend() != "cpu"


def materialize(targets: list[LazyArray], reason: str | None = None, donate: bool = False) -> None:
    """Execute what the pending `targets` need, as one program; sets each target's `value`.

    `reason` (None for a planned `mark_step`) is counted in `metrics().unplanned`. With
    `donate` (a full sync: every live tensor is a target, so no pending value outside the
    graph can need an input later), inputs that only the graph holds are donated.
    """
    seen: set[int] = set()
    pending = []
    for t in targets:
        if t.value is None and id(t) not in seen:
            seen.add(id(t))
            pending.append(t)
    if not pending:
        return
    with _lock:
        order, leaves, uses, sites, outs, key = _linearize(pending)
        mask = _donatable(leaves, uses) if donate and _donating() else (False,) * len(leaves)
        dynamic, static = _float_plan(leaves, sites)
        key = (key, mask, dynamic, static)
        prog = _PROGRAMS.get(key)
        if reason is not None:
            _M.unplanned[f"{reason} at {_where()}"] += 1
        _M.executions += 1
        _M.graph_sizes.append(len(order))
        _M.float_inputs = sum(dynamic)
        del _M.graph_sizes[:-_HISTORY]
        t0 = time.perf_counter()
        if prog is None:
            if len(_PROGRAMS) >= _MAX_PROGRAMS:
                _PROGRAMS.clear()
            how, fl = [], iter(dynamic)
            for x, d in zip(leaves, mask):
                how.append(_DONATED if d else _KEPT if type(x) is not float else _FLOATS if next(fl) else _BAKED)
            baked = [x for x, h in zip(leaves, how) if h == _BAKED]
            prog = _PROGRAMS[key] = _build(order, outs, key[0][0], tuple(how), baked)
            new = True
        else:
            _M.cache_hits += 1
            new = False
        del order
        donated: list = []
        kept: list = []
        floats: Any = []
        fl = iter(dynamic)
        for x, d in zip(leaves, mask):
            if d:
                donated.append(x)
            elif type(x) is not float:
                kept.append(x)
            elif next(fl):
                floats.append(x)
        del leaves
        floats = np.asarray(floats, dtype=jax.dtypes.canonicalize_dtype(np.float64))
        if new:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
                values = prog(donated, kept, floats)
        else:
            values = prog(donated, kept, floats)
        dt = time.perf_counter() - t0
        if new:  # the first run includes tracing and compiling
            _M.compile_seconds += dt
        else:
            _M.execute_seconds += dt
    for t, v in zip(pending, values):
        t.value = v
        t.node = None


def force(la: LazyArray, reason: str):
    """The `jax.Array` of `la`, executing what it needs (an unplanned execution)."""
    if la.value is None:
        materialize([la], reason)
    return la.value


def force_tree(tree, reason: str):
    """`tree` with every `LazyArray` replaced by its value (one execution for all)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=lambda x: type(x) is LazyArray)
    lazy = [x for x in leaves if type(x) is LazyArray]
    if not lazy:
        return tree
    materialize(lazy, reason)
    return jax.tree_util.tree_unflatten(treedef, [x.value if type(x) is LazyArray else x for x in leaves])


# ---- live tensors --------------------------------------------------------------------------
# weakrefs of the tensors given a LazyArray since the last sync (dead ones and repeats
# included: appending is the cheapest record; `_live` sorts them out, and the list is
# compacted when it grows past `_compact_at` in a loop that does not sync)
_TRACKED: list = []
_compact_at = [100_000]
_ref = weakref.ref


def track(t) -> None:
    """Remember `t` (weakly) as holding a pending value, for `sync`."""
    _TRACKED.append(_ref(t))
    if len(_TRACKED) > _compact_at[0]:
        with _lock:
            _TRACKED[:] = [_ref(t) for t in _live(_TRACKED)]
            _compact_at[0] = max(100_000, 2 * len(_TRACKED))


def _live(refs: list) -> list:
    """The distinct tensors still alive among `refs`."""
    out, seen = [], set()
    for r in refs:
        t = r()
        if t is not None and id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def sync(reason: str | None = None) -> None:
    """Execute everything pending for all live tensors as one program (`mark_step`).

    **Arguments:**
    - `reason`: None for a planned step; otherwise why (counted as unplanned).

    **Returns:** None; the pending values are computed (asynchronously, as JAX dispatches).

    **Example:**
        ```python
        with jaxtorch.lazy():
            t = torch.ones(3, device="jax") * 2   # recorded, not run
            jaxtorch.sync()                        # run now, as one program
            assert t.cpu().tolist() == [2.0, 2.0, 2.0]
        ```
    """
    with _lock:
        refs = _TRACKED[:]
        del _TRACKED[: len(refs)]
        if reason is None and (refs or _pending_ops[0]):  # (an empty sync is no step)
            _M.mark_steps += 1
            _M.ops_recorded.append(_pending_ops[0])
            del _M.ops_recorded[:-_HISTORY]
            _pending_ops[0] = 0
        _settle[0](_live(refs), reason)


def _settle_nothing(tracked: list, reason: str | None) -> None:
    """Before the tensor layer installs its own (`install_settle`), nothing is tracked."""


_settle: list[Callable[[list, str | None], None]] = [_settle_nothing]


def install_settle(fn: Callable[[list, str | None], None]) -> None:
    """Install `fn(tracked, reason)`, which executes what the live `tracked` objects (those
    given to `track`) hold pending and stores the values in them; `sync` calls it. The
    tensor layer's walk is installed by `jaxtorch/_install.py` (this layer knows no tensors).

    **Example:**
        ```python
        install_settle(lambda tensors, reason: materialize([...], reason, donate=True))
        ```
    """
    _settle[0] = fn


def pending_ops() -> int:
    """Ops recorded since the last `mark_step`."""
    return _pending_ops[0]


_max_ops = [DEFAULT_MAX_OPS]


def _graph_limit() -> None:
    where = _where()
    warnings.warn(
        f"jaxtorch lazy mode: {_pending_ops[0]} ops were recorded without an execution point, so the pending "
        f"graph is executed now (at {where}). Call `jaxtorch.xla.mark_step()` (or `jaxtorch.sync()`) once per "
        "iteration, e.g. after `optimizer.step()`; the limit is `jaxtorch.lazy(max_graph_ops=...)` or "
        "JAXTORCH_LAZY_MAX_OPS.",
        LazyGraphWarning,
        stacklevel=2,
    )
    _pending_ops[0] = 0
    sync(f"graph limit ({_max_ops[0]} ops)")


# ---- switching ----------------------------------------------------------------------------
def is_enabled() -> bool:
    """Whether lazy mode is on."""
    return ACTIVE[0]


def set_enabled(on: bool, max_graph_ops: int | None = None) -> None:
    """Turn lazy mode on or off (process-wide). Turning it off executes what is pending."""
    if max_graph_ops is not None:
        _max_ops[0] = int(max_graph_ops)
    if ACTIVE[0] and not on:
        sync()  # the end of lazy mode is a step boundary
        ACTIVE[0] = False
    ACTIVE[0] = bool(on)


_depth = [0]  # open `lazy()` blocks, all threads together
_outer: list[tuple[bool, int]] = [(False, DEFAULT_MAX_OPS)]  # the state the first one found


@contextlib.contextmanager
def lazy(max_graph_ops: int | None = None):
    """Record ops on the `jax` device inside the block; pending work runs at its end.

    **Arguments:**
    - `max_graph_ops`: execute (with a `LazyGraphWarning`) when this many ops are pending
      (default 100000, or `JAXTORCH_LAZY_MAX_OPS`).

    **Returns:** a context manager; at its end what is pending runs (as `sync()`).

    **Example:**
        ```python
        model = torch.nn.Linear(4, 1).to("jax")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = torch.ones(8, 4, device="jax"), torch.zeros(8, 1, device="jax")
        with jaxtorch.lazy():
            for _ in range(3):
                opt.zero_grad(); torch.nn.functional.mse_loss(model(x), y).backward(); opt.step()
                jaxtorch.xla.mark_step()   # one cached XLA program per step
        ```
    """
    with _lock:  # (threads entering and leaving in any order: on while any block is open)
        if _depth[0] == 0:
            _outer[0] = (ACTIVE[0], _max_ops[0])
        _depth[0] += 1
        set_enabled(True, max_graph_ops)
    try:
        yield
    finally:
        with _lock:
            _depth[0] -= 1
            if _depth[0] == 0:
                set_enabled(_outer[0][0])
                _max_ops[0] = _outer[0][1]


def clear_cache() -> None:
    """Forget compiled programs, float sites and the kinds of `apply`/`nullary` calls. An op's
    own kinds and inferred shapes live in its `OpCall`, dropped with the dispatcher's runners
    (`invalidate_cache`, after re-registering a lowering)."""
    with _lock:
        _PROGRAMS.clear()
        _KINDS.clear()
        _FLOAT_SITES.clear()
