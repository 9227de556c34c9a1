"""Control-flow higher-order ops on the jax device: `torch.cond`, `while_loop`, `scan`, `map`.

torch's control-flow operators are `HigherOrderOperator`s (HOPs): `torch.cond(pred, t, f, ops)`
calls `cond_op`, which torch dispatches by key like an ATen op, with the Python callables as
arguments. This module gives each HOP a kernel for the jax device above autograd
(`AutogradPrivateUse1`, so jaxtorch decides how the result is differentiated) and at the Python
key (for `JaxDispatchMode` and `JaxTensor`, reached when autograd is excluded, as under
`inference_mode`). Each kernel traces the bodies once into jaxprs (the tensors they read from
outside, parameters included, become the jaxprs' constants) and runs one `lax.cond` /
`lax.while_loop` / `lax.scan` of them:

- under a JAX trace (`extract` + `jax.jit`/`jax.grad`, `call_torch`, `jaxtorch.jit`,
  `make_train_step`) the op is part of the program and JAX differentiates it (a `while_loop`
  has a reverse-mode rule that recomputes the carries, as `lax.while_loop` has none);
- eagerly the same op runs at once, and lazily (`jaxtorch.lazy()`) after the pending values
  it reads are computed (a sync);
- when torch's autograd records (a tensor argument or a parameter a body reads requires grad),
  the op is one `torch.autograd.Function` whose backward is `jax.vjp` of the op.

What torch refuses, and what one lax op cannot carry, raises `ControlFlowError`: an output that
is (a view of) an input or of a tensor from outside, a write to an input or to a tensor from
outside the body, a carry changing shape or dtype, branches returning different things, an
empty scan, a non-tensor carry.

Private torch names used: `torch._higher_order_ops` (the HOP objects), `torch._C.DispatchKey`,
`torch.utils._pytree`,
`torch.utils._python_dispatch._len_torch_dispatch_stack`; private JAX name: `jax._src.core.trace_ctx`.

Example:
    ```python
    params, fn = jaxtorch.extract(model)      # model.forward calls torch.cond(x.sum() > 0, ...)
    y = jax.jit(fn)(params, x)                # one lax.cond in the program
    ```
"""

from __future__ import annotations

import dataclasses
import operator
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from ..._compat import (
    DispatchKey,
    TorchDispatchMode,
    Tracer,
    cond_op,
    eval_jaxpr,
    map_impl,
    python_dispatch_stack_len,
    scan_op,
    trace_ctx,
    while_loop_op,
)
from ..._compat import torch_pytree as pytree
from ..core import _lazy, _random
from ..core._errors import ControlFlowError
from ..tensor._tensor import JaxTensor, labelled, root, root_data
from . import _writes
from ._remat_jax import _Remat

_TENSOR = object()  # marks where a tensor goes among a body's output leaves
_guards = threading.local()  # `.stack`: the write guards of the bodies being traced in this thread


