"""`torch.autograd.Function` under a JAX transformation: a `jax.custom_vjp` whose backward is the
Function's own `backward`, run through the interpreter.

When JAX differentiates torch code (`jax.grad` of `extract`'s fn or of `call_torch`,
`make_train_step`, a `jaxtorch.compile`d module's backward), torch's autograd records nothing,
so a Function's `backward` would never run and JAX would differentiate its `forward` instead
(a straight-through estimator, a gradient reversal or a clipped gradient silently lost). Here
`Function.apply` on traced jax tensors that torch does not record becomes one
`jax.custom_vjp`:

- forward: the Function's `forward` (and `setup_context`) under `no_grad`, as torch runs it; the
  tensors given to `ctx.save_for_backward` and the tensors set as `ctx` attributes are the
  residuals, the other attributes are kept as they are;
- backward: the Function's `backward(ctx, *grads)` on those residuals, with `ctx.saved_tensors`,
  `ctx.needs_input_grad` (which inputs JAX differentiates), `None` gradients (zeros),
  `mark_non_differentiable`, `set_materialize_grads(False)` (`None` for unused outputs) and
  `mark_dirty` (the input is written with the output); its own ops are differentiable, so
  `jax.hessian` works where torch's `backward` is itself differentiable, and a
  `@once_differentiable` backward refuses second order as torch does.

Everywhere else (eager and lazy tensors, `loss.backward()` under `jaxtorch.jit`, where torch's
autograd records the Function itself) torch's own `apply` runs.

Example:
    ```python
    class Reverse(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            return -g

    jax.grad(lambda a: jaxtorch.call_torch(lambda t: Reverse.apply(t).sum(), a))(x)  # -1 everywhere
    ```
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.custom_derivatives import SymbolicZero

from ..._compat import Tracer, default_setup_context
from ..._compat import torch_pytree as pytree
from ..core._autodiff import differentiated_by_jax, stop_gradient
from ..core._errors import OnceDifferentiableError
from ..tensor._tensor import JaxTensor, labelled, set_same_data, write

_Tracer = Tracer
_Function = torch.autograd.Function
# torch's own `apply`: a Python classmethod in torch 2.13, a C `classmethod_descriptor` in 2.14
_TORCH_APPLY = _Function.__dict__["apply"]


def _torch_apply(cls, *args, **kwargs):
    """torch's own `Function.apply`, bound to `cls` (whichever kind of classmethod this torch has)."""
    return _TORCH_APPLY.__get__(None, cls)(*args, **kwargs)


def _traced_untracked(args) -> bool:
    """Whether torch's autograd will not record this call while JAX may differentiate it: some
    argument is a traced jax tensor, grad mode is on, and no tensor argument requires grad."""
    if not torch.is_grad_enabled():
        return False  # torch records nothing and JAX will not differentiate (`no_grad` results are stopped)
    traced = False
    for a in args:
        if isinstance(a, torch.Tensor):
            if a.requires_grad:
                return False  # torch's autograd records it (`loss.backward()` under `jaxtorch.jit`)
            if isinstance(a, JaxTensor) and isinstance(a._raw(), _Tracer):
                traced = True
    return traced


def _apply(cls, *args, **kwargs):
    if cls.__module__.startswith("jaxtorch."):  # jaxtorch's own nodes (compiled calls, remat, call_jax)
        return _torch_apply(cls, *args, **kwargs)
    if _traced_untracked(args) or (kwargs and _traced_untracked(tuple(kwargs.values()))):
        return _as_custom_vjp(cls, args, kwargs)
    if differentiated_by_jax() and torch.is_grad_enabled() and _traced(args):
        return _both(cls, args, kwargs)
    return _torch_apply(cls, *args, **kwargs)


def _traced(args) -> bool:
    return any(isinstance(a, JaxTensor) and isinstance(a._raw(), _Tracer) for a in args)


def _both(cls, args: tuple, kwargs: dict):
    """Inside a trace both torch's autograd and JAX differentiate (`core._autodiff.jax_differentiates`):
    torch's `apply` makes the graph node (which results require grad), and its results take the
    values of the `custom_vjp` (what JAX differentiates)."""
    jax_outs = _as_custom_vjp(cls, args, kwargs, write_dirty=False)
    outs = _torch_apply(cls, *args, **kwargs)
    pairs = zip(outs, jax_outs) if isinstance(outs, tuple) else [(outs, jax_outs)]
    for o, j in pairs:
        if isinstance(o, JaxTensor) and isinstance(j, JaxTensor) and o.shape == j.shape:
            set_same_data(o, j.elem)
    return outs


def install() -> None:
    """Route `torch.autograd.Function.apply` through `_apply` (idempotent)."""
    if getattr(_Function.__dict__["apply"], "__func__", None) is not _apply:
        _Function.apply = classmethod(_apply)  # type: ignore[assignment,method-assign]


