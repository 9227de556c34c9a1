"""PyTorch inside JAX models: frozen and fine-tuned backbones in Equinox and Flax, vmap."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch

import jaxtorch


def _backbone():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten()
    ).eval()


class Classifier(eqx.Module):
    backbone: jaxtorch.TorchModule
    head: eqx.nn.Linear

    def __call__(self, x):
        feats = self.backbone(x)
        return jax.vmap(self.head)(feats)


def _data():
    k1, k2 = jax.random.split(jax.random.key(0))
    return jax.random.normal(k1, (8, 3, 8, 8)), jax.random.randint(k2, (8,), 0, 2)


def _train(model, filter_spec, steps=5):
    x, y = _data()
    opt = optax.sgd(0.1)
    state = opt.init(eqx.filter(model, filter_spec))

    @eqx.filter_jit
    def step(model, state):
        def loss(trainable, rest):
            m = eqx.combine(trainable, rest)
            return optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()

        trainable, rest = eqx.partition(model, filter_spec)
        l, g = jax.value_and_grad(loss)(trainable, rest)
        updates, state = opt.update(g, state, trainable)
        return eqx.combine(eqx.apply_updates(trainable, updates), rest), state, l

    losses = []
    for _ in range(steps):
        model, state, l = step(model, state)
        losses.append(float(l))
    return model, losses


def test_frozen_backbone_in_equinox():
    model = Classifier(jaxtorch.torch_module_to_jax(_backbone()), eqx.nn.Linear(4, 2, key=jax.random.key(1)))
    before = jax.tree_util.tree_map(np.asarray, model.backbone.params)
    head_only = jax.tree_util.tree_map(lambda _: False, model)
    head_only = eqx.tree_at(lambda m: m.head, head_only, replace=jax.tree_util.tree_map(eqx.is_array, model.head))
    trained, losses = _train(model, head_only)
    assert losses[-1] < losses[0]
    for k, v in before.items():
        np.testing.assert_array_equal(np.asarray(trained.backbone.params[k]), v)  # bit-identical
    assert not np.array_equal(np.asarray(trained.head.weight), np.asarray(model.head.weight))


def test_finetuned_backbone_in_equinox_changes_backbone():
    model = Classifier(jaxtorch.torch_module_to_jax(_backbone()), eqx.nn.Linear(4, 2, key=jax.random.key(1)))
    trained, losses = _train(model, eqx.is_inexact_array)
    assert losses[-1] < losses[0]
    assert not np.array_equal(
        np.asarray(trained.backbone.params["0.weight"]), np.asarray(model.backbone.params["0.weight"])
    )


def test_one_xla_program_with_the_head():
    model = Classifier(jaxtorch.torch_module_to_jax(_backbone()), eqx.nn.Linear(4, 2, key=jax.random.key(1)))
    x, _ = _data()
    hlo = eqx.filter_jit(lambda m, x: m(x)).lower(model, x).as_text()
    assert hlo.count("func.func public @main") == 1
    assert "convolution" in hlo and "dot_general" in hlo


def _nnx_step(x, y):
    """A jitted nnx SGD step on cross-entropy; returns (loss, grads)."""
    from flax import nnx

    @nnx.jit
    def step(model, opt):
        def loss(m):
            return optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()

        l, g = nnx.value_and_grad(loss)(model)
        opt.update(model, g)
        return l, g

    return step


def test_frozen_backbone_in_flax_nnx():
    from flax import nnx

    params, fn = jaxtorch.extract(_backbone())

    class Frozen(nnx.Variable):  # not an nnx.Param: the optimizer (wrt=nnx.Param) leaves it alone
        pass

    class Model(nnx.Module):
        def __init__(self):
            self.backbone = Frozen(jax.tree_util.tree_map(jnp.asarray, params))
            self.head = nnx.Linear(4, 2, rngs=nnx.Rngs(0))

        def __call__(self, x):
            return self.head(jax.lax.stop_gradient(fn(self.backbone.get_value(), x)))

    model = Model()
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = _nnx_step(*_data())
    losses = [float(step(model, opt)[0]) for _ in range(5)]
    assert losses[-1] < losses[0]
    for k, v in params.items():
        np.testing.assert_array_equal(np.asarray(model.backbone.get_value()[k]), np.asarray(v))


def test_finetuned_backbone_in_flax_nnx_matches_torch_autograd():
    from flax import nnx

    backbone = _backbone()
    params, fn = jaxtorch.extract(backbone)

    class Model(nnx.Module):
        def __init__(self):
            self.backbone = nnx.data({k: nnx.Param(jnp.asarray(v)) for k, v in params.items()})
            self.head = nnx.Linear(4, 2, rngs=nnx.Rngs(0))

        def __call__(self, x):
            return self.head(fn({k: v.get_value() for k, v in self.backbone.items()}, x))

    model = Model()
    x, y = _data()
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = _nnx_step(x, y)

    # the same network in torch: backbone + a Linear holding the nnx head's weights
    head = torch.nn.Linear(4, 2)
    with torch.no_grad():
        head.weight.copy_(torch.from_numpy(np.asarray(model.head.kernel.get_value()).T))
        head.bias.copy_(torch.from_numpy(np.asarray(model.head.bias.get_value())))
    ref = torch.nn.Sequential(backbone, head)
    before = {k: np.asarray(v.get_value()) for k, v in model.backbone.items()}
    loss, grads = step(model, opt)
    torch_loss = torch.nn.functional.cross_entropy(
        ref(torch.from_numpy(np.asarray(x))), torch.from_numpy(np.asarray(y)).long()
    )
    torch_loss.backward()
    np.testing.assert_allclose(float(loss), float(torch_loss), rtol=1e-5)
    for name, p in backbone.named_parameters():  # gradients reach the backbone, equal to torch's
        np.testing.assert_allclose(
            np.asarray(grads["backbone"][name].get_value()), p.grad.numpy(), rtol=1e-4, atol=1e-6
        )
        np.testing.assert_allclose(
            np.asarray(model.backbone[name].get_value()), before[name] - 0.1 * p.grad.numpy(), rtol=1e-4, atol=1e-6
        )


def test_frozen_backbone_in_flax_linen():
    import flax.linen as nn

    params, fn = jaxtorch.extract(_backbone())

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(2)(jax.lax.stop_gradient(fn(params, x)))

    x, y = _data()
    variables = Model().init(jax.random.key(0), x)
    out = jax.jit(Model().apply)(variables, x)
    assert out.shape == (8, 2)
    g = jax.grad(lambda v: Model().apply(v, x).sum())(variables)
    assert set(g["params"]) == {"Dense_0"}


def test_per_example_gradients_with_vmap_equal_loop():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.Flatten(), torch.nn.Linear(2 * 4 * 4, 3))
    params, fn = jaxtorch.extract(model)
    x = jax.random.normal(jax.random.key(0), (4, 1, 6, 6))
    y = jnp.array([0, 1, 2, 1])

    def loss(p, xi, yi):
        logits = fn(p, xi[None])
        return optax.softmax_cross_entropy_with_integer_labels(logits, yi[None]).sum()

    per_ex = jax.jit(jax.vmap(jax.grad(loss), in_axes=(None, 0, 0)))(params, x, y)
    for i in range(4):
        gi = jax.grad(loss)(params, x[i], y[i])
        for k in params:
            np.testing.assert_allclose(np.asarray(per_ex[k][i]), np.asarray(gi[k]), rtol=1e-5, atol=1e-6)


def test_vmap_through_attention_and_indexing():
    def f(q, k, v, idx):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out[:, idx].sum(-1)

    q = jax.random.normal(jax.random.key(0), (5, 2, 4, 8))
    idx = jnp.array([3, 0])
    batched = jax.vmap(lambda q: jaxtorch.call_torch(f, q, q, q, idx))(q)
    looped = jnp.stack([jaxtorch.call_torch(f, qi, qi, qi, idx) for qi in q])
    np.testing.assert_allclose(np.asarray(batched), np.asarray(looped), rtol=1e-5, atol=1e-6)
