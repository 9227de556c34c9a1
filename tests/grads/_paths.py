"""One gradient, five ways: the paths a user takes from a torch module to its gradients.

Every helper takes a module factory (or a module: it is deep-copied, so every path starts from
the same weights), the inputs (a tuple of CPU tensors: positional arguments) and a loss written
in torch (`loss(out) -> scalar tensor`), and returns `{name: np.ndarray}`, keyed by the names of
the module's trainable parameters (`named_parameters`, `requires_grad=True`); a parameter the
loss does not reach gets zeros. The JAX-first paths run the torch loss through
`jaxtorch.call_torch`, so the loss means the same thing everywhere.

- `cpu`:         PyTorch's autograd on the CPU (the reference).
- `eager`:       torch-first on the `jax` device: `model.to("jax")`, `loss.backward()`, `.grad`.
- `jit`:         torch-first as one program: `jaxtorch.jit` of a step calling `loss.backward()`.
- `extract`:     JAX-first: `jax.grad` of the loss of `jaxtorch.extract(model, mutable=True)`'s
                 function (mutable, so a forward that writes state, an EMA target or BatchNorm
                 statistics, runs; the new state is dropped).
- `train_step`:  `jaxtorch.make_train_step` with an optax transformation that keeps the gradient
                 it is given as its state (and updates nothing), so the gradient is read exactly.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch

import jaxtorch
import jaxtorch.train

Grads = dict[str, np.ndarray]
Loss = Callable[[Any], torch.Tensor]

PATHS = ("cpu", "eager", "jit", "extract", "train_step")


def fresh(model) -> torch.nn.Module:
    """A new module with the same initial weights: `model()` for a factory, a deep copy of a module."""
    return copy.deepcopy(model) if isinstance(model, torch.nn.Module) else model()


def trainable(module: torch.nn.Module) -> list[str]:
    return [n for n, p in module.named_parameters() if p.requires_grad and p.dtype.is_floating_point]


def _read(module: torch.nn.Module) -> Grads:
    params = dict(module.named_parameters())
    out = {}
    for n in trainable(module):
        g = params[n].grad
        out[n] = np.zeros(tuple(params[n].shape), np.float32) if g is None else g.detach().cpu().numpy()
    return out


def _scalar(value) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        raise TypeError(f"the loss must be a one-element tensor, got {type(value).__name__}")
    return value.reshape(())


def grads_cpu(model, inputs: tuple, loss: Loss) -> Grads:
    module = fresh(model)
    _scalar(loss(module(*[x.clone() for x in inputs]))).backward()
    return _read(module)


def grads_eager(model, inputs: tuple, loss: Loss) -> Grads:
    module = fresh(model)
    jaxtorch.enable_globally()
    try:
        module = module.to("jax")
        _scalar(loss(module(*[x.to("jax") for x in inputs]))).backward()
        return _read(module)
    finally:
        jaxtorch.disable_globally()


def grads_jit(model, inputs: tuple, loss: Loss) -> Grads:
    module = fresh(model)

    def step(m, *xs):
        _scalar(loss(m(*xs))).backward()

    jaxtorch.enable_globally()
    try:
        module = module.to("jax")
        jaxtorch.jit(step)(module, *[x.to("jax") for x in inputs])
        return _read(module)
    finally:
        jaxtorch.disable_globally()


def _jax_loss(loss: Loss):
    return lambda out: jaxtorch.call_torch(lambda o: _scalar(loss(o)), out)


def grads_extract(model, inputs: tuple, loss: Loss) -> Grads:
    module = fresh(model)
    names = trainable(module)
    params, fn = jaxtorch.extract(module, mutable=True)
    xs = [jaxtorch.to_jax(x) for x in inputs]
    jloss = _jax_loss(loss)
    grads = jax.grad(lambda p: jloss(fn(p, *xs)[0]))(params)
    return {n: np.asarray(grads[n]) for n in names}


def keep_gradient() -> optax.GradientTransformation:
    """An optax transformation whose state is the last gradient it was given; it updates nothing."""

    def init(params):
        return jax.tree_util.tree_map(jnp.zeros_like, params)

    def update(grads, state, params=None):
        return jax.tree_util.tree_map(jnp.zeros_like, grads), grads

    return optax.GradientTransformation(init, update)


def grads_train_step(model, inputs: tuple, loss: Loss) -> Grads:
    module = fresh(model)
    names = trainable(module)
    jloss = _jax_loss(loss)
    init, step = jaxtorch.train.make_train_step(module, lambda out, _: jloss(out), keep_gradient(), donate=False)
    state, _ = step(init(), tuple(jaxtorch.to_jax(x) for x in inputs), jnp.zeros(()))
    return {n: np.asarray(state.opt_state[n]) for n in names}


GRADS: dict[str, Callable[[Any, tuple, Loss], Grads]] = {
    "cpu": grads_cpu,
    "eager": grads_eager,
    "jit": grads_jit,
    "extract": grads_extract,
    "train_step": grads_train_step,
}


def compare(ref: Grads, got: Grads, rtol: float = 1e-5) -> None:
    """Same names, shapes and values: elementwise `rtol`, with an absolute floor of `rtol` times
    the largest reference value of that parameter (float32 sums in another order differ there)."""
    if set(ref) != set(got):
        missing, extra = sorted(set(ref) - set(got)), sorted(set(got) - set(ref))
        raise AssertionError(f"parameters differ: missing {missing}, extra {extra}")
    for n, r in ref.items():
        g = got[n]
        if g.shape != r.shape:
            raise AssertionError(f"{n}: gradient shape {g.shape} vs torch {r.shape}")
        scale = float(np.max(np.abs(r))) if r.size else 0.0
        if not np.allclose(g, r, rtol=rtol, atol=rtol * max(scale, 1e-6), equal_nan=True):
            err = float(np.max(np.abs(np.asarray(g, np.float64) - r)))
            raise AssertionError(f"{n}: gradients differ (max abs err {err:.3g}, torch's largest {scale:.3g})")