def _float(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


def _inexact(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


# ---- the writes a body may make ----------------------------------------------------------------
class _Guard:
    """The write check of a body being traced: only tensors made inside it may be written."""

    def __init__(self, trace, inner: list[JaxTensor], where: str):
        self.trace, self.inner, self.where = trace, {id(x) for x in inner}, where
        self.thread = threading.get_ident()

    def __call__(self, t: torch.Tensor) -> None:
        stack = getattr(_guards, "stack", None)
        if not isinstance(t, JaxTensor) or threading.get_ident() != self.thread or not stack or stack[-1] is not self:
            return  # (a CPU tensor; another thread; the innermost body's guard decides)
        r = root(t)
        if id(r) in self.inner:
            raise ControlFlowError(self.where, "writes in place to one of its inputs", "Write to a `.clone()` of it")
        if not _writes.made_in(root_data(r), self.trace):
            raise ControlFlowError(
                self.where,
                f"writes in place to a tensor of shape {list(r.shape)} from outside the body",
                "Return the new value from the body (as an output or a carry) and assign it after the call",
            )


# ---- the tensors from outside a body that it reads -----------------------------------------------
class _Reads(TorchDispatchMode):
    """Records, while a body is traced, the root of each jax tensor from outside it that an op reads
    (a parameter, a tensor computed before the call): the body's constants that torch's autograd
    must see as inputs of the op, leaf or not."""

    supports_higher_order_operators = True

    def __init__(self, trace):
        super().__init__()
        self.trace, self.roots = trace, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for a in pytree.tree_leaves((args, kwargs)):
            if isinstance(a, JaxTensor):
                r = root(a)
                data = root_data(r)
                if id(r) not in self.roots and not (
                    isinstance(data, Tracer) and getattr(data, "_trace", None) is self.trace
                ):
                    self.roots[id(r)] = r
        if func in _KERNELS:  # a control-flow op inside the body (under `inference_mode`)
            return _KERNELS[func](*args, **kwargs)
        return func(*args, **kwargs)


# ---- a body traced once -------------------------------------------------------------------------
@dataclasses.dataclass(eq=False)
class _Body:
    """A torch callable traced into a jaxpr: `body(consts, arrays) -> list of output arrays`."""

    jaxpr: Any
    consts: list
    out_spec: Any  # torch pytree spec of the callable's output
    out_leaves: list  # `_TENSOR` where a tensor goes, else the static value
    out_dtypes: list[torch.dtype]
    out_avals: list  # `jax.ShapeDtypeStruct` of each output tensor
    grad_inputs: list[JaxTensor]  # the roots from outside requiring grad that the body reads

    def __call__(self, consts: list, arrays: list) -> list:
        return eval_jaxpr(self.jaxpr, consts, *arrays)

    def const_at(self, value) -> int:
        """The position of `value` (the very object) among the constants; -1 if absent."""
        return next((i for i, c in enumerate(self.consts) if c is value), -1)


_Spec = tuple[jax.ShapeDtypeStruct, torch.dtype, bool]  # an input's array type, torch dtype, requires_grad


def _spec(t: JaxTensor, drop_first: bool = False) -> _Spec:
    a = t._raw()
    shape = tuple(a.shape[1:]) if drop_first else tuple(a.shape)
    return jax.ShapeDtypeStruct(shape, a.dtype), t.dtype, t.requires_grad


def _trace(fn: Callable[[list], Any], specs: list[_Spec], where: str, grad_on: bool) -> _Body:
    """Trace `fn(inner_tensors)` into a `_Body`; refuse (ControlFlowError) what one lax op cannot carry."""
    info: dict[str, Any] = {}

    def region(*arrays):
        trace = trace_ctx.trace
        inner = [labelled(a, d) for a, (_, d, _) in zip(arrays, specs)]
        guard = _Guard(trace, inner, where)
        stack = _guards.__dict__.setdefault("stack", [])
        stack.append(guard)
        reads = _Reads(trace)
        probe = jax.random.key(0)  # (a random op in the body would draw from it, and not from the call's key)
        try:
            with _writes.checking(guard), reads, _random.key_scope(probe) as cell:
                out = fn(list(inner))
        finally:
            stack.remove(guard)
        if cell is not None and cell[0] is not probe:
            raise ControlFlowError(
                where,
                "draws random numbers (dropout, `torch.rand`, ...)",
                "Draw them before the call and pass them in as an operand (a carry, an `xs` entry), or turn "
                "dropout off (`model.eval()`)",
            )
        leaves, info["out_spec"] = pytree.tree_flatten(out)
        tensors = [o for o in leaves if isinstance(o, torch.Tensor)]
        mine = {id(x) for x in inner}
        for o in tensors:
            if not isinstance(o, JaxTensor):
                raise ControlFlowError(where, "returns a tensor not on the jax device", "Create it on the jax device")
            if id(root(o)) in mine:
                raise ControlFlowError(where, "returns (a view of) one of its inputs", "Return a `.clone()` of it")
            data = root_data(o)
            if not (isinstance(data, Tracer) and getattr(data, "_trace", None) is trace):
                raise ControlFlowError(
                    where, "returns (a view of) a tensor from outside the body", "Return a `.clone()` of it"
                )
        info["out_leaves"] = [_TENSOR if isinstance(o, torch.Tensor) else o for o in leaves]
        info["out_dtypes"] = [o.dtype for o in tensors]
        info["grad_inputs"] = [r for r in reads.roots.values() if grad_on and r.requires_grad and _float(r.dtype)]
        return [o._raw() for o in tensors if isinstance(o, JaxTensor)]  # (every one: checked above)

    closed, shapes = jax.make_jaxpr(region, return_shape=True)(*[s for s, _, _ in specs])
    body = _Body(
        closed.jaxpr, list(closed.consts), info["out_spec"], info["out_leaves"], info["out_dtypes"],
        [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in shapes], info["grad_inputs"],
    )  # fmt: skip
    for t in body.grad_inputs:
        if body.const_at(t._raw()) < 0:
            raise ControlFlowError(
                where, f"reads a tensor requiring grad (shape {list(t.shape)}) that was not captured as a value",
                "Pass it in as an operand",
            )  # fmt: skip
    return body


def _outputs(body: _Body, tensors) -> Any:
    """The body's output structure with `tensors` where its tensors went."""
    it = iter(tensors)
    return pytree.tree_unflatten([next(it) if x is _TENSOR else x for x in body.out_leaves], body.out_spec)


def _describe(body: _Body) -> str:
    return ", ".join(f"{d} {list(a.shape)}" for d, a in zip(body.out_dtypes, body.out_avals))


# ---- running the lax op, with a torch-autograd node when torch records --------------------------
def _run(
    op: Callable[[list, list], list], inputs: list[JaxTensor], bodies: list[_Body], out_dtypes: list[torch.dtype]
) -> list[JaxTensor]:
    """`op(arrays, consts_per_body) -> out arrays` on the inputs' arrays, as torch tensors.

    When torch's autograd records (an input or a parameter a body reads requires grad), the
    call is one `torch.autograd.Function` whose backward is `jax.vjp` of `op`.
    """
    arrays = [t._raw() for t in inputs]
    consts = [list(b.consts) for b in bodies]
    grad_on = torch.is_grad_enabled()
    arg_diff = [i for i, t in enumerate(inputs) if grad_on and t.requires_grad and _float(t.dtype)]
    extra: dict[int, JaxTensor] = {}
    for b in bodies:
        for t in b.grad_inputs:
            extra.setdefault(id(t), t)
    extra_at = [
        [(j, b.const_at(t._raw())) for j, b in enumerate(bodies) if b.const_at(t._raw()) >= 0] for t in extra.values()
    ]

    def call() -> tuple[tuple, Callable]:
        outs = op(arrays, consts)
        return tuple(labelled(o, d) for o, d in zip(outs, out_dtypes)), backward

    def f(d_args: list, d_extra: list) -> list:
        a, c = list(arrays), [list(k) for k in consts]
        for i, v in zip(arg_diff, d_args):
            a[i] = v
        for places, v in zip(extra_at, d_extra):
            for j, k in places:
                c[j][k] = v
        outs = op(a, c)
        return [outs[j] for j, d in enumerate(out_dtypes) if _float(d)]

    def backward(cts: list) -> list:
        floats = [j for j, d in enumerate(out_dtypes) if _float(d)]
        d_args = [arrays[i] for i in arg_diff]
        d_extra = [t._raw() for t in extra.values()]
        outs, pull = jax.vjp(f, d_args, d_extra)
        cts = [jnp.zeros_like(o) if cts[j] is None else cts[j].astype(o.dtype) for j, o in zip(floats, outs)]
        return [g for part in pull(cts) for g in part]

    diff = [inputs[i] for i in arg_diff] + list(extra.values())
    return list(_Remat.apply(call, *diff) if diff else call()[0])


def _settle(tensors: list) -> None:
    """Lazily, compute the pending values first: the bodies are traced on real arrays (a sync)."""
    if _lazy.is_enabled() and any(type(t._raw()) is _lazy.LazyArray for t in tensors if isinstance(t, JaxTensor)):
        _lazy.sync("a control-flow op (torch.cond / while_loop / scan) reads pending values")


def _jax_tensors(leaves: list, where: str) -> list[JaxTensor]:
    for x in leaves:
        if not isinstance(x, JaxTensor):
            raise ControlFlowError(
                where,
                f"takes {type(x).__name__} {x!r:.40} among its inputs",
                "Pass tensors on the jax device only (make a Python number a 0-d tensor)",
            )
    return leaves


# ---- cond -----------------------------------------------------------------------------------------
def cond(pred, true_fn: Callable, false_fn: Callable, operands) -> Any:
    """`torch.cond` on the jax device: one `lax.cond` of the two traced branches.

    Example: `cond(x.sum() > 0, torch.sin, torch.cos, (x,))`.
    """
    if isinstance(pred, (bool, int)):
        return (true_fn if pred else false_fn)(*operands)
    leaves, spec = pytree.tree_flatten(tuple(operands))
    _jax_tensors([pred, *leaves], "torch.cond")
    _settle([pred, *leaves])
    grad_on = torch.is_grad_enabled()
    specs = [_spec(t) for t in leaves]

    def branch(fn: Callable) -> Callable[[list], Any]:
        return lambda xs: fn(*pytree.tree_unflatten(xs, spec))

    bodies = [
        _trace(branch(fn), specs, f"torch.cond's {name}", grad_on)
        for fn, name in ((true_fn, "true_fn"), (false_fn, "false_fn"))
    ]
    t, f = bodies
    if t.out_spec != f.out_spec or t.out_leaves != f.out_leaves or _describe(t) != _describe(f):
        raise ControlFlowError(
            "torch.cond's branches",
            f"return different things (true_fn: {t.out_spec}: {_describe(t)}; false_fn: {f.out_spec}: {_describe(f)})",
            "Make both branches return the same structure of tensors with the same shapes and dtypes",
        )
    p = pred._raw().reshape(())
    p = p if p.dtype == jnp.bool_ else p != 0

    def op(arrays: list, consts: list) -> list:
        return jax.lax.cond(p, lambda a, c: t(c[0], a), lambda a, c: f(c[1], a), arrays, consts)

    return _outputs(t, _run(op, leaves, bodies, t.out_dtypes))


# ---- while_loop -----------------------------------------------------------------------------------
def _float0(x):
    return np.zeros(jnp.shape(x), dtype=jax.dtypes.float0)


def _while(cond_b: _Body, body_b: _Body, carry: list, consts: list) -> list:
    """`lax.while_loop` of the traced bodies, with a reverse-mode rule (`lax.while_loop` has none):
    the backward recomputes each iteration's carry from the start and pulls the cotangent back
    through it (no carry is stored; the backward costs n^2/2 body calls for n iterations)."""

    def step(k: list, c: list) -> list:
        return body_b(k[1], c)

    def go_on(k: list, c: list):
        return cond_b(k[0], c)[0]

    @jax.custom_vjp
    def loop(carry: list, consts: list) -> list:
        return jax.lax.while_loop(lambda c: go_on(consts, c), lambda c: step(consts, c), carry)

    def fwd(carry: list, consts: list):
        n, out = jax.lax.while_loop(
            lambda s: go_on(consts, s[1]), lambda s: (s[0] + 1, step(consts, s[1])), (jnp.int32(0), carry)
        )
        return out, (carry, consts, n)

    def bwd(res, ct: list):
        carry0, consts, n = res
        fc = [_inexact(x) for x in carry0]
        fk = [[_inexact(x) for x in k] for k in consts]

        def pull_one(c_i: list, ct_c: list):
            def g(dc: list, dk: list) -> list:
                c = [dc.pop(0) if m else x for m, x in zip(fc, c_i)]
                k = [[dk.pop(0) if m else x for m, x in zip(ms, part)] for ms, part in zip(fk, consts)]
                return [o for m, o in zip(fc, step(k, c)) if m]

            dc0 = [x for m, x in zip(fc, c_i) if m]
            dk0 = [x for ms, part in zip(fk, consts) for m, x in zip(ms, part) if m]
            _, pull = jax.vjp(g, dc0, dk0)
            return pull([x for m, x in zip(fc, ct_c) if m])

        def back(j, acc):
            ct_c, ct_k = acc
            c_i = jax.lax.fori_loop(0, n - 1 - j, lambda _, c: step(consts, c), list(carry0))
            dc, dk = pull_one(c_i, ct_c)
            it = iter(dc)
            new_c = [next(it) if m else x for m, x in zip(fc, ct_c)]
            return new_c, jax.tree_util.tree_map(operator.add, ct_k, dk)

        ct_c0 = [x if m else _float0(c0) for m, x, c0 in zip(fc, ct, carry0)]
        ct_k0 = [jnp.zeros_like(x) for ms, part in zip(fk, consts) for m, x in zip(ms, part) if m]
        ct_c, ct_k = jax.lax.fori_loop(0, n, back, (ct_c0, ct_k0))
        it = iter(ct_k)
        d_consts = [[next(it) if m else _float0(x) for m, x in zip(ms, part)] for ms, part in zip(fk, consts)]
        return [x if m else _float0(c) for m, x, c in zip(fc, ct_c, carry0)], d_consts

    loop.defvjp(fwd, bwd)
    return loop(carry, consts)


def while_loop(cond_fn: Callable, body_fn: Callable, carried_inputs, additional_inputs=(), **kwargs) -> Any:
    """`torch._higher_order_ops.while_loop` on the jax device: one `lax.while_loop`.

    Example: `while_loop(lambda i, x: i < 3, lambda i, x: (i + 1, x * 2), (torch.tensor(0), x))`.
    """
    if kwargs.get("stack_output"):
        raise ControlFlowError("while_loop", "was asked to stack its outputs", "Use `scan` for stacked outputs")
    carry = _jax_tensors(list(carried_inputs), "while_loop's carried_inputs")
    extra = _jax_tensors(list(additional_inputs), "while_loop's additional_inputs")
    _settle(carry + extra)
    grad_on = torch.is_grad_enabled()
    specs = [_spec(t) for t in carry]
    n = len(carry)

    def with_extra(fn):  # (`additional_inputs` are read as constants of the bodies)
        return lambda xs: fn(*xs, *extra)

    c = _trace(with_extra(cond_fn), specs, "while_loop's cond_fn", grad_on)
    if c.out_leaves != [_TENSOR] or c.out_dtypes != [torch.bool] or c.out_avals[0].shape != ():
        raise ControlFlowError(
            "while_loop's cond_fn", "does not return one boolean 0-d tensor", "Return e.g. `(i < n)` or `x.sum() > 0`"
        )
    b = _trace(with_extra(body_fn), specs, "while_loop's body_fn", grad_on)
    want = [(t.dtype, tuple(s.shape)) for t, (s, _, _) in zip(carry, specs)]
    got = [(d, tuple(a.shape)) for d, a in zip(b.out_dtypes, b.out_avals)]
    if b.out_leaves != [_TENSOR] * n or got != want:
        raise ControlFlowError(
            "while_loop's body_fn",
            f"changes the carry ({', '.join(f'{d} {list(s)}' for d, s in want)} -> {_describe(b) or b.out_leaves})",
            "Return a tuple of tensors with the shapes and dtypes of `carried_inputs`",
        )

    def op(arrays: list, consts: list) -> list:
        return _while(c, b, arrays, consts)

    return tuple(_run(op, carry, [c, b], [t.dtype for t in carry]))


# ---- scan and map -----------------------------------------------------------------------------------
def _scan(fn: Callable[[list, list], Any], init: list[JaxTensor], xs: list[JaxTensor], where: str):
    """`lax.scan` of `fn(carry_tensors, x_tensors) -> (next_carry tree, y tree)` over dim 0 of `xs`;
    returns the body and the output tensors (the carry, then the stacked ys)."""
    if not xs or any(x.dim() == 0 or x.shape[0] == 0 for x in xs) or len({x.shape[0] for x in xs}) != 1:
        raise ControlFlowError(
            where,
            f"scans over {[list(x.shape) for x in xs]}",
            "Give it at least one tensor, all with the same non-zero length in the scanned dimension",
        )
    _settle(init + xs)
    grad_on = torch.is_grad_enabled()
    specs = [_spec(t) for t in init] + [_spec(x, drop_first=True) for x in xs]
    n = len(init)
    body = _trace(lambda ts: fn(ts[:n], ts[n:]), specs, where, grad_on)
    return body, n


def scan(combine_fn: Callable, init, xs, additional_inputs=()) -> Any:
    """The `scan` HOP on the jax device (what `torch._higher_order_ops.scan` calls): one `lax.scan`.

    Example: `scan(lambda c, x: (c + x, c * 2), torch.zeros(3), xs)` gives `(carry, ys)`.
    """
    init_l = _jax_tensors(list(init), "scan's init")
    xs_l = _jax_tensors(list(xs), "scan's xs")
    extra = list(additional_inputs)
    body, n = _scan(lambda c, x: combine_fn(*c, *x, *extra), init_l, xs_l, "scan's combine_fn")
    out = _outputs(body, range(len(body.out_dtypes)))
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise ControlFlowError("scan's combine_fn", "does not return a pair (next_carry, y)", "Return `(carry, y)`")
    carry_leaves, _ = pytree.tree_flatten(out[0])
    got = [(body.out_dtypes[i], tuple(body.out_avals[i].shape)) for i in carry_leaves if isinstance(i, int)]
    want = [(t.dtype, tuple(t.shape)) for t in init_l]
    if len(carry_leaves) != n or got != want or carry_leaves != list(range(n)):
        raise ControlFlowError(
            "scan's combine_fn",
            f"changes the carry ({', '.join(f'{d} {list(s)}' for d, s in want)} -> {got})",
            "Return a next carry with the structure, shapes and dtypes of `init`",
        )

    def op(arrays: list, consts: list) -> list:
        def step(c, x):
            outs = body(consts[0], list(c) + list(x))
            return outs[:n], outs[n:]

        carry, ys = jax.lax.scan(step, arrays[:n], arrays[n:])
        return list(carry) + list(ys)

    tensors = _run(op, init_l + xs_l, [body], body.out_dtypes)
    return _outputs(body, tensors)


def map_(f: Callable, xs, pos_args) -> Any:
    """The `map_impl` HOP on the jax device (what `torch._higher_order_ops.map` calls): a `lax.scan`
    without a carry.

    Example: `map_(lambda x, w: x * w, [xs], [w])` stacks `xs[i] * w`.
    """
    xs_l = _jax_tensors(list(xs), "map's xs")
    args = list(pos_args)
    body, _ = _scan(lambda c, x: f(*x, *args), [], xs_l, "map's f")

    def op(arrays: list, consts: list) -> list:
        _, ys = jax.lax.scan(lambda c, x: (c, body(consts[0], list(x))), (), arrays)
        return list(ys)

    return _outputs(body, _run(op, xs_l, [body], body.out_dtypes))


# ---- routing the HOPs -------------------------------------------------------------------------------
_KERNELS: dict[Any, Callable] = {cond_op: cond, while_loop_op: while_loop, scan_op: scan, map_impl: map_}


def _under_a_mode(wrapper: Callable, mode_cls: type) -> Callable:
    """`wrapper` (torch's `torch.cond`, `torch.while_loop`), run under `mode_cls` when it gets a jax
    tensor and no dispatch mode is on: torch's wrapper calls `torch.compile`, which refuses a jax
    tensor but skips its frame (running the HOP, hence the kernels here) when a dispatch mode is on."""

    def run(*args, **kwargs):
        if python_dispatch_stack_len() == 0 and any(
            isinstance(a, JaxTensor) for a in pytree.tree_leaves((args, kwargs))
        ):
            with mode_cls():
                return wrapper(*args, **kwargs)
        return wrapper(*args, **kwargs)

    run.__wrapped__ = run.jaxtorch_wraps = wrapper  # type: ignore[attr-defined]
    run.__name__, run.__doc__, run.__module__ = wrapper.__name__, wrapper.__doc__, wrapper.__module__
    return run


def install(mode_cls: type) -> None:
    """Give each control-flow HOP its jax-device kernel: above autograd (`AutogradPrivateUse1`) and at
    the Python key for `mode_cls` (jaxtorch's dispatch mode) and `JaxTensor`; and let `torch.cond` /
    `torch.while_loop` take jax tensors with no mode on (`_under_a_mode`). Idempotent."""
    for name in ("cond", "while_loop"):
        public = getattr(torch, name)
        if not hasattr(public, "jaxtorch_wraps"):
            setattr(torch, name, _under_a_mode(public, mode_cls))
    for hop, run in _KERNELS.items():
        if DispatchKey.AutogradPrivateUse1 in hop.py_kernels:
            continue
        # torch runs an eager HOP call inside `torch.compile`'s frame hook: the kernel and what it calls
        # are never compiled by dynamo (the bodies run as torch code on jax tensors, traced by JAX)
        kernel = torch.compiler.disable(run)
        hop.py_impl(DispatchKey.AutogradPrivateUse1)(kernel)
        hop.py_impl(JaxTensor)(kernel)
        hop.py_impl(mode_cls)(torch.compiler.disable(lambda mode, *args, _k=run, **kwargs: _k(*args, **kwargs)))