class _Ctx:
    """The `ctx` a Function's `forward`/`setup_context`/`backward` see under a JAX transformation."""

    def __init__(self, needs_input_grad: tuple[bool, ...]):
        self.needs_input_grad = needs_input_grad
        self.to_save: tuple = ()
        self.non_differentiable: tuple = ()
        self.dirty_tensors: tuple = ()
        self.materialize_grads = True

    def save_for_backward(self, *tensors) -> None:
        self.to_save = tensors

    def save_for_forward(self, *tensors) -> None:
        pass

    @property
    def saved_tensors(self) -> tuple:
        return tuple(self.to_save)

    def mark_non_differentiable(self, *tensors) -> None:
        self.non_differentiable = self.non_differentiable + tensors

    def mark_dirty(self, *tensors) -> None:
        self.dirty_tensors = self.dirty_tensors + tensors

    def set_materialize_grads(self, value: bool) -> None:
        self.materialize_grads = value


def _is_setup_context_defined(cls) -> bool:
    return cls.setup_context is not default_setup_context


def _split_ctx(ctx: _Ctx) -> tuple[list, Any]:
    """`ctx`'s tensors (saved and attributes) as arrays, and how to rebuild it around new arrays."""
    state = dict(vars(ctx))
    leaves, spec = pytree.tree_flatten(state)
    at = [i for i, x in enumerate(leaves) if isinstance(x, JaxTensor)]
    arrays = [leaves[i].elem for i in at]
    dtypes = [leaves[i].dtype for i in at]
    static = [None if i in set(at) else x for i, x in enumerate(leaves)]
    return arrays, (spec, at, dtypes, static)


def _join_ctx(arrays, how, needs) -> _Ctx:
    spec, at, dtypes, static = how
    leaves = list(static)
    for i, a, d in zip(at, arrays, dtypes):
        leaves[i] = labelled(a, d)
    ctx = _Ctx(needs)
    vars(ctx).update(pytree.tree_unflatten(leaves, spec))
    ctx.needs_input_grad = needs
    return ctx


@jax.custom_jvp
def _once(x):
    return x


@_once.defjvp
def _once_jvp(primals, tangents):
    raise OnceDifferentiableError(
        "jaxtorch: a torch.autograd.Function whose backward is @once_differentiable was differentiated twice "
        "(jax.hessian, grad of grad); torch refuses double backward through it too. Write a differentiable "
        "backward (drop @once_differentiable) to take second derivatives."
    )


_ONCE_CODE = torch.autograd.function.once_differentiable(lambda ctx: None).__code__


def _once_if_float(x):
    if isinstance(x, SymbolicZero) or not jnp.issubdtype(x.dtype, np.inexact):
        return x
    return _once(x)


