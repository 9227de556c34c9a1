"""JAX functions inside PyTorch autograd: `call_jax` and `jax_function_to_torch`.

`call_jax(fn, *tensors)` runs the JAX function `fn` on torch tensors. When some inputs
require grad, it runs as a `torch.autograd.Function` whose backward is `jax.vjp` of `fn`,
so an optax loss, a Pallas kernel or a Flax block can sit inside a PyTorch training loop
and `loss.backward()` flows through it.

Example:
    ```python
    w = torch.randn(3, device="jax", requires_grad=True)
    loss = jaxtorch.call_jax(lambda a: jnp.sum(jnp.sin(a) ** 2), w)
    loss.backward()          # w.grad from jax.vjp
    ```
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import torch

from ..._compat import Tracer
from ..core import _tracing
from ._convert import tensor_to_jax, tree_map
from ._tensor import JaxTensor


def _to_array(t: torch.Tensor):
    return t.elem if isinstance(t, JaxTensor) else tensor_to_jax(t)


def _differentiable(t) -> bool:
    return isinstance(t, torch.Tensor) and t.requires_grad and (t.dtype.is_floating_point or t.dtype.is_complex)


class _JaxVjp(torch.autograd.Function):
    """forward: run `fn` with JAX and keep its vjp; backward: apply the vjp."""

    @staticmethod
    def forward(ctx, run: Callable, n_in: int, *tensors):
        outs, vjp, was_cpu, f = run(tensors)
        ctx.vjp = vjp
        ctx.f = f
        ctx.was_cpu = was_cpu
        ctx.out_meta = [(o.shape, o.dtype) for o in outs]
        ctx.save_for_backward(*tensors)
        return tuple(JaxTensor(o) for o in outs)

    @staticmethod
    def backward(ctx, *grads):
        with _tracing.adopted():  # torch's autograd thread, in a backward under a trace (`jaxtorch.jit`)
            return _JaxVjp._backward(ctx, grads)

    @staticmethod
    def _backward(ctx, grads: tuple) -> tuple:
        if torch.is_grad_enabled():  # create_graph=True: the backward itself is differentiable
            return (None, None, *_differentiable_backward(ctx, grads))
        cots = []
        for g, (shape, dtype) in zip(grads, ctx.out_meta):
            if g is None:
                cots.append(jax.numpy.zeros(shape, dtype))
            else:
                cots.append(_to_array(g).astype(dtype))
        in_grads = ctx.vjp(cots)
        result: list = []
        for g, cpu in zip(in_grads, ctx.was_cpu):
            if g is None:
                result.append(None)
            elif cpu:
                from ._convert import array_to_torch

                result.append(array_to_torch(g))
            else:
                result.append(JaxTensor(g))
        return (None, None, *result)


def _differentiable_backward(ctx, grads) -> list:
    """The input gradients as a `call_jax` of `jax.vjp(f)` on the saved inputs and the incoming
    gradients, recorded by autograd, so a second backward differentiates it (double backward)."""
    saved = ctx.saved_tensors
    n = len(saved)
    f, meta = ctx.f, ctx.out_meta

    def vjp_of(*arrays):
        primals, cots = arrays[:n], arrays[n:]
        _, vjp = jax.vjp(f, *primals)
        return list(vjp([c.astype(dtype) for c, (_, dtype) in zip(cots, meta)]))

    cots = [JaxTensor(jax.numpy.zeros(shape, dtype)) if g is None else g for g, (shape, dtype) in zip(grads, meta)]
    in_grads = call_jax(vjp_of, *saved, *cots)
    return [g.cpu() if cpu else g for g, cpu in zip(in_grads, ctx.was_cpu)]


def call_jax(fn: Callable, *args, **kwargs) -> Any:
    """Run the JAX function `fn` on torch tensors; return `JaxTensor`s, differentiable by torch.

    Tensors anywhere in `args`/`kwargs` (jax-device or CPU) become `jax.Array`s; other
    values pass through. If any floating input requires grad, the call is recorded in the
    torch autograd graph with `jax.vjp(fn)` as its backward; with `create_graph=True` that
    backward is itself recorded (a `call_jax` of the VJP), so double backward works.

    **Arguments:**
    - `fn`: a JAX function.
    - `args`, `kwargs`: its arguments, with torch tensors where arrays go.

    **Returns:** `fn`'s result with each array wrapped as a `JaxTensor`.

    **Example:**
        ```python
        y = jaxtorch.call_jax(jnp.sin, torch.ones(3, device="jax"))
        ```
    """
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs), is_leaf=lambda x: isinstance(x, torch.Tensor))
    pos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    diff = [i for i in pos if _differentiable(leaves[i])]
    if not diff or not torch.is_grad_enabled():
        arrays = [(_to_array(x) if isinstance(x, torch.Tensor) else x) for x in leaves]
        a, k = jax.tree_util.tree_unflatten(treedef, arrays)
        return tree_map(lambda o: JaxTensor(o) if isinstance(o, (jax.Array, Tracer)) else o, fn(*a, **k))

    out_tree = {}

    def run(diff_tensors):
        base = [(_to_array(x) if isinstance(x, torch.Tensor) else x) for x in leaves]

        def f(*diff_arrays):
            full = list(base)
            for i, arr in zip(diff, diff_arrays):
                full[i] = arr
            a, k = jax.tree_util.tree_unflatten(treedef, full)
            out = fn(*a, **k)
            flat, out_tree["def"] = jax.tree_util.tree_flatten(out)
            return flat

        primals = [base[i] for i in diff]
        outs, vjp = jax.vjp(f, *primals)
        was_cpu = [not isinstance(leaves[i], JaxTensor) for i in diff]
        return outs, vjp, was_cpu, f

    outs = _JaxVjp.apply(run, len(diff), *[leaves[i] for i in diff])
    return jax.tree_util.tree_unflatten(out_tree["def"], list(outs))


def jax_function_to_torch(fn: Callable) -> Callable:
    """A torch-callable version of the JAX function `fn` (see `call_jax`), autograd included.

    **Arguments:**
    - `fn`: a JAX function of arrays (pytrees allowed).

    **Returns:** a function taking torch tensors where `fn` takes arrays and returning `JaxTensor`s, differentiable
    by torch autograd (`jax.vjp(fn)` is its backward).

    **Example:**
        ```python
        import optax

        torch_loss = jaxtorch.jax_function_to_torch(optax.softmax_cross_entropy_with_integer_labels)
        logits = torch.zeros(2, 5, device="jax", requires_grad=True)
        torch_loss(logits, torch.tensor([1, 3], device="jax")).mean().backward()
        assert logits.grad.shape == (2, 5)
        ```
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return call_jax(fn, *args, **kwargs)

    return wrapper


__all__ = ["call_jax", "jax_function_to_torch", "np"]
