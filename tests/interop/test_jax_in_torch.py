"""JAX inside PyTorch: call_jax in torch autograd, jax_function_to_torch, JaxModule."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch

import jaxtorch


def test_call_jax_backward_matches_torch():
    w = torch.randn(4, 3, requires_grad=True)
    x = torch.randn(5, 4)
    ref = torch.tanh(x @ w).square().sum()
    ref.backward()
    with jaxtorch.default_env():
        wj = w.detach().to("jax").requires_grad_()
        loss = jaxtorch.call_jax(lambda a, b: jnp.sum(jnp.tanh(b @ a) ** 2), wj, x.to("jax"))
        assert loss.requires_grad
        loss.backward()
    np.testing.assert_allclose(wj.grad.cpu().numpy(), w.grad.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loss.item(), ref.item(), rtol=1e-6)


def test_optax_loss_inside_torch_training_loop():
    torch.manual_seed(0)
    logits_layer = torch.nn.Linear(6, 4)
    x, labels = torch.randn(16, 6), torch.randint(0, 4, (16,))
    ce = jaxtorch.jax_function_to_torch(lambda l, y: optax.softmax_cross_entropy_with_integer_labels(l, y).mean())
    # reference gradient from torch's own cross entropy
    torch.nn.functional.cross_entropy(logits_layer(x), labels).backward()
    ref_grad = logits_layer.weight.grad.clone()
    logits_layer.zero_grad()
    loss = ce(logits_layer(x), labels)  # CPU tensors in, jax-backed loss out
    loss.backward()
    np.testing.assert_allclose(logits_layer.weight.grad.numpy(), ref_grad.numpy(), rtol=1e-5, atol=1e-6)


def test_jax_module_trains_with_torch_optimizer():
    mlp = eqx.nn.MLP(3, 1, 16, 2, key=jax.random.key(0))
    head = jaxtorch.JaxModule(mlp)
    names = [n for n, _ in head.named_parameters()]
    assert len(names) == 6 and all(isinstance(p, jaxtorch.JaxTensor) for p in head.parameters())
    xs = torch.randn(32, 3)
    ys = xs.sum(-1, keepdim=True)
    with jaxtorch.default_env():
        opt = torch.optim.Adam(head.parameters(), lr=1e-2)
        losses = []
        for _ in range(30):
            pred = jaxtorch.call_jax(lambda m_out: m_out, torch.stack([head(x) for x in xs.to("jax")[:8]]))
            loss = (pred - ys[:8].to("jax")).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    trained = head.to_jax_module()
    np.testing.assert_allclose(np.asarray(trained(jnp.ones(3))), head(torch.ones(3)).detach().cpu().numpy(), rtol=1e-6)


def test_nnx_module_wrapped():
    from flax import nnx

    lin = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    m = jaxtorch.JaxModule(lin)
    x = torch.randn(3, 4)
    out = m(x)
    np.testing.assert_allclose(out.cpu().detach().numpy(), np.asarray(lin(jnp.asarray(x.numpy()))), rtol=1e-6)
    out.sum().backward()
    grads = {n: p.grad for n, p in m.named_parameters()}
    assert all(g is not None for g in grads.values())
