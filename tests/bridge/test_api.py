"""The JAX-first API: call_torch, call_jax, extract, torch_module_to_jax."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch

import jaxtorch


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 8)
        self.fc2 = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def _np(t):
    return t.detach().numpy()


def test_call_torch_eager_jit_grad():
    f = lambda x, y: (x @ y).relu().sum(dim=0)  # noqa: E731
    x, y = jnp.arange(6.0).reshape(2, 3) - 2, jnp.ones((3, 2))
    ref = f(torch.tensor(np.asarray(x)), torch.tensor(np.asarray(y)))
    np.testing.assert_allclose(np.asarray(jaxtorch.call_torch(f, x, y)), _np(ref))
    np.testing.assert_allclose(np.asarray(jax.jit(lambda a, b: jaxtorch.call_torch(f, a, b))(x, y)), _np(ref))
    tx = torch.tensor(np.asarray(x), requires_grad=True)
    f(tx, torch.tensor(np.asarray(y))).sum().backward()
    g = jax.grad(lambda a: jaxtorch.call_torch(f, a, y).sum())(x)
    np.testing.assert_allclose(np.asarray(g), _np(tx.grad))


def test_factories_inside_call_torch_are_jax():
    out = jax.jit(lambda x: jaxtorch.call_torch(lambda t: t + torch.zeros(3) + torch.tensor([1.0, 2.0, 3.0]), x))(
        jnp.ones(3)
    )
    np.testing.assert_array_equal(np.asarray(out), [2.0, 3.0, 4.0])


def test_vmap_of_call_torch_equals_loop():
    w = jnp.arange(12.0).reshape(3, 4) / 10
    f = lambda x: jaxtorch.call_torch(lambda t, w: torch.tanh(t @ w).sum(-1), x, w)  # noqa: E731
    xs = jax.random.normal(jax.random.key(0), (5, 2, 3))
    batched = jax.vmap(f)(xs)
    looped = jnp.stack([f(x) for x in xs])
    np.testing.assert_allclose(np.asarray(batched), np.asarray(looped), rtol=1e-6)


def test_extract_matches_torch_and_is_pure():
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(5, 4)
    params, fn = jaxtorch.extract(model)
    assert set(params) == {n for n, _ in model.named_parameters()}
    jx = jaxtorch.to_jax(x)
    out = jax.jit(fn)(params, jx)
    np.testing.assert_allclose(np.asarray(out), _np(model(x)), rtol=1e-5, atol=1e-6)
    # pure: new params change the result, the torch module is untouched
    params2 = jax.tree_util.tree_map(lambda p: p * 0, params)
    np.testing.assert_allclose(np.asarray(fn(params2, jx)), 0.0)
    np.testing.assert_allclose(np.asarray(fn(params, jx)), _np(model(x)), rtol=1e-5, atol=1e-6)
    # grads match torch autograd
    model(x).square().sum().backward()
    g = jax.grad(lambda p: jnp.sum(fn(p, jx) ** 2))(params)
    for name, p in model.named_parameters():
        np.testing.assert_allclose(np.asarray(g[name]), _np(p.grad), rtol=1e-4, atol=1e-5)


def test_extract_dedups_tied_weights():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(10, 4)
            self.head = torch.nn.Linear(4, 10, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, ids):
            return self.head(self.emb(ids))

    model = Tied()
    params, fn = jaxtorch.extract(model)
    assert list(params) == ["emb.weight"]
    ids = jnp.array([[1, 2, 3]])
    np.testing.assert_allclose(np.asarray(fn(params, ids)), _np(model(torch.tensor([[1, 2, 3]]))), rtol=1e-5)
    g = jax.grad(lambda p: fn(p, ids).sum())(params)
    assert g["emb.weight"].shape == (10, 4)


def test_extract_includes_buffers_and_mutable_updates_them():
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm1d(3)
    x = torch.randn(8, 3)
    params, fn = jaxtorch.extract(bn, mutable=True)
    assert {"running_mean", "running_var", "num_batches_tracked"} <= set(params)
    out, new = jax.jit(fn)(params, jaxtorch.to_jax(x))
    ref = bn(x)
    np.testing.assert_allclose(np.asarray(out), _np(ref), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(new["running_mean"]), _np(bn.running_mean), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.asarray(new["running_var"]), _np(bn.running_var), rtol=1e-4, atol=1e-6)
    assert int(new["num_batches_tracked"]) == 1
    np.testing.assert_array_equal(np.asarray(new["weight"]), np.asarray(params["weight"]))


def test_torch_module_to_jax_with_equinox_and_optax():
    torch.manual_seed(0)
    model = MLP()
    m = jaxtorch.torch_module_to_jax(model)
    assert "MLP" in repr(m) and "fc1" in repr(m)
    x = jax.random.normal(jax.random.key(0), (6, 4))
    y = jnp.zeros((6, 3))
    np.testing.assert_allclose(np.asarray(m(x)), _np(model(jaxtorch.to_torch(x))), rtol=1e-5, atol=1e-6)

    def loss(m, x, y):
        return jnp.mean((m(x) - y) ** 2)

    opt = optax.adam(1e-2)
    state = opt.init(eqx.filter(m, eqx.is_array))

    @eqx.filter_jit
    def step(m, state, x, y):
        l, g = eqx.filter_value_and_grad(loss)(m, x, y)
        updates, state = opt.update(g, state, eqx.filter(m, eqx.is_array))
        return eqx.apply_updates(m, updates), state, l

    losses = []
    for _ in range(20):
        m, state, l = step(m, state, x, y)
        losses.append(float(l))
    assert losses[-1] < 0.5 * losses[0]


def test_call_jax_on_torch_tensors():
    with jaxtorch.default_env():
        t = torch.ones(3, device="jax")
        out = jaxtorch.call_jax(lambda a: jnp.sin(a) * 2, t)
        assert isinstance(out, jaxtorch.JaxTensor)
        np.testing.assert_allclose(out.cpu().numpy(), 2 * np.sin(np.ones(3)), rtol=1e-6)
