"""The JAX-first API: call_torch, call_jax, extract, torch_module_to_jax."""

import copy

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
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
    f = lambda x, y: (x @ y).relu().sum(dim=0)
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
    f = lambda x: jaxtorch.call_torch(lambda t, w: torch.tanh(t @ w).sum(-1), x, w)
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


def test_extract_puts_buffers_in_state_and_mutable_returns_it():
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm1d(3)
    x = torch.randn(8, 3)
    params, fn = jaxtorch.extract(bn, mutable=True)
    assert set(params) == {"weight", "bias"}
    assert set(fn.state) == {"running_mean", "running_var", "num_batches_tracked"}
    out, new = jax.jit(fn)(params, jaxtorch.to_jax(x))
    ref = bn(x)
    np.testing.assert_allclose(np.asarray(out), _np(ref), rtol=1e-4, atol=1e-5)
    assert set(new) == set(fn.state)
    np.testing.assert_allclose(np.asarray(new["running_mean"]), _np(bn.running_mean), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.asarray(new["running_var"]), _np(bn.running_var), rtol=1e-4, atol=1e-6)
    assert int(new["num_batches_tracked"]) == 1
    out2, new2 = jax.jit(fn)(params, jaxtorch.to_jax(x), state=new)  # explicit state: threaded through
    bn(x)
    assert int(new2["num_batches_tracked"]) == 2
    np.testing.assert_allclose(np.asarray(new2["running_var"]), _np(bn.running_var), rtol=1e-4, atol=1e-6)


class LinBNLin(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 4)
        self.bn = torch.nn.BatchNorm1d(4)
        self.fc2 = torch.nn.Linear(4, 2)
        self.register_buffer("scale", torch.tensor(2.0), persistent=False)

    def forward(self, x):
        return self.fc2(self.bn(self.fc1(x))) * self.scale


