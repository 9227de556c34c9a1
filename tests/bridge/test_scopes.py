"""Module scopes: the outputs of repeated blocks route their gradient through `gradient_barrier`
(issue 16: without it XLA:CPU fuses the residual-stream cotangent sums into every consumer)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

import jaxtorch
from jaxtorch.bridge.state._scopes import gradient_barrier


class _Block(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = torch.nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.fc(torch.nn.functional.layer_norm(x, x.shape[-1:])))


class _Skip(torch.nn.Module):
    """A block that hands its input back unchanged (its child unused)."""

    def __init__(self, width: int):
        super().__init__()
        self.unused = torch.nn.Linear(width, width)

    def forward(self, x):
        return x


class _Stack(torch.nn.Module):
    def __init__(self, width: int = 8, depth: int = 4):
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Block(width) for _ in range(depth)] + [_Skip(width)])
        self.head = torch.nn.Linear(width, 3)

    def forward(self, x):
        for block in self.blocks:
            y = block(x)
            y.mul_(1.5)  # an in-place write to a block's output (and, for _Skip, to its input)
            x = y + x
        return self.head(x)


def test_gradient_barrier_is_the_identity():
    x = jnp.arange(6.0).reshape(2, 3) - 2.0
    f = lambda x: (jnp.sin(gradient_barrier(x * 2)) ** 2).sum()
    g = lambda x: (jnp.sin(x * 2) ** 2).sum()
    np.testing.assert_array_equal(gradient_barrier(x), x)
    np.testing.assert_array_equal(jax.grad(f)(x), jax.grad(g)(x))
    np.testing.assert_array_equal(jax.jvp(f, (x,), (jnp.ones_like(x),))[1], jax.jvp(g, (x,), (jnp.ones_like(x),))[1])
    np.testing.assert_array_equal(jax.hessian(f)(x), jax.hessian(g)(x))
    for y in (jnp.float32(3.0), jnp.zeros((0, 2))):  # scalars and empty arrays pass through as they are
        np.testing.assert_array_equal(jax.grad(lambda y: (gradient_barrier(y) * 2).sum())(y), jnp.full_like(y, 2))
    assert "scatter" in jax.jit(jax.grad(f)).lower(x).as_text()


def test_block_outputs_route_gradients_through_the_barrier_exactly():
    torch.manual_seed(0)
    model = _Stack().eval()
    x = torch.randn(5, 8)
    ref = model(x)
    ref.square().sum().backward()

    params, fn = jaxtorch.extract(model)
    jx = jnp.asarray(x.numpy())
    forward = jax.jit(fn).lower(params, jx)
    np.testing.assert_allclose(forward.compile()(params, jx), ref.detach().numpy(), rtol=1e-5, atol=1e-6)
    assert "scatter" not in forward.as_text()  # the forward program is untouched

    grad = jax.jit(jax.grad(lambda p: jnp.square(fn(p, jx)).sum()))
    # per block output, the transpose of the one-element scatter (a scatter of 0 and a scatter-add),
    # on the CPU backend only; the stack has no other scatter
    per_block = 2 if jax.default_backend() == "cpu" else 0
    assert grad.lower(params).as_text().count("stablehlo.scatter") == per_block * len(model.blocks)
    grads = grad(params)
    for name, p in model.named_parameters():
        if p.grad is None:
            assert not np.asarray(grads[name]).any(), name
            continue
        err = np.abs(np.asarray(grads[name]) - p.grad.numpy()).max() / np.abs(p.grad.numpy()).max()
        assert err < 1e-5, (name, err)  # float32 round-off of the largest entry (2.5e-7 when written)
    # forward mode through the blocks as well: the directional derivative along all-ones is the gradients' sum
    ones = jax.tree_util.tree_map(jnp.ones_like, params)
    _, slope = jax.jvp(lambda p: jnp.square(fn(p, jx)).sum(), (params,), (ones,))
    np.testing.assert_allclose(slope, sum(float(jnp.sum(g)) for g in grads.values()), rtol=1e-5)
