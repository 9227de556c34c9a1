"""`jaxtorch.from_exported`: a `torch.export.ExportedProgram` as `(params, fn)`, a pure JAX function.

The program's graph (decomposed to ATen ops, with `torch.no_grad()` regions and `.detach()`
marked first so they stay stop-gradients) is walked on JAX values, each op running its
lowering from the op registry. Sizes declared dynamic with `torch.export.Dim` stay symbolic:
`fn.input_specs` are `jax.ShapeDtypeStruct`s whose dimensions are JAX symbolic dimensions, with
the program's ranges (`ep.range_constraints`) as constraints, so `jax.export` gives one
StableHLO program for every size in range, which checks the ranges when called.

Example:
    ```python
    ep = torch.export.export(model, (ids,), dynamic_shapes=({0: torch.export.Dim("b", max=8)},))
    params, fn = jaxtorch.from_exported(ep)
    out = jax.jit(fn)(params, ids_array)
    exp = jax.export.export(jax.jit(fn))(params, *fn.input_specs)  # any batch size in [1, 8]
    ```
"""

from __future__ import annotations

import copy
import math
import operator
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import sympy
import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from ..._compat import HigherOrderOperator, OpOverload, Tracer, torch_pytree
from ..core import _registry as registry
from ..core._autodiff import keep_tangent, stop_gradient
from ..core._dtypes import scalar_jax_dtype, to_jax_dtype
from ..core._errors import ExportedInputError, ExportedProgramError, UnsupportedOpError
from ..core._matmul_precision import matmul_precision
from ..core._pytrees import flatten as register_containers
from ..core._random import key_scope, next_key
from ..dispatch._interpreter import _unwrap_args
from ..state._binding import check_tree, is_trainable, spec_of
from ..tensor._convert import tensor_to_jax
from ._jax_first import jax_inputs

aten = torch.ops.aten


# ---- marking what torch's decomposition forgets --------------------------------------------
# `run_decompositions` inlines `torch.no_grad()` regions and turns `.detach()` into `alias`: two
# custom ops, which it keeps, carry torch's gradient cuts through it (`core._autodiff`); `install_marks`
# defines them (`_STOP`, `_KEEP`).
_STOP: Any = None
_KEEP: Any = None