def test_grad_and_adamw_train_params_only_buffers_and_frozen_bit_identical():
    """Issue 22: the extract docstring's `jax.grad` works with BatchNorm (int buffer), and 20
    adamw steps leave every buffer and every frozen parameter bit-identical."""
    torch.manual_seed(0)
    model = LinBNLin().eval()
    model.fc1.bias.requires_grad_(False)
    params, fn = jaxtorch.extract(model)
    assert set(params) == {"fc1.weight", "bn.weight", "bn.bias", "fc2.weight", "fc2.bias"}
    assert set(fn.state) == {"fc1.bias", "bn.running_mean", "bn.running_var", "bn.num_batches_tracked", "scale"}
    before = {k: np.array(v) for k, v in fn.state.items()}
    x = jax.random.normal(jax.random.key(0), (6, 4))
    loss = lambda p: jnp.mean(fn(p, x) ** 2)
    opt = optax.adamw(1e-1)
    opt_state = opt.init(params)
    for _ in range(20):
        updates, opt_state = opt.update(jax.grad(loss)(params), opt_state, params)
        params = optax.apply_updates(params, updates)
    for k, v in fn.state.items():
        assert np.array_equal(np.asarray(v), before[k]) and v.dtype == before[k].dtype, k
    ref = copy.deepcopy(model)
    jaxtorch.load_into(ref, params)
    np.testing.assert_allclose(np.asarray(fn(params, x)), _np(ref(jaxtorch.to_torch(x))), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(_np(ref.bn.running_var), before["bn.running_var"])


def test_mode_is_fixed_when_fn_is_made():
    """Issue 22 item 2: jax.jit(fn) compiled in eval keeps eval after m.train() and says so;
    extract(m, train=True) gives torch's train output; the module's own modes are restored."""
    torch.manual_seed(0)
    model = LinBNLin().eval()
    model.fc1.train()  # mixed modes are the module's own and come back
    x = jax.random.normal(jax.random.key(1), (6, 4))
    tx = jaxtorch.to_torch(x)
    params, fn = jaxtorch.extract(model)
    f = jax.jit(fn)
    eval_out = f(params, x)
    model.train()
    assert fn.training is False and "eval mode" in repr(fn)
    np.testing.assert_array_equal(np.asarray(f(params, x)), np.asarray(eval_out))
    np.testing.assert_allclose(np.asarray(fn(params, x)), np.asarray(eval_out), rtol=1e-6, atol=1e-7)
    assert all(m.training for m in model.modules())  # fn put the module's own modes back

    params_t, fn_t = jaxtorch.extract(model.eval(), train=True, mutable=True)  # BatchNorm writes its statistics
    assert fn_t.training is True and not model.training
    ref = copy.deepcopy(model).train()(tx)
    np.testing.assert_allclose(np.asarray(jax.jit(fn_t)(params_t, x)[0]), _np(ref), rtol=1e-5, atol=1e-5)
    assert not any(m.training for m in model.modules())
    np.testing.assert_allclose(
        np.asarray(jaxtorch.extract(model, train=False)[1](params, x)), np.asarray(eval_out), rtol=1e-6
    )


def test_fn_rejects_wrong_params_with_the_way_out():
    class TiedNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(10, 4)
            self.head = torch.nn.Linear(4, 10, bias=False)
            self.head.weight = self.emb.weight
            self.bn = torch.nn.BatchNorm1d(4)

        def forward(self, ids):
            return self.head(self.bn(self.emb(ids)))

    params, fn = jaxtorch.extract(TiedNet().eval())
    ids = jnp.array([1, 2, 3])
    err = jaxtorch.ParamsError
    assert issubclass(err, jaxtorch.JaxtorchError)
    cases = [
        (None, "got NoneType: pass `params`"),
        ({**params, "bn.running_mean": jnp.zeros(4)}, r"`bn.running_mean` is not a trainable parameter: .*`state=`"),
        ({**params, "head.weight": params["emb.weight"]}, "`head.weight` is tied to `emb.weight`"),
        ({**params, "nope": jnp.zeros(1)}, "`nope` is not a name"),
        ({k: v for k, v in params.items() if k != "bn.bias"}, r"missing \['bn.bias'\]"),
        ({**params, "bn.bias": torch.zeros(4)}, r"torch.Tensor.*jaxtorch.to_jax"),
        ({**params, "bn.bias": jnp.zeros(5)}, r"shape \(5,\); the module's is \(4,\)"),
        ({**params, "bn.bias": None}, "NoneType, not an array"),
    ]
    for bad, match in cases:
        with pytest.raises(err, match=match):
            fn(bad, ids)
        with pytest.raises(err, match=match):
            jax.jit(fn)(bad, ids) if bad is not None and all(isinstance(v, jax.Array) for v in bad.values()) else fn(
                bad, ids
            )
    with pytest.raises(err, match=r"`bn.weight` is not a trainable parameter: it belongs in params"):
        fn(params, ids, state={**fn.state, "bn.weight": jnp.ones(4)})
    with pytest.raises(err, match=r"missing \['bn.running_var'\]"):
        fn(params, ids, state={k: v for k, v in fn.state.items() if k != "bn.running_var"})


def test_explicit_state_is_a_jit_input():
    model = LinBNLin().eval()
    params, fn = jaxtorch.extract(model)
    f = jax.jit(fn)
    x = jnp.ones((3, 4))
    a = f(params, x, state=fn.state)
    b = f(params, x, state={**fn.state, "scale": fn.state["scale"] * 1.5})
    np.testing.assert_allclose(np.asarray(b), np.asarray(a) * 1.5, rtol=1e-6)
    assert f._cache_size() == 1


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


def test_torch_module_to_jax_trains_params_only_and_keeps_state():
    """Issue 22: eqx.filter_jit + filter_grad + optax.adamw change the trainable parameters
    only; BatchNorm statistics and a frozen weight stay bit-identical; the mode is a field."""
    torch.manual_seed(0)
    model = LinBNLin().train()
    model.fc2.weight.requires_grad_(False)
    m = jaxtorch.torch_module_to_jax(model)
    assert m.training and set(m.params) == {"fc1.weight", "fc1.bias", "bn.weight", "bn.bias", "fc2.bias"}
    before = {k: np.array(v) for k, v in m.state.items()}
    x = jax.random.normal(jax.random.key(0), (6, 4))
    opt = optax.adamw(1e-1)
    opt_state = opt.init(eqx.filter(m, eqx.is_array))

    @eqx.filter_jit
    def step(m, opt_state):
        # train-mode BatchNorm writes its statistics: explicit state in and out (a plain call raises)
        g = eqx.filter_grad(lambda m: jnp.mean(m(x, state=m.state)[0] ** 2))(m)
        updates, opt_state = opt.update(g, opt_state, eqx.filter(m, eqx.is_array))
        return eqx.apply_updates(m, updates), opt_state

    for _ in range(5):
        m, opt_state = step(m, opt_state)
    for k, v in m.state.items():
        assert np.array_equal(np.asarray(v), before[k]), k
    assert step._cached._cache_size() == 1 if hasattr(step, "_cached") else True
    model.eval()  # the torch module's mode does not reach m
    ref = copy.deepcopy(model).train()
    jaxtorch.load_into(ref, m.params)
    ref_eval = copy.deepcopy(ref).eval()
    np.testing.assert_allclose(np.asarray(m(x, state=m.state)[0]), _np(ref(jaxtorch.to_torch(x))), rtol=1e-5, atol=1e-6)
    with pytest.raises(jaxtorch.StateWriteError, match="num_batches_tracked"):
        m(x)  # the statistics would be lost

    e = eqx.nn.inference_mode(m)
    assert e.inference and not e.training and m.eval().inference and e.train().training
    np.testing.assert_allclose(
        np.asarray(eqx.filter_jit(lambda m: m(x))(e)), _np(ref_eval(jaxtorch.to_torch(x))), rtol=1e-5, atol=1e-6
    )
    out, new_state = m(x, state=m.state)  # explicit state in and out
    assert int(new_state["bn.num_batches_tracked"]) == 1 and int(m.state["bn.num_batches_tracked"]) == 0
    assert int(m.with_state(new_state).state["bn.num_batches_tracked"]) == 1


def test_call_jax_on_torch_tensors():
    with jaxtorch.default_env():
        t = torch.ones(3, device="jax")
        out = jaxtorch.call_jax(lambda a: jnp.sin(a) * 2, t)
        assert isinstance(out, jaxtorch.JaxTensor)
        np.testing.assert_allclose(out.cpu().numpy(), 2 * np.sin(np.ones(3)), rtol=1e-6)
