"""Remat (activation checkpointing) under a JAX trace: a checkpointed region becomes one `jax.checkpoint`.

When `torch.utils.checkpoint.checkpoint(fn, *args)` (or Hugging Face's
`activation_checkpointing_enable()`, which calls it) runs on jax tensors holding traced values
(inside `jaxtorch.jit`/`compile`, an `extract`ed function under `jax.jit`/`jax.grad`,
`make_train_step`), `fn` is traced once into a jaxpr and the program runs `jax.checkpoint` of
that jaxpr, so only the region's inputs are kept for the backward:

- when JAX differentiates the program (`jax.grad` of an extracted function, a compiled
  call's VJP), it sees the remat itself;
- when torch's autograd records inside the program (`loss.backward()` inside
  `jaxtorch.jit`), the region is one `torch.autograd.Function` whose inputs are the tensor
  arguments and the tensors the region reaches that require grad (the parameters, found
  in the region's autograd graph). Its backward runs `jax.vjp` of the checkpointed region,
  which recomputes the forward behind an `optimization_barrier`.

The region's random ops draw from the call's key, passed in, so the recomputation replays
the forward's draws. Writes the region makes to tensors from outside it (BatchNorm's running
statistics) come out of it and land after it. A region that closes over a tensor with an
autograd history from outside it (not an argument, not a leaf) runs torch's own checkpoint,
as do eager and lazy values (`_remat_torch`).

Example:
    ```python
    @jaxtorch.jit
    def step(model, ids):
        loss = model(input_ids=ids, labels=ids).loss   # after model.activation_checkpointing_enable()
        loss.backward()                                # each layer is a jax.checkpoint
        return loss
    ```
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import torch
from torch.autograd.function import once_differentiable

from ..._compat import autograd_sequence_nr, eval_jaxpr, trace_ctx, trace_state_clean
from ..._compat import torch_pytree as pytree
from ..core import _lazy, _random, _tracing
from ..tensor._tensor import JaxTensor, labelled, root, root_data, set_root_data, was_written, write
from . import _writes

FALLBACK = object()  # what `remat` returns when torch's own checkpoint must run instead
_TENSOR = object()  # marks where a tensor goes among a region's output leaves


def applies(args: tuple, kwargs: dict) -> bool:
    """Whether a checkpoint call with these arguments runs as `jax.checkpoint`: its tensor
    arguments are all jax tensors, none pending (lazy), and a JAX trace is in progress."""
    found = False
    for a in pytree.tree_leaves((args, kwargs)):
        if isinstance(a, torch.Tensor):
            if not isinstance(a, JaxTensor) or type(a._raw()) is _lazy.LazyArray:
                return False
            found = True
    return found and not trace_state_clean()


# ---- writes to tensors from outside the region ----------------------------------------------
class _Writes:
    """A write check recording, at its first write in the region, each root from outside
    the region (its data is not a value of the region's own trace) and the data it had."""

    def __init__(self, trace):
        self.trace, self.thread = trace, threading.get_ident()
        self.roots: dict[int, tuple[JaxTensor, Any, tuple]] = {}

    def made_here(self, data) -> bool:
        """Whether `data` is a value of the region's own trace."""
        return _writes.made_in(data, self.trace)

    def __call__(self, t: torch.Tensor) -> None:
        if not isinstance(t, JaxTensor) or threading.get_ident() != self.thread:
            return  # (a CPU tensor: the write rule's; another thread's write)
        r = root(t)
        if id(r) in self.roots:
            return
        old = root_data(r)
        if self.made_here(old):
            return  # made inside the region
        self.roots[id(r)] = (r, old, tuple(r.shape))

    def take(self) -> list[tuple[JaxTensor, Any, Any]]:
        """Each written root with its old data and its new data (a value of the region); the
        old data is put back."""
        out = []
        for r, old, shape in self.roots.values():
            if tuple(r.shape) != shape:
                raise RuntimeError(
                    f"jaxtorch: a checkpointed region changed the shape of a tensor from outside it "
                    f"({list(shape)} -> {list(r.shape)}); resize it outside the checkpointed function."
                )
            out.append((r, old, root_data(r)))
            set_root_data(r, old)
        return out


# ---- the tensors requiring grad that the region reaches -------------------------------------
def _grad_inputs(outs: list, inner: list, start: int) -> list[JaxTensor] | None:
    """The leaf tensors from outside the region that its outputs' autograd graph reaches (the
    region's own input leaves `inner` excluded); None when the graph leaves the region through
    a node made before it (`start`, a sequence number: a non-leaf tensor from outside), or
    holds a module's backward hook (torch's backward must run the region's own graph)."""
    inner_ids = {id(x) for x in inner}
    found: dict[int, JaxTensor] = {}
    seen: set[int] = set()
    stack = [o.grad_fn for o in outs if o.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        var = getattr(node, "variable", None)  # an AccumulateGrad node: a leaf
        if var is not None:
            if id(var) not in inner_ids:
                found[id(var)] = var
            continue
        if node._sequence_nr() < start or node.name().startswith("BackwardHookFunction"):
            return None
        stack.extend(n for n, _ in node.next_functions)
    return list(found.values())


# ---- autograd hooks registered inside a region ----------------------------------------------
_hooks = threading.local()  # `.regions`: one flag per region being traced in this thread


def _noting(method: Callable) -> Callable:
    def noted(self, *args, **kwargs):
        regions = getattr(_hooks, "regions", None)
        if regions:
            regions[-1] = True
        return method(self, *args, **kwargs)

    noted.__name__, noted.__doc__, noted.__wrapped__ = method.__name__, method.__doc__, method  # type: ignore[attr-defined]
    return noted


def install() -> None:
    """Note `register_hook`/`retain_grad` calls made while a region is traced: a hook on a
    tensor inside a region needs torch's backward through the region's own graph (idempotent)."""
    for name in ("register_hook", "retain_grad"):
        method = getattr(torch.Tensor, name)
        if not hasattr(method, "__wrapped__"):
            setattr(torch.Tensor, name, _noting(method))


# ---- the traced region ------------------------------------------------------------------------
@dataclasses.dataclass(eq=False)
class _Region:
    """A checkpointed function traced once: `jaxpr(arrays, key, consts) -> (outs, key, written)`."""

    jaxpr: Any
    consts: list
    out_tree: Any
    out_spec: Any
    out_leaves: list  # the region's output leaves: `_TENSOR` where a tensor goes, else the static value
    out_dtypes: list[torch.dtype]
    out_shapes: list  # `jax.ShapeDtypeStruct` of each output tensor
    written: list[tuple[JaxTensor, Any]]  # the roots from outside it that the region writes, with the data they had
    grad_inputs: list[JaxTensor]
    torchs_way: str | None  # why torch's checkpoint must run the region instead (None: it need not)

    def __post_init__(self) -> None:
        self._const_at = {id(c): i for i, c in enumerate(self.consts)}

    def const_at(self, value) -> int:
        """The position of `value` (the very object) among the region's constants; -1 if absent."""
        return self._const_at.get(id(value), -1)

    def __call__(self, arrays: list, key, consts: list):
        flat = jax.tree_util.tree_leaves((arrays, key))
        out = eval_jaxpr(self.jaxpr, consts, *flat)
        return jax.tree_util.tree_unflatten(self.out_tree, out)

    def run(self, arrays: list, key, consts: list):
        return jax.checkpoint(self)(arrays, key, consts)


def _trace(function: Callable, flat: list, spec, at: list[int], key, grad_on: bool) -> _Region:
    inputs = [flat[i] for i in at]
    info: dict[str, Any] = {}

    def region(arrays, key):
        trace = trace_ctx.trace
        start = autograd_sequence_nr()  # (autograd nodes made from here on are the region's)
        inner = [labelled(a, t.dtype) for a, t in zip(arrays, inputs)]
        given: list[torch.Tensor] = list(inner)  # what the function gets: a non-leaf argument requiring grad stays one
        for j, (x, t) in enumerate(zip(inner, inputs)):
            if grad_on and t.requires_grad:
                x.requires_grad_(True)
                if not t.is_leaf:
                    given[j] = x.clone()
        leaves = list(flat)
        for i, g in zip(at, given):
            leaves[i] = g
        args, kwargs = pytree.tree_unflatten(leaves, spec)
        writes = _Writes(trace)
        regions = _hooks.__dict__.setdefault("regions", [])
        regions.append(False)
        try:
            with _writes.checking(writes), _random.key_scope(key) as cell:
                out = function(*args, **kwargs)
        finally:
            written = writes.take()
            hooked = regions.pop()
        out_leaves, info["out_spec"] = pytree.tree_flatten(out)
        if any(isinstance(o, torch.Tensor) and not isinstance(o, JaxTensor) for o in out_leaves):
            raise TypeError("jaxtorch: a checkpointed function returned a tensor not on the jax device.")
        tensors = [o for o in out_leaves if isinstance(o, JaxTensor)]
        info["out_leaves"] = [_TENSOR if isinstance(o, torch.Tensor) else o for o in out_leaves]
        info["out_dtypes"] = [o.dtype for o in tensors]
        info["written"] = [(r, old) for r, old, _ in written]
        info["grad_inputs"] = _grad_inputs(tensors, inner, start) if grad_on else []
        info["torchs_way"] = _torchs_way(tensors, inner + given, writes, hooked and grad_on, info["grad_inputs"])
        return [o._raw() for o in tensors], (cell[0] if cell is not None else None), [v for _, _, v in written]

    closed, shapes = jax.make_jaxpr(region, return_shape=True)([t._raw() for t in inputs], key)
    return _Region(
        closed.jaxpr, list(closed.consts), jax.tree_util.tree_structure(shapes), info["out_spec"],
        info["out_leaves"], info["out_dtypes"], shapes[0], info["written"], info["grad_inputs"] or [],
        info["torchs_way"],
    )  # fmt: skip


def _torchs_way(tensors: list, inner: list, writes: _Writes, hooked: bool, grad_inputs) -> str | None:
    """Why the traced region cannot be a `jax.checkpoint` with eager torch's semantics (None: it
    can). `inner`: the region's argument tensors (and the non-leaf copies the function got)."""
    mine = {id(x) for x in inner}
    roots = [id(root(o)) for o in tensors]
    if any(r in mine for r in roots) or not all(writes.made_here(root_data(o)) for o in tensors):
        return "a result is (a view of) an argument or a tensor from outside"
    if len(set(roots)) != len(roots):
        return "two results share data"
    if any(was_written(x) for x in inner):
        return "an argument is written in place"
    if hooked:
        return "a tensor inside has an autograd hook or retains its grad"
    if grad_inputs is None:
        return "the autograd graph reaches a non-leaf tensor from outside, or a module's backward hook"
    return None


def _float(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


def _vjp(region: _Region, arrays: list, key, arg_diff: list[int], const_diff: list[int]) -> Callable:
    """The region's backward: cotangents of its outputs (None: zero) -> gradients of its
    differentiable inputs (the arguments `arg_diff`, then the constants `const_diff`), by
    `jax.vjp` of the region recomputed from its inputs.

    As torch's recomputation does, it reads the current data of the tensors the region
    writes and writes them again (BatchNorm's running statistics are updated twice:
    pytorch/pytorch#96136), with the forward's random numbers.
    """
    float_out = [j for j, d in enumerate(region.out_dtypes) if _float(d)]
    reread = [(r, region.const_at(old)) for r, old in region.written if region.const_at(old) >= 0]

    def f(d_args: list, d_consts: list, state: list) -> tuple[list, list]:
        a, c = list(arrays), list(region.consts)
        for (_, i), v in zip(reread, state):
            c[i] = v
        for i, v in zip(arg_diff, d_args):
            a[i] = v
        for i, v in zip(const_diff, d_consts):
            c[i] = v
        outs, _, written = region(a, key, c)
        return [outs[j] for j in float_out], written

    def backward(cts: list) -> list:
        d_args, d_consts = [arrays[i] for i in arg_diff], [region.consts[i] for i in const_diff]
        state = [root_data(r) for r, _ in reread]
        shapes = [region.out_shapes[j] for j in float_out]
        cts = [
            jnp.zeros(o.shape, o.dtype) if cts[j] is None else cts[j].astype(o.dtype) for j, o in zip(float_out, shapes)
        ]
        # the recomputation's inputs pass a barrier with the cotangents: XLA can neither merge it
        # with the forward (which would keep the forward's activations alive) nor run it early
        d_args, d_consts, state, cts = jax.lax.optimization_barrier((d_args, d_consts, state, cts))
        _, pull, written = jax.vjp(lambda a, c: f(a, c, state), d_args, d_consts, has_aux=True)
        for (r, _), v in zip(region.written, written):
            write(r, v)
        return [g for part in pull(cts) for g in part]

    return backward


class _Remat(torch.autograd.Function):
    """The region as one autograd node: forward runs it checkpointed, backward its VJP."""

    @staticmethod
    def forward(ctx, call: Callable, *diff):
        results, ctx.vjp = call()
        ctx.dtypes = [t.dtype for t in diff]
        ctx.mark_non_differentiable(*[r for r in results if not _float(r.dtype)])
        return results

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        with _tracing.adopted():
            gs = ctx.vjp([None if g is None else g._raw() for g in grads])
            return (None, *(labelled(g, d) for g, d in zip(gs, ctx.dtypes)))


def remat(function: Callable, args: tuple, kwargs: dict, *, reentrant: bool) -> Any:
    """Run `function(*args, **kwargs)` as a `jax.checkpoint` region (see the module docstring);
    returns `FALLBACK` when torch's own checkpoint must run it instead."""
    flat, spec = pytree.tree_flatten((args, kwargs))
    at = [i for i, a in enumerate(flat) if isinstance(a, JaxTensor)]
    inputs = [flat[i] for i in at]
    grad_on = torch.is_grad_enabled()
    stack = getattr(_random._local, "stack", None)
    cell = stack[-1] if stack and stack[-1][0] is not None else None
    key = None if cell is None else cell[0]
    region = _trace(function, flat, spec, at, key, grad_on)
    if region.torchs_way is not None:
        return FALLBACK
    if reentrant and region.grad_inputs and not any(t.requires_grad for t in inputs):
        return FALLBACK  # torch's reentrant checkpoint: no input requires grad, so the region gives no gradients
    const_diff = [region.const_at(t._raw()) for t in region.grad_inputs]
    if -1 in const_diff:
        return FALLBACK  # a tensor the graph reaches is not a value the region read: torch's way
    arrays = [t._raw() for t in inputs]
    arg_diff = [i for i, t in enumerate(inputs) if grad_on and t.requires_grad and _float(t.dtype)]
    held: dict[str, Any] = {}

    def call() -> tuple[tuple, Callable]:
        outs, held["key"], held["written"] = region.run(arrays, key, region.consts)
        results = tuple(labelled(o, d) for o, d in zip(outs, region.out_dtypes))
        return results, _vjp(region, arrays, key, arg_diff, const_diff)

    diff = [inputs[i] for i in arg_diff] + region.grad_inputs
    tensors = _Remat.apply(call, *diff) if diff else call()[0]
    if cell is not None:
        cell[0] = held["key"]
    for (r, _), v in zip(region.written, held["written"]):
        write(r, v)
    it = iter(tensors)
    leaves = [next(it) if leaf is _TENSOR else leaf for leaf in region.out_leaves]
    return pytree.tree_unflatten(leaves, region.out_spec)