def _as_custom_vjp(cls, args: tuple, kwargs: dict, write_dirty: bool = True):
    setup = _is_setup_context_defined(cls)
    if setup:
        import inspect

        bound = inspect.signature(cls.forward).bind(*args, **kwargs)
        bound.apply_defaults()
        args, kwargs = bound.args, bound.kwargs
    at = [i for i, a in enumerate(args) if isinstance(a, JaxTensor)]
    in_dtypes = [args[i].dtype for i in at]
    in_arrays = [args[i].elem for i in at]
    box: dict[str, Any] = {}

    def run_forward(arrays, needs_tensor: tuple[bool, ...]):
        targs = list(args)
        fresh = []
        for i, a, d in zip(at, arrays, in_dtypes):
            targs[i] = t = labelled(a, d)
            fresh.append(t)
        needs = [False] * len(args)
        for k, (i, n) in enumerate(zip(at, needs_tensor)):
            needs[i] = n
            if (n or args[i].requires_grad) and (in_dtypes[k].is_floating_point or in_dtypes[k].is_complex):
                fresh[k].requires_grad_(True)  # as torch's forward sees it: the inputs autograd differentiates
        ctx = _Ctx(tuple(needs))
        with torch.no_grad():
            if setup:
                out = cls.forward(*targs, **kwargs)
                cls.setup_context(ctx, tuple(targs), out)
            else:
                out = cls.forward(ctx, *targs, **kwargs)
        single = not isinstance(out, tuple)
        outs = (out,) if single else out
        tensor_at = [j for j, o in enumerate(outs) if isinstance(o, torch.Tensor)]
        for j in tensor_at:
            if not isinstance(outs[j], JaxTensor):
                raise TypeError(
                    f"jaxtorch: {cls.__name__}.forward returned a {outs[j].device} tensor under a JAX "
                    "transformation; make its outputs on the inputs' device (the `jax` device)."
                )
        dirty = {id(t) for t in ctx.dirty_tensors}
        box["single"] = single
        box["static_outs"] = [None if j in tensor_at else o for j, o in enumerate(outs)]
        box["tensor_at"] = tensor_at
        box["out_dtypes"] = [outs[j].dtype for j in tensor_at]
        box["out_shapes"] = [tuple(outs[j].shape) for j in tensor_at]
        nondiff = {id(t) for t in ctx.non_differentiable}
        box["nondiff"] = [id(outs[j]) in nondiff for j in tensor_at]
        box["dirty"] = [_position(fresh, outs[j], dirty) for j in tensor_at]
        box["materialize"] = ctx.materialize_grads
        arrays_out = tuple(outs[j].elem for j in tensor_at)
        return arrays_out, ctx

    def primal(*arrays):
        arrays_out, _ = run_forward(arrays, tuple(True for _ in arrays))
        return arrays_out

    f = jax.custom_vjp(primal)

    def fwd(*primals):
        values = [p.value for p in primals]
        needs = tuple(bool(p.perturbed) for p in primals)
        arrays_out, ctx = run_forward(values, needs)
        saved = ctx.to_save
        ctx.to_save = ()
        saved_arrays = [s.elem if isinstance(s, JaxTensor) else None for s in saved]
        box["saved_static"] = [None if isinstance(s, JaxTensor) else s for s in saved]
        box["saved_dtypes"] = [s.dtype if isinstance(s, JaxTensor) else None for s in saved]
        ctx_arrays, how = _split_ctx(ctx)
        box["ctx"] = how
        box["needs"] = ctx.needs_input_grad
        return arrays_out, ([a for a in saved_arrays if a is not None], ctx_arrays)

    def bwd(res, cts):
        saved_arrays, ctx_arrays = res
        if getattr(cls.backward, "__code__", None) is _ONCE_CODE:  # differentiating this backward must raise
            saved_arrays, ctx_arrays, cts = jax.tree_util.tree_map(_once_if_float, (saved_arrays, ctx_arrays, cts))
        ctx = _join_ctx(ctx_arrays, box["ctx"], box["needs"])
        it = iter(saved_arrays)
        ctx.to_save = tuple(
            labelled(next(it), d) if d is not None else s for s, d in zip(box["saved_static"], box["saved_dtypes"])
        )
        grads_out: list = [None] * len(box["static_outs"])
        for j, ct, d, shape in zip(box["tensor_at"], cts, box["out_dtypes"], box["out_shapes"]):
            if isinstance(ct, SymbolicZero) or ct.dtype == jax.dtypes.float0:
                if not box["materialize"]:
                    continue
                ct = jnp.zeros(shape, _jax_dtype_of(d))
            grads_out[j] = labelled(ct, d)
        with torch.enable_grad():
            grads = cls.backward(ctx, *grads_out)
        if not isinstance(grads, tuple):
            grads = (grads,)
        if len(grads) < len(args) or any(g is not None for g in grads[len(args) :]):
            raise RuntimeError(
                f"function {cls.__name__}Backward returned an incorrect number of gradients "
                f"(expected {len(args)}, got {len(grads)})"
            )
        result: list[jax.Array | None] = []
        for i, a in zip(at, in_arrays):
            g = grads[i]
            if g is None or not jnp.issubdtype(a.dtype, np.inexact):
                result.append(None)
                continue
            if not isinstance(g, JaxTensor):
                raise TypeError(
                    f"jaxtorch: {cls.__name__}.backward returned a {type(g).__name__} for input {i}; "
                    "under a JAX transformation it must be a tensor on the `jax` device (or None)."
                )
            ga = g.elem
            if tuple(ga.shape) != tuple(a.shape):
                ga = _sum_to(ga, tuple(a.shape), cls, i)
            ga = ga.astype(a.dtype)
            result.append(ga)
        return tuple(result)

    f.defvjp(fwd, bwd, symbolic_zeros=True)
    arrays_out = f(*in_arrays)
    outs = list(box["static_outs"])
    for k, (j, a, d) in enumerate(zip(box["tensor_at"], arrays_out, box["out_dtypes"])):
        dirty = box["dirty"][k]
        if dirty is not None and write_dirty:  # `mark_dirty`: the input itself is the output, written
            t = args[at[dirty]]
            write(t, a)
            outs[j] = t
        elif box["nondiff"][k]:  # `mark_non_differentiable`: torch gives it no gradient, JAX neither
            outs[j] = labelled(stop_gradient(a), d)
        else:
            outs[j] = labelled(a, d)
    return outs[0] if box["single"] else tuple(outs)


def _position(fresh: list, out, dirty: set) -> int | None:
    """Which input `out` is, when `forward` returned an input it marked dirty (else None)."""
    for k, t in enumerate(fresh):
        if t is out and id(t) in dirty:
            return k
    return None


def _jax_dtype_of(d: torch.dtype):
    from ..core._dtypes import to_jax_dtype

    return to_jax_dtype(d)


def _sum_to(g, shape: tuple, cls, i: int):
    """torch's rule for a gradient of another shape: summed to the input's shape when it broadcasts."""
    try:
        lead = g.ndim - len(shape)
        if lead < 0:
            raise ValueError
        g = g.sum(axis=tuple(range(lead))) if lead else g
        axes = tuple(k for k, (n, m) in enumerate(zip(g.shape, shape)) if n != m)
        if any(shape[k] != 1 for k in axes):
            raise ValueError
        return g.sum(axis=axes, keepdims=True) if axes else g
    except ValueError:
        raise RuntimeError(
            f"Function {cls.__name__}Backward returned an invalid gradient at index {i} - got {list(g.shape)} "
            f"but expected shape compatible with {list(shape)}"
        ) from None
