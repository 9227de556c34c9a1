"""Backward hooks under a JAX transformation: `Tensor.register_hook` and module full backward
hooks (and pre-hooks) see, and may replace, the cotangent JAX computes, as torch's do.

When JAX differentiates torch code, torch's autograd records no graph, so torch's hooks would
never fire. Here each hook point becomes a `jax.custom_vjp` identity whose backward runs the
hooks on the incoming cotangent (as jax tensors) and passes on what they return:

- `t.register_hook(h)` on a traced jax tensor torch does not record: `t`'s data from then on
  goes through the identity (uses of `t` made *before* the hook was registered are not seen:
  register hooks right after making the tensor, as is usual);
- a parameter's hooks registered before `extract` / `torch_module_to_jax`
  (`model.weight.register_hook(h)`): the bound parameter goes through them
  (`hook_parameter`);
- `module.register_full_backward_hook` / `register_full_backward_pre_hook`: torch's own
  `BackwardHook` runs, with its graph node replaced by the identity (`_apply_on_tensors`), so
  the order, the `grad_input`/`grad_output` tuples and the "no input requires grad" case are
  torch's.

Example:
    ```python
    def f(t):
        y = t * 2
        y.register_hook(lambda g: g * 10)
        return y.sum()

    jax.grad(lambda a: jaxtorch.call_torch(f, a))(jnp.ones(3))  # 20 everywhere
    ```
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

import jax
import torch
from jax.custom_derivatives import SymbolicZero

from ..._compat import Tracer, get_backward_hook_apply_on_tensors, set_backward_hook_apply_on_tensors
from ..core._autodiff import differentiated_by_jax
from ..core._errors import HookUnderTraceError
from ..tensor import _device
from ..tensor._device import keep_hook_errors
from ..tensor._tensor import JaxTensor, labelled, root, set_same_data

_Tracer = Tracer
_local = threading.local()


def _traced_float(t) -> bool:
    if not isinstance(t, JaxTensor) or not (t.dtype.is_floating_point or t.dtype.is_complex):
        return False
    return isinstance(t._raw(), _Tracer)


class _Node:
    """What torch's `BackwardHook` registers its hooks on (a `grad_fn` stand-in)."""

    def __init__(self) -> None:
        self.hooks: list[Callable] = []

    def register_hook(self, hook: Callable) -> None:
        self.hooks.append(hook)


def hooked_identity(tensors: list[JaxTensor], run: Callable[[tuple], tuple]) -> tuple[list[JaxTensor], bool]:
    """`tensors` passed through one `jax.custom_vjp` identity whose backward gives the cotangents
    (a tuple of jax tensors, `None` where JAX has a symbolic zero) to `run` and returns what it gives.

    Returns the new tensors, and whether JAX differentiates any of them (known once the forward
    ran: False under a plain `jax.jit`)."""
    dtypes = [t.dtype for t in tensors]
    jax_dtypes = [t.elem.dtype for t in tensors]
    shapes = [tuple(t.shape) for t in tensors]
    box = {"perturbed": False}

    def identity(*arrays):
        return arrays

    f = jax.custom_vjp(identity)

    def fwd(*primals):
        box["perturbed"] = any(bool(p.perturbed) for p in primals)
        return tuple(p.value for p in primals), None

    def bwd(_, cts):
        grads = tuple(None if isinstance(c, SymbolicZero) else labelled(c, d) for c, d in zip(cts, dtypes))
        new = run(grads)
        out: list[jax.Array | None] = []
        for g, jd, shape in zip(new, jax_dtypes, shapes):
            if g is None:
                out.append(None)
                continue
            if not isinstance(g, JaxTensor):
                raise HookUnderTraceError(
                    f"jaxtorch: a backward hook returned a {type(g).__name__} under a JAX transformation; it must "
                    "return a tensor on the `jax` device (or None)."
                )
            a = g.elem
            if tuple(a.shape) != shape:
                raise RuntimeError(f"hook returned a gradient of shape {list(a.shape)}, expected {list(shape)}")
            out.append(a.astype(jd))
        return tuple(out)

    f.defvjp(fwd, bwd, symbolic_zeros=True)
    arrays = f(*[t.elem for t in tensors])
    return [labelled(a, d) for a, d in zip(arrays, dtypes)], box["perturbed"]


def _run_tensor_hooks(hooks: list[Callable]) -> Callable[[tuple], tuple]:
    def run(grads: tuple) -> tuple:
        (g,) = grads
        if g is None:
            return (None,)
        for h in list(hooks):
            new = h(g)
            if new is not None:
                g = new
        return (g,)

    return run


class _Handle:
    """`register_hook`'s handle under a trace: `remove()` stops the hook (before the backward runs)."""

    def __init__(self, hooks: list, hook: Callable):
        self._hooks, self._hook = hooks, hook

    def remove(self) -> None:
        if self._hook in self._hooks:
            self._hooks.remove(self._hook)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def _hook_tensor(t: JaxTensor, hook: Callable) -> _Handle:
    if root(t) is not t:
        raise HookUnderTraceError(
            "jaxtorch: `register_hook` on a view of another tensor under a JAX transformation (jax.grad of "
            "`extract`'s fn / `call_torch`) is not supported; register it on a `.clone()` of the view, or on "
            "the tensor it views."
        )
    held = _held_hooks.get(id(t))
    if held is not None and held[0] is t._jt_elem:  # more hooks on the same data: one list, in order
        held[1].append(hook)
        return _Handle(held[1], hook)
    hooks = [hook]
    (new,), _ = hooked_identity([t], _run_tensor_hooks(hooks))
    set_same_data(t, new.elem)
    _held_hooks[id(t)] = (new.elem, hooks)
    weakref.finalize(t, _held_hooks.pop, id(t), None)
    return _Handle(hooks, hook)


