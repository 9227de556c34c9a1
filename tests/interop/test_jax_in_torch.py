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


# ---- issue 30 item 4: nnx state (BatchNorm, Dropout/Rngs), jaxtorch.jit, copies ----


from flax import nnx


class _NnxNet(nnx.Module):
    """Linear, BatchNorm, Dropout: parameters, batch statistics and an Rngs stream (module level: picklable)."""

    def __init__(self, rngs):
        self.lin = nnx.Linear(4, 3, rngs=rngs)
        self.bn = nnx.BatchNorm(3, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.drop(self.bn(self.lin(x)))


def _nnx_net(seed: int = 0) -> _NnxNet:
    return _NnxNet(nnx.Rngs(seed, dropout=seed + 1))


def _np(t):
    return t.detach().cpu().numpy()


def test_nnx_batch_stats_are_buffers_updated_in_train_used_in_eval():
    ref, m = _nnx_net(), jaxtorch.JaxModule(_nnx_net())
    params = {n for n, _ in m.named_parameters()}
    buffers = {n for n, _ in m.named_buffers()}
    assert params == {"lin_kernel_value", "lin_bias_value", "bn_scale_value", "bn_bias_value"}
    assert {"bn_mean_value", "bn_var_value"} <= buffers
    xs = [np.random.RandomState(i).randn(8, 4).astype(np.float32) for i in range(3)]
    ref.train()
    for x in xs:  # train mode: batch statistics, running statistics updated by each call as nnx updates them
        np.testing.assert_array_equal(_np(m(torch.tensor(x))), np.asarray(ref(jnp.asarray(x))))
    np.testing.assert_array_equal(_np(m.bn_mean_value), np.asarray(ref.bn.mean[...]))
    np.testing.assert_array_equal(_np(m.bn_var_value), np.asarray(ref.bn.var[...]))
    assert np.abs(_np(m.bn_mean_value)).max() > 0  # they moved
    ref.eval()
    m.eval()
    before = _np(m.bn_mean_value)
    np.testing.assert_array_equal(_np(m(torch.tensor(xs[0]))), np.asarray(ref(jnp.asarray(xs[0]))))
    np.testing.assert_array_equal(_np(m.bn_mean_value), before)  # eval: running statistics used, not updated


def test_nnx_dropout_draws_fresh_masks_in_train_and_is_identity_in_eval():
    ref = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=3))
    m = jaxtorch.JaxModule(nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=3)))
    x = torch.ones(64)
    a, b = _np(m(x)), _np(m(x))
    assert not np.array_equal(a, b)  # fresh randomness per call
    np.testing.assert_array_equal(a, np.asarray(ref(jnp.ones(64))))  # the draws nnx makes itself
    np.testing.assert_array_equal(b, np.asarray(ref(jnp.ones(64))))
    m.eval()
    np.testing.assert_array_equal(_np(m(x)), np.ones(64, np.float32))


def test_nnx_gradients_through_torch_autograd_match_nnx_grad():
    ref, m = _nnx_net(), jaxtorch.JaxModule(_nnx_net())
    x = np.random.RandomState(0).randn(8, 4).astype(np.float32)
    grads = nnx.grad(lambda mod, a: (mod(a) ** 2).sum())(ref, jnp.asarray(x))
    m(torch.tensor(x)).square().sum().backward()
    for name, g in [("lin_kernel_value", grads["lin"]["kernel"]), ("bn_scale_value", grads["bn"]["scale"])]:
        np.testing.assert_allclose(_np(getattr(m, name).grad), np.asarray(g[...]), rtol=1e-6, atol=1e-6)


def test_jax_module_in_jaxtorch_jit_train_step_matches_eager():
    models = [jaxtorch.JaxModule(_nnx_net()) for _ in range(2)]
    opts = [torch.optim.SGD(mod.parameters(), lr=0.01) for mod in models]

    def step(model, opt, x):
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    jitted = jaxtorch.jit(step)
    for i in range(3):
        x = torch.tensor(np.random.RandomState(i).randn(8, 4).astype(np.float32), device="jax")
        np.testing.assert_allclose(_np(jitted(models[0], opts[0], x)), _np(step(models[1], opts[1], x)), rtol=1e-5)
    for (n, a), (_, b) in zip(models[0].state_dict().items(), models[1].state_dict().items()):
        np.testing.assert_allclose(_np(a), _np(b), rtol=1e-5, atol=1e-6, err_msg=n)


def test_jax_module_deepcopy_and_torch_save_give_working_copies():
    import copy
    import io

    eqx_linear = lambda: eqx.nn.Linear(4, 3, key=jax.random.key(0))
    for make, x in ((_nnx_net, torch.randn(8, 4)), (eqx_linear, torch.randn(4))):
        m = jaxtorch.JaxModule(make())
        m(x)  # a train step: state moved on
        buf = io.BytesIO()
        torch.save(m, buf)
        buf.seek(0)
        for other in (copy.deepcopy(m), torch.load(buf, weights_only=False)):
            for mod in (m, other):
                mod.eval()
            np.testing.assert_array_equal(_np(other(x)), _np(m(x)))
            assert other.state_dict().keys() == m.state_dict().keys()


def test_jax_module_eqx_with_unpicklable_static_part_refuses_torch_save_clearly():
    import io

    import pytest

    m = jaxtorch.JaxModule(eqx.nn.MLP(3, 1, 8, 2, key=jax.random.key(0)))  # holds jax.nn.relu
    with pytest.raises(jaxtorch.JaxtorchError, match="state_dict"):
        torch.save(m, io.BytesIO())


def test_jax_module_refuses_equinox_state_and_runs_equinox_dropout_with_a_key():
    import pytest

    bn = eqx.nn.BatchNorm(3, axis_name="batch")
    with pytest.raises(jaxtorch.JaxtorchError, match="eqx.nn.State"):
        jaxtorch.JaxModule(bn)
    drop = eqx.nn.Dropout(0.5)
    m = jaxtorch.JaxModule(drop)
    x, key = torch.ones(32), jax.random.key(1)
    np.testing.assert_array_equal(_np(m(x, key=key)), np.asarray(drop(jnp.ones(32), key=key)))
    m.eval()  # torch's eval mode: eqx.nn.inference_mode, dropout off
    np.testing.assert_array_equal(_np(m(x)), np.ones(32, np.float32))