def install_marks() -> None:
    """Define the custom ops `jaxtorch::stop_gradient` (a value torch does not differentiate: a
    `no_grad` region's result, a `.detach()`; lowered to `lax.stop_gradient`) and
    `jaxtorch::keep_tangent` (a tensor written in place under `no_grad`: `new`'s values, `old`'s
    place in the graph, `core._autodiff.keep_tangent`). Idempotent; `jaxtorch._install` calls it.

    **Example:** `install_marks(); torch.ops.jaxtorch.stop_gradient(torch.ones(2))`.
    """
    global _STOP, _KEEP
    if _STOP is not None:
        return

    @torch.library.custom_op("jaxtorch::stop_gradient", mutates_args=())
    def stop_gradient_mark(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @stop_gradient_mark.register_fake
    def _(x: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x)

    @torch.library.custom_op("jaxtorch::keep_tangent", mutates_args=())
    def keep_tangent_mark(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
        return new.clone()

    @keep_tangent_mark.register_fake
    def _(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(new)

    _STOP = torch.ops.jaxtorch.stop_gradient.default
    _KEEP = torch.ops.jaxtorch.keep_tangent.default
    _OWN[_STOP], _OWN[_KEEP] = stop_gradient, keep_tangent


_GRAD_REGION = torch.ops.higher_order.wrap_with_set_grad_enabled


def _args_of(node: torch.fx.Node) -> list[tuple[Any, Any]]:
    """`(schema argument, value)` pairs of an ATen call."""
    op: Any = node.target
    schema = op._schema
    pairs = list(zip(schema.arguments, node.args, strict=False))
    by_name = {a.name: a for a in schema.arguments}
    pairs += [(by_name[k], v) for k, v in node.kwargs.items() if k in by_name]
    return pairs


def _written_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The tensors an ATen call writes in place (`Tensor(a!)` arguments)."""
    if not isinstance(node.target, OpOverload):
        return []
    out = []
    for arg, value in _args_of(node):
        if arg.alias_info is not None and arg.alias_info.is_write:
            out += [v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, torch.fx.Node)]
    return out


def _is_written(node: torch.fx.Node) -> bool:
    """Whether an op writes `node` in place, itself or through a view of it."""
    for user in node.users:
        if node in _written_args(user):
            return True
        if isinstance(user.target, OpOverload) and any(
            value is node and arg.alias_info is not None for arg, value in _args_of(user)
        ):
            if _is_written(user):  # (a view of `node`)
                return True
    return False


def _refuse_write(node: torch.fx.Node, what: str) -> None:
    if _is_written(node):
        raise ExportedProgramError(
            f"jaxtorch.from_exported: the program writes in place to {what} (`{node.name}`), which shares "
            "memory with the tensor it came from in torch. Write to a `.clone()` instead, and export again."
        )


def _mark_graph(gm: torch.fx.GraphModule) -> None:
    """In place: each `.detach()` of `gm` becomes a stop-gradient mark, each tensor a
    `torch.no_grad()` region (`wrap_with_set_grad_enabled(False, body, *args)`) computes is marked
    where it is used, and each in-place write in such a region keeps the written tensor's tangent.
    (torch.export hoists an `enable_grad()` nested in `no_grad()` out of the region.)"""
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten.detach.default:
            _refuse_write(node, "a `.detach()`ed tensor")
            node.target = _STOP
        elif node.target is _GRAD_REGION:
            body = getattr(gm, node.args[1].target)
            if node.args[0] is False:
                returned = next(n for n in body.graph.nodes if n.op == "output").args[0]
                for result in list(node.users):
                    if result.target is not operator.getitem or _same_tensor(returned[result.args[1]]):
                        continue  # an outer tensor the region wrote in place (see `_keep_tangents`) or passed on
                    if isinstance(result.meta.get("val"), torch.Tensor):
                        _refuse_write(result, "a result of a `torch.no_grad()` region")
                        _mark_after(gm.graph, result, _STOP, (result,))
                _keep_tangents(body)
            _mark_graph(body)  # (nested regions)
    gm.recompile()


def _same_tensor(node: Any) -> bool:
    """Whether a region's result is a tensor from outside it (a placeholder), or one written in place."""
    if not isinstance(node, torch.fx.Node):
        return False
    if node.op == "placeholder":
        return True
    target = node.target
    if not isinstance(target, OpOverload) or not target._schema.returns:
        return False
    alias = target._schema.returns[0].alias_info
    return alias is not None and alias.is_write


def _mark_after(graph: torch.fx.Graph, node: torch.fx.Node, op: Any, args: tuple) -> torch.fx.Node:
    """Insert `op(*args)` after `node` and make it what every later use of `node` reads."""
    users = list(node.users)
    with graph.inserting_after(node):
        marked = graph.call_function(op, args)
    marked.meta["val"] = node.meta["val"]
    for user in users:
        user.replace_input_with(node, marked)
    return marked


def _keep_tangents(body: torch.fx.GraphModule) -> None:
    """Each in-place write of the `no_grad` region `body` is one torch does not record: the written
    tensor keeps its tangent (`old = clone(t); write t; t.copy_(keep_tangent(t, old))`)."""
    graph = body.graph
    for node in list(graph.nodes):
        for t in _written_args(node):
            val = t.meta.get("val")
            if not (isinstance(val, torch.Tensor) and (val.is_floating_point() or val.is_complex())):
                continue
            with graph.inserting_before(node):
                old = graph.call_function(aten.clone.default, (t,))
            old.meta["val"] = val
            with graph.inserting_after(node):
                kept = graph.call_function(_KEEP, (t, old))
            kept.meta["val"] = val
            with graph.inserting_after(kept):
                graph.call_function(aten.copy_.default, (t, kept)).meta["val"] = val
    body.recompile()


def _marked(ep: ExportedProgram) -> ExportedProgram:
    """A copy of `ep` (the graph only; tensors shared) with its gradient cuts marked (`_mark_graph`)."""
    gm = copy.deepcopy(ep.graph_module)  # (which may rename nodes: `input` becomes `input_1`)
    _mark_graph(gm)
    signature = copy.deepcopy(ep.graph_signature)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    outputs = next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0]
    for specs, nodes in ((signature.input_specs, placeholders), (signature.output_specs, outputs)):
        for spec, node in zip(specs, nodes, strict=True):
            if isinstance(node, torch.fx.Node) and hasattr(spec.arg, "name"):
                spec.arg.name = node.name
    return ExportedProgram(
        root=gm,
        graph=gm.graph,
        graph_signature=signature,
        state_dict=ep.state_dict,
        range_constraints=ep.range_constraints,
        module_call_graph=copy.deepcopy(ep.module_call_graph),
        example_inputs=ep.example_inputs,
        constants=ep.constants,
        verifiers=ep.verifiers,
    )


def _decomposed(ep: ExportedProgram) -> ExportedProgram:
    """`ep` functionalized and decomposed to core ATen, keeping whole every op that has a lowering."""
    table = torch.export.default_decompositions()
    for op in list(table.keys()):
        if registry.lookup(op) is not None:
            del table[op]
    return _marked(ep).run_decompositions(table)


# ---- the ops the walk runs itself ------------------------------------------------------------
def _to_copy(x: Any, dtype: Any = None, **_: Any) -> Any:
    return x.astype(_jax_dtype(dtype, x.shape)) if dtype is not None else x


def _copy(dst: Any, src: Any, non_blocking: bool = False) -> Any:
    return jnp.broadcast_to(src, dst.shape).astype(dst.dtype)


def _sym_size(x: Any, dim: int) -> Any:
    return x.shape[dim]


def _sym_numel(x: Any) -> Any:
    return math.prod(x.shape)


def _assert_scalar(cond: Any, msg: str = "") -> None:
    """torch's runtime check of sizes: refused when it is known false; a check of symbolic sizes
    (unknown here) was proven by torch within the program's ranges, which `jax.export` checks."""
    if cond is False:
        raise ExportedInputError(f"jaxtorch: the exported program's runtime check failed: {msg}")


def _ignore(*args: Any, **kwargs: Any) -> None:
    return None


_OWN: dict[Any, Callable] = {  # (and `_STOP`, `_KEEP`: see `install_marks`)
    aten.detach.default: stop_gradient,  # (a program decomposed before: its detaches as they are left)
    aten._to_copy.default: _to_copy,
    aten.copy.default: _copy,
    aten.alias.default: lambda x: x,
    aten.lift_fresh_copy.default: lambda x: x,
    aten.sym_size.int: _sym_size,
    aten.sym_numel.default: _sym_numel,
    aten._assert_scalar.default: _assert_scalar,
    aten._assert_tensor_metadata.default: _ignore,  # (checked against every node's meta, see `_conform`)
    aten.sym_constrain_range_for_size.default: _ignore,
    aten.sym_constrain_range.default: _ignore,
    operator.getitem: operator.getitem,
}
# Python functions of sizes a graph may call (on ints, or JAX symbolic dimensions)
_SIZE_FUNCTIONS = {
    operator.add,
    operator.sub,
    operator.mul,
    operator.floordiv,
    operator.mod,
    operator.neg,
    operator.truediv,
    operator.pow,
    operator.eq,
    operator.ne,
    operator.lt,
    operator.le,
    operator.gt,
    operator.ge,
    operator.and_,
    operator.or_,
    operator.not_,
    torch.sym_max,
    torch.sym_min,
    torch.sym_not,
    torch.sym_int,
    torch.sym_float,
    math.ceil,
    math.floor,
}


def _runner(target: Any) -> Callable | None:
    """The function a graph node's target runs on JAX values; None if there is none."""
    if target in _OWN:
        return _OWN[target]
    if target in _SIZE_FUNCTIONS:
        return target
    if isinstance(target, OpOverload):
        lowering = registry.lookup(target)
        if lowering is None:
            return None
        return _lowered(target, lowering)
    return None


def _lowered(op: OpOverload, lowering: Callable) -> Callable:
    random = registry.is_flagged(op, registry.RANDOM)

    def run(*args: Any, **kwargs: Any) -> Any:
        jargs, jkwargs = _unwrap_args(args, kwargs, op, False)
        if random:
            jkwargs["key"] = next_key(op)
        return lowering(*jargs, **jkwargs)

    return run


# ---- reading the program -----------------------------------------------------------------------
def _expr(s: Any) -> Any:
    """The sympy expression of a size (`int` or `torch.SymInt`)."""
    return s.node.expr if isinstance(s, torch.SymInt) else sympy.Integer(int(s))


def _free_symbols(val: Any) -> set:
    found: set = set()
    if isinstance(val, torch.Tensor):
        for s in val.shape:
            found |= _expr(s).free_symbols
    elif isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        found |= val.node.expr.free_symbols
    elif isinstance(val, (list, tuple)):
        for v in val:
            found |= _free_symbols(v)
    return found


def _bound(x: Any) -> int | None:
    """A range end as an int; None where it is unbounded (`int_oo`) or beyond any size."""
    try:
        v = int(x)
    except (TypeError, ValueError, OverflowError):
        return None
    return v if abs(v) < 2**62 else None


def _dims_scope(ep: ExportedProgram) -> tuple[jax.export.SymbolicScope | None, dict]:
    """JAX's symbolic scope with torch's range constraints, and `{sympy expr: (lower, upper)}`."""
    ranges: dict = {}
    constraints: list[str] = []
    for expr, vr in ep.range_constraints.items():
        lo, hi = _bound(vr.lower), _bound(vr.upper)
        ranges[expr] = (lo, hi)
        if lo is not None and lo > 1:
            constraints.append(f"{expr} >= {lo}")
        if hi is not None:
            constraints.append(f"{expr} <= {hi}")
    if not ranges:
        return None, ranges
    return jax.export.SymbolicScope(constraints), ranges


def _jax_shape(val: torch.Tensor, scope: Any, where: str) -> tuple:
    """The JAX shape of a placeholder's fake tensor: ints, and symbolic dimensions in `scope`."""
    exprs = [_expr(s) for s in val.shape]
    if all(e.is_Integer for e in exprs):
        return tuple(int(e) for e in exprs)
    try:
        dims = jax.export.symbolic_shape(", ".join(str(e) for e in exprs), scope=scope)
    except Exception as e:
        raise ExportedProgramError(
            f"jaxtorch.from_exported: the sizes {[str(e) for e in exprs]} of {where} have no JAX symbolic "
            f"form ({e}). Declare each dynamic size as its own `torch.export.Dim` (or a linear expression of one)."
        ) from None
    return tuple(dims)


def _jax_dtype(dtype: torch.dtype, shape: Any) -> Any:
    return scalar_jax_dtype(dtype) if len(shape) == 0 else to_jax_dtype(dtype)


def _check_program(gm: torch.fx.GraphModule, inputs: set) -> None:
    """Refuse what the walk cannot run, all at once: higher-order ops, data-dependent sizes and
    values (sizes not made of the input sizes' symbols `inputs`), ops without a lowering
    (`UnsupportedOpError` naming every one)."""
    missing: list = []
    higher: list[str] = []
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            higher.append(f"`{node.target}` (a submodule)")
        if node.op != "call_function":
            continue
        extra = _free_symbols(node.meta.get("val")) - inputs
        if extra or _data_dependent(node.target):
            raise ExportedProgramError(
                f"jaxtorch.from_exported: `{node.name}` ({node.target}) gives a size or a Python value that depends "
                f"on the data{f' ({sorted(map(str, extra))})' if extra else ''}: `nonzero`, boolean-mask indexing, "
                "`.item()`..., which a JAX program cannot have. Rewrite it with static sizes "
                "(`torch.where(mask, x, 0)` instead of `x[mask]`, tensor ops instead of `.item()`) and export again."
            )
        if isinstance(node.target, HigherOrderOperator):
            higher.insert(0, f"`{node.target.name()}`")
        elif _runner(node.target) is None and node.target not in missing:
            missing.append(node.target)
    if higher:
        raise ExportedProgramError(
            "jaxtorch.from_exported: the program has higher-order ops in its graph, which it does not run: "
            + higher[0]
            + ". Export the model without them (a Python `if` instead of `torch.cond`, a loop instead of "
            "`torch.map`, no `torch.autocast` region), or use `jaxtorch.extract(model)`."
        )
    if missing:
        names = ", ".join(f"`{op}`" for op in missing)
        raise UnsupportedOpError(missing[0], f"the exported program needs {len(missing)} op(s) without one: {names}")


def _data_dependent(target: Any) -> bool:
    return target is aten._local_scalar_dense.default or (
        isinstance(target, OpOverload) and registry.is_flagged(target, registry.DATA_DEPENDENT)
    )


def _check_outputs(ep: ExportedProgram, mutable: bool) -> None:
    written = []
    for spec in ep.graph_signature.output_specs:
        kind = spec.kind
        if kind == OutputKind.USER_OUTPUT:
            continue
        if kind == OutputKind.BUFFER_MUTATION:
            written.append(spec.target)
            continue
        what = {
            OutputKind.USER_INPUT_MUTATION: f"writes its input `{spec.target}` in place",
            OutputKind.PARAMETER_MUTATION: f"writes its parameter `{spec.target}` in place",
            OutputKind.TOKEN: "has side effects (an effect token)",
        }.get(kind, f"has an output of kind {kind.name} (a training graph)")
        raise ExportedProgramError(
            f"jaxtorch.from_exported: the program {what}, which a pure JAX function cannot do. Return the new "
            "value from `forward` instead of writing it, and export again."
        )
    if written and not mutable:
        raise ExportedProgramError(
            f"jaxtorch.from_exported: the program writes its buffers {written} (BatchNorm's running statistics "
            "in train mode, a counter), and this function would lose the new values. Use "
            "`jaxtorch.from_exported(ep, mutable=True)`: `fn` returns `(output, new_state)`; or export the model "
            "in eval mode (`model.eval()`)."
        )


# ---- the function ------------------------------------------------------------------------------
def from_exported(ep: ExportedProgram, *, mutable: bool = False) -> tuple[dict[str, jax.Array], ExportedFunction]:
    """Turn a `torch.export.ExportedProgram` into `(params, fn)`: its trainable parameters as JAX
    arrays and a pure JAX function running its graph, as `jaxtorch.extract` does for a module.

    `params` are the trainable parameters (floating, `requires_grad=True`; a tied weight once,
    under its first name); everything else the program reads by name is the state, `fn.state`:
    buffers (persistent or not) and frozen parameters, never differentiated. Tensor constants of
    the program are part of `fn` itself.

    `fn(params, *args, state=None, rng=None, **kwargs)` runs the program on JAX arrays and returns
    its outputs in the structure `forward` returns them (a Hugging Face `ModelOutput` included);
    `jax.jit`, `jax.grad`, `jax.vmap` apply. The arguments have the structure, dtypes and ranks
    the program was exported with; a size declared dynamic (`torch.export.Dim("b", min=, max=)`)
    may be any in its range, others are fixed: anything else raises `ExportedInputError`.
    `fn.input_specs` (and `fn.kwarg_specs`) give the arguments as `jax.ShapeDtypeStruct`s with JAX
    symbolic dimensions for the dynamic sizes, so
    `jax.export.export(jax.jit(fn))(params, *fn.input_specs)` is one StableHLO program for every
    size in range; it checks the ranges when called. Random ops draw from `rng` (a JAX key).

    Give the program `torch.export.export` returns: `torch.no_grad()` regions and `.detach()` stay
    gradient cuts (`lax.stop_gradient`). A program decomposed before (`ep.run_decompositions()`)
    has lost its `no_grad` regions: its gradients would run through them.

    **Arguments:**
    - `ep`: the exported program.
    - `mutable`: a program that writes its buffers (BatchNorm in train mode) is refused unless
      this is True; then `fn` returns `(output, new_state)`, the whole state with the written
      buffers updated.

    **Returns:** `(params, fn)`: a dict name -> `jax.Array`, and an `ExportedFunction`.

    **Raises:** `ExportedProgramError` for a program that writes its inputs or parameters, or its
    buffers without `mutable=True`, has data-dependent sizes, higher-order ops or custom objects;
    `UnsupportedOpError` naming every op without a lowering.

    **Example:**
        ```python
        b = torch.export.Dim("b", min=1, max=64)
        ep = torch.export.export(torch.nn.Linear(3, 2).eval(), (torch.ones(2, 3),), dynamic_shapes=({0: b},))
        params, fn = jaxtorch.from_exported(ep)
        y = jax.jit(fn)(params, jnp.ones((5, 3)))    # any batch size from 1 to 64
        grads = jax.grad(lambda p: fn(p, jnp.ones((5, 3))).sum())(params)
        ```
    """
    if not isinstance(ep, ExportedProgram):
        raise ExportedProgramError(
            f"jaxtorch.from_exported takes a torch.export.ExportedProgram, got {type(ep).__name__}; "
            "make one with `torch.export.export(model, args)`, or use `jaxtorch.extract(model)` for a module."
        )
    _check_outputs(ep, mutable)
    program = _decomposed(ep)
    _check_outputs(program, mutable)
    fn = ExportedFunction(program, mutable=mutable)
    return dict(fn._params), fn


class ExportedFunction:
    """The pure function `from_exported` returns: `fn(params, *args, state=None, rng=None, **kwargs)`.

    Attributes: `state` (buffers and frozen parameters, name -> `jax.Array`, used when `state=None`),
    `mutable` (whether it returns `(out, new_state)`), `input_specs` / `kwarg_specs` (the
    arguments as `jax.ShapeDtypeStruct`s, dynamic sizes symbolic; other arguments as exported),
    `program` (the decomposed `ExportedProgram` it runs).
    """

    def __init__(self, program: ExportedProgram, *, mutable: bool):
        self.program = program
        self.mutable = mutable
        self._gm = program.graph_module
        sig = program.graph_signature
        scope, self._ranges = _dims_scope(program)
        placeholders = [n for n in self._gm.graph.nodes if n.op == "placeholder"]
        self._inputs: list[tuple[str, Any]] = []  # per placeholder: (kind, name or index)
        params: dict[str, jax.Array] = {}
        state: dict[str, jax.Array] = {}
        self._constants: dict[str, jax.Array] = {}
        self._user: list[tuple[Any, Any]] = []  # per user input: (its fake value, its JAX spec)
        first: dict[int, str] = {}  # tensor id -> the first name it was read under (tied weights)
        tensors: list[tuple[Any, torch.Tensor]] = []
        for node, spec in zip(placeholders, sig.input_specs, strict=True):
            kind = spec.kind
            if kind == InputKind.USER_INPUT:
                self._inputs.append(("user", len(self._user)))
                val = node.meta.get("val")
                self._user.append((val, self._spec(val, scope, node.name)))
                continue
            if kind in (InputKind.PARAMETER, InputKind.BUFFER):
                t = program.state_dict.get(spec.target)
                t = program.constants[spec.target] if t is None else t  # (non-persistent buffers)
                name = first.setdefault(id(t), spec.target)
                tensors.append((spec, t))
                if name == spec.target:
                    (params if is_trainable(t) else state)[name] = tensor_to_jax(t)
                self._inputs.append(("params" if name in params else "state", name))
            elif kind == InputKind.CONSTANT_TENSOR and isinstance(program.constants.get(spec.target), torch.Tensor):
                self._constants[spec.target] = tensor_to_jax(program.constants[spec.target])
                self._inputs.append(("constant", spec.target))
            else:
                raise ExportedProgramError(
                    f"jaxtorch.from_exported: the program takes `{spec.target or node.name}` as an input of kind "
                    f"{kind.name} (a custom object or an effect token), which a JAX function cannot hold. Export "
                    "a model whose state is tensors only."
                )
        self._alias = {spec.target: first[id(t)] for spec, t in tensors}  # tied names -> the one kept
        self._params, self.state = params, state
        self._params_spec, self._state_spec = spec_of(params), spec_of(state)
        # per output, in order: the buffer it writes, or None for the user's outputs
        self._writes = [s.target if s.kind == OutputKind.BUFFER_MUTATION else None for s in sig.output_specs]
        in_spec = program.call_spec.in_spec
        self._in_spec = in_spec
        self._out_spec = program.call_spec.out_spec
        _check_program(self._gm, _free_symbols([val for val, _ in self._user]))
        self._plan = _plan(self._gm.graph)
        specs = [j for _, j in self._user]
        args, kwargs = torch_pytree.tree_unflatten(specs, in_spec) if in_spec is not None else ((), {})
        self.input_specs: tuple = tuple(args)
        self.kwarg_specs: dict = dict(kwargs)

    @staticmethod
    def _spec(val: Any, scope: Any, name: str) -> Any:
        if isinstance(val, torch.Tensor):
            shape = _jax_shape(val, scope, f"the input `{name}`")
            return jax.ShapeDtypeStruct(shape, _jax_dtype(val.dtype, shape))
        if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            raise ExportedProgramError(
                f"jaxtorch.from_exported: the input `{name}` is a dynamic Python number ({val}), which a JAX "
                "function gets as a traced array, not a number. Export it as a constant (no `Dim` for it) or "
                "pass it as a tensor."
            )
        return val  # a Python constant the program was specialized on

    def __repr__(self) -> str:
        return (
            f"<jaxtorch function of an ExportedProgram: {len(self._params_spec)} params, "
            f"{len(self._state_spec)} state entries, inputs {self.input_specs}{', mutable' if self.mutable else ''}>"
        )

    def __call__(
        self,
        params: Mapping[str, jax.Array],
        *args: Any,
        state: Any = None,
        rng: jax.Array | None = None,
        **kwargs: Any,
    ) -> Any:
        check_tree(params, self._params_spec, what="params", other=self._state_spec, other_what="`state=`")
        if state is None:
            state = self.state
        else:
            check_tree(state, self._state_spec, what="state=", other=self._params_spec, other_what="params")
        params, state, args, kwargs = jax_inputs((params, state, args, kwargs), "the function from from_exported")
        flat = self._user_inputs(args, kwargs)
        values: list = []
        for kind, key in self._inputs:
            if kind == "user":
                values.append(flat[key])
            elif kind == "params":
                values.append(params[key])
            elif kind == "state":
                values.append(stop_gradient(state[key]))
            else:
                values.append(self._constants[key])
        with key_scope(rng), matmul_precision():
            outs = _walk(self._plan, values)
        user: list = []
        new_state = dict(state)
        for name, value in zip(self._writes, outs, strict=True):
            if name is not None:
                new_state[self._alias.get(name, name)] = value
            else:
                user.append(value)
        out = _rebuild(self._out_spec, iter(user))
        register_containers(out)  # (a Hugging Face ModelOutput becomes a JAX container)
        return (out, new_state) if self.mutable else out

    def _user_inputs(self, args: tuple, kwargs: dict) -> list:
        """The user arguments, flattened as the program takes them, each checked against its spec."""
        if self._in_spec is not None and self._in_spec.num_children == 2:
            names = self._in_spec.child(1).context or []
            if set(kwargs) != set(names):
                raise ExportedInputError(
                    f"jaxtorch: the exported program takes the keyword arguments {sorted(names)}; got {sorted(kwargs)}"
                )
            kwargs = {k: kwargs[k] for k in names}
        leaves, spec = torch_pytree.tree_flatten((args, kwargs))
        if self._in_spec is not None and spec != self._in_spec:
            raise ExportedInputError(
                f"jaxtorch: the arguments do not have the structure the program was exported with: expected "
                f"{self._in_spec}, got {spec}. Pass them as in `fn.input_specs` / `fn.kwarg_specs`."
            )
        bindings: dict = {}
        for i, (leaf, (val, jspec)) in enumerate(zip(leaves, self._user, strict=True)):
            if isinstance(val, torch.Tensor):
                self._check_array(i, leaf, val, jspec, bindings)
            elif not (leaf is val or (type(leaf) is type(val) and leaf == val)):
                traced = isinstance(leaf, Tracer)
                raise ExportedInputError(
                    f"jaxtorch: argument {i} is {leaf!r}; the program was exported with {val!r}, a constant of it: "
                    + (
                        "under jax.jit give it as a Python value (close over it, or `static_argnames`)"
                        if traced
                        else "export again with that value"
                    )
                )
        self._check_ranges(bindings)
        return leaves

    def _check_array(self, i: int, leaf: Any, val: torch.Tensor, jspec: Any, bindings: dict) -> None:
        where = f"argument {i}"
        if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
            raise ExportedInputError(f"jaxtorch: {where} is {type(leaf).__name__}; the program takes an array {jspec}")
        if leaf.dtype != jspec.dtype:
            raise ExportedInputError(
                f"jaxtorch: {where} has dtype {leaf.dtype}; the program takes {jspec.dtype} (torch {val.dtype})"
            )
        if len(leaf.shape) != len(jspec.shape):
            raise ExportedInputError(
                f"jaxtorch: {where} has shape {tuple(leaf.shape)}; the program takes {jspec.shape}"
            )
        for d, (given, size, want) in enumerate(zip(leaf.shape, val.shape, jspec.shape, strict=True)):
            if jax.export.is_symbolic_dim(given):
                if not jax.export.is_symbolic_dim(want) or given.scope is not want.scope or given != want:
                    raise ExportedInputError(
                        f"jaxtorch: {where} has the symbolic size {given} in dimension {d}; the program takes "
                        f"{want} there. Use the function's own specs, `fn.input_specs`, for `jax.export`."
                    )
                continue
            expr = _expr(size)
            if expr.is_Integer:
                if int(given) != int(expr):
                    raise ExportedInputError(
                        f"jaxtorch: {where} has size {int(given)} in dimension {d}; the program was exported with "
                        f"the fixed size {int(expr)} there (declare it dynamic with `torch.export.Dim` to vary it)"
                    )
            elif expr.is_Symbol:
                if bindings.setdefault(expr, int(given)) != int(given):
                    raise ExportedInputError(
                        f"jaxtorch: {where} has size {int(given)} in dimension {d}, which the program requires to "
                        f"equal another size ({expr} = {bindings[expr]})"
                    )
            else:
                bindings.setdefault(("derived", expr, where, d), int(given))

    def _check_ranges(self, bindings: dict) -> None:
        symbols = {k: sympy.Integer(v) for k, v in bindings.items() if isinstance(k, sympy.Symbol)}
        for key, given in bindings.items():
            if isinstance(key, tuple):  # a derived size, `2*s0`: its value follows from the others
                _, expr, where, d = key
                value = expr.xreplace(symbols)
                if value.is_Integer and int(value) != given:
                    raise ExportedInputError(
                        f"jaxtorch: {where} has size {given} in dimension {d}; the program requires {expr} = {value}"
                    )
        for expr, (lo, hi) in self._ranges.items():
            value = sympy.sympify(expr).xreplace(symbols)
            if not value.is_Integer:
                continue
            v = int(value)
            if (lo is not None and v < lo) or (hi is not None and v > hi):
                raise ExportedInputError(
                    f"jaxtorch: a dynamic size of the arguments is {v}, outside the range [{lo}, {hi}] the program "
                    f"was exported with ({expr}; `torch.export.Dim(min=, max=)`). Export again with a wider range."
                )


def _rebuild(spec: torch_pytree.TreeSpec, leaves: Any) -> Any:
    """`torch_pytree.tree_unflatten` of `leaves` (an iterator), but a Hugging Face `ModelOutput` is
    filled key by key: its constructor iterates over a lone first field that is not a torch tensor,
    which a JAX array of symbolic size cannot be."""
    if spec.is_leaf():
        return next(leaves)
    children = [_rebuild(c, leaves) for c in spec.children()]
    if any(c.__name__ == "ModelOutput" for c in spec.type.__mro__):
        out = spec.type(**{k: torch.empty(0) for k in spec.context})
        for k, v in zip(spec.context, children, strict=True):
            out[k] = v
        return out
    return torch_pytree.SUPPORTED_NODES[spec.type].unflatten_fn(children, spec.context)


def _plan(graph: torch.fx.Graph) -> list[tuple[torch.fx.Node, Callable | None]]:
    """Each node of `graph` with the function it runs (`_runner`; None for placeholders and output),
    looked up once (`_check_program` refused nodes without one)."""
    return [(n, _runner(n.target) if n.op == "call_function" else None) for n in graph.nodes]


def _walk(plan: list[tuple[torch.fx.Node, Callable | None]], inputs: list) -> list:
    """Run a graph's `plan` on JAX values: `inputs` for its placeholders, in order; its outputs, flattened."""
    env: dict[torch.fx.Node, Any] = {}
    it = iter(inputs)

    def value(a: Any) -> Any:
        return env[a] if isinstance(a, torch.fx.Node) else a

    for node, run in plan:
        if node.op == "placeholder":
            env[node] = next(it)
        elif run is not None:
            args = torch.fx.node.map_aggregate(node.args, value)
            kwargs = torch.fx.node.map_aggregate(node.kwargs, value)
            try:
                out = run(*args, **kwargs)
            except jax.errors.InconclusiveDimensionOperation:
                out = _undecided(node)
            env[node] = _conform(out, node.meta.get("val"), node)
        elif node.op == "output":
            results: Any = node.args[0]
            return [value(a) for a in results]
    raise ExportedProgramError("jaxtorch.from_exported: the program's graph has no output")


def _undecided(node: torch.fx.Node) -> Any:
    """A comparison of symbolic sizes JAX cannot decide for every size in range (`s0 == s1`): fine
    (None) where only torch's runtime checks read it, which torch proved within the program's ranges."""
    if node.users and all(u.target is aten._assert_scalar.default for u in node.users):
        return None
    raise ExportedProgramError(
        f"jaxtorch.from_exported: `{node.name}` ({node.target}) compares dynamic sizes in a way that depends on "
        "their values, which one JAX program for every size in range cannot. Call the function with concrete "
        "shapes (jax.jit), or export the model with those sizes related by one `torch.export.Dim`."
    )


def _conform(out: Any, val: Any, node: Any) -> Any:
    """`out` checked against the node's fake value: the rank torch computed, and torch's dtype
    (cast where a lowering's JAX dtype differs, as torch defines the result)."""
    if isinstance(val, torch.Tensor) and hasattr(out, "dtype"):
        if len(out.shape) != val.dim():
            raise ExportedProgramError(
                f"jaxtorch.from_exported: `{node.name}` ({node.target}) gave shape {tuple(out.shape)}, torch's has "
                f"{val.dim()} dimensions {tuple(val.shape)}: a lowering disagrees with torch (a jaxtorch bug)"
            )
        want = _jax_dtype(val.dtype, val.shape)
        return out if out.dtype == want else out.astype(want)
    if isinstance(val, (list, tuple)) and isinstance(out, (list, tuple)) and len(val) == len(out):
        return type(out)(_conform(o, v, node) for o, v in zip(out, val, strict=True))
    return out