# id(tensor) -> (the data its hooks' identity gave it, the hooks): a later hook on the same data joins the list
_held_hooks: dict[int, tuple] = {}


def hook_parameter(value: JaxTensor, param: torch.Tensor) -> JaxTensor:
    """`value` (a parameter's traced data) through `param`'s own backward hooks, if it has any.

    A parameter's `register_post_accumulate_grad_hook` needs a `.grad`, which JAX-first
    functions have none of: it raises `HookUnderTraceError`."""
    if getattr(param, "_post_accumulate_grad_hooks", None):
        raise HookUnderTraceError(
            "jaxtorch: a parameter has a `register_post_accumulate_grad_hook` hook, which needs `.grad` to be "
            "accumulated: `jax.grad` of `extract`'s fn / `make_train_step` accumulate nothing. Apply the update "
            "the hook makes to the gradients JAX returns (an optax transformation), or train torch-first "
            "(`loss.backward()` on the jax device)."
        )
    hooks = getattr(param, "_backward_hooks", None)
    if not hooks or not _traced_float(value):
        return value
    (new,), _ = hooked_identity([value], _run_tensor_hooks(list(hooks.values())))
    return new


_torch_register_hook = torch.Tensor.register_hook
_torch_apply_on_tensors = get_backward_hook_apply_on_tensors()


def _register_hook(self, hook):
    if isinstance(self, JaxTensor):  # (torch's Python guard would lose, or abort on, the hook's exception)
        hook = keep_hook_errors(hook)
    if type(self) is JaxTensor and torch.is_grad_enabled() and _traced_float(self):
        if not self.requires_grad:
            return _hook_tensor(self, hook)
        if differentiated_by_jax() and not getattr(_local, "in_torch", False):  # torch's graph and JAX's VJP
            jax_handle = _hook_tensor(self, hook)
            _local.in_torch = True  # (torch's method comes back here through the function mode)
            try:
                return _Both(_torch_register_hook(self, hook), jax_handle)
            finally:
                _local.in_torch = False
    return _torch_register_hook(self, hook)


class _Both:
    """The handles of one hook registered with torch and with JAX."""

    def __init__(self, *handles):
        self.handles = handles

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def _apply_on_tensors(self, fn, args):
    """torch's `BackwardHook._apply_on_tensors`, with JAX's identity in place of its graph node
    when JAX, not torch, differentiates the module's tensors."""
    if not _device.CPP_GUARD:  # (torch's Python guard would abort on a module hook's exception in backward)
        fn = _keeping(fn)
    idx = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    tensors = [args[i] for i in idx]
    if not torch.is_grad_enabled() or not any(_traced_float(t) for t in tensors):
        return _torch_apply_on_tensors(self, fn, args)
    if any(t.requires_grad for t in tensors):
        if not differentiated_by_jax():
            return _torch_apply_on_tensors(self, fn, args)
        out, torch_idx = _torch_apply_on_tensors(self, fn, args)  # torch's node, then JAX's on its results
        jax_out, _ = _jax_hooks(fn, out)
        for i in idx:
            if isinstance(out[i], JaxTensor) and jax_out[i] is not out[i]:
                set_same_data(out[i], jax_out[i].elem)
        return out, torch_idx
    return _jax_hooks(fn, args)


class _KeepingNode:
    """A `grad_fn` whose hooks keep their exceptions for backward() to raise (`keep_hook_errors`)."""

    def __init__(self, node) -> None:
        self._node = node

    def register_hook(self, hook: Callable):
        return self._node.register_hook(keep_hook_errors(hook))

    def register_prehook(self, hook: Callable):
        return self._node.register_prehook(keep_hook_errors(hook))

    def __getattr__(self, name: str):
        return getattr(self._node, name)


def _keeping(fn: Callable) -> Callable:
    """`BackwardHook`'s `fn(grad_fn)`, given a `grad_fn` whose hooks keep their exceptions."""

    def keeping(node) -> None:
        fn(_KeepingNode(node) if not isinstance(node, _Node) else node)

    return keeping


def _jax_hooks(fn, args):
    """torch's `_apply_on_tensors` with a `jax.custom_vjp` identity as the node its hooks go on."""
    idx = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    tensors = [args[i] for i in idx]
    node = _Node()
    fn(node)
    float_at = [k for k, t in enumerate(tensors) if _traced_float(t)]

    def run(grads: tuple) -> tuple:
        full: list = [None] * len(tensors)
        for k, g in zip(float_at, grads):
            full[k] = g
        result: tuple = tuple(full)
        for h in node.hooks:
            new = h(result, result)
            if new is not None:
                result = tuple(new)
        return tuple(result[k] for k in float_at)

    new_tensors, perturbed = hooked_identity([tensors[k] for k in float_at], run)
    arg_list = list(args)
    for k, t in zip(float_at, new_tensors):
        arg_list[idx[k]] = t
    out = tuple(arg_list) if type(args) is tuple else type(args)(*arg_list)
    return out, (idx if perturbed else None)


def install() -> None:
    """Route `Tensor.register_hook` and module backward hooks through this module (idempotent)."""
    if torch.Tensor.register_hook is not _register_hook:
        global _torch_register_hook
        _torch_register_hook = torch.Tensor.register_hook
        _register_hook.__wrapped__ = _torch_register_hook  # type: ignore[attr-defined]
        torch.Tensor.register_hook = _register_hook  # type: ignore[method-assign]
    if get_backward_hook_apply_on_tensors() is not _apply_on_tensors:
        set_backward_hook_apply_on_tensors(_apply_on_tensors)
