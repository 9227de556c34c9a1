"""The JAX-first contract (issue 22): parameters vs state, the mode, snapshots of torch inputs, the write rule."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from torch import nn

import jaxtorch
import jaxtorch.train

from .harness import case, clear_error, close, equal


def _mlp_bn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


def _state(fn) -> dict:
    return dict(fn.state)


# ---- parameters are parameters ------------------------------------------------------------------
@case("params/no_buffers_in_params")
def _no_buffers():
    params, fn = jaxtorch.extract(_mlp_bn().eval())
    assert set(params) == {"0.weight", "0.bias", "1.weight", "1.bias", "2.weight", "2.bias"}, set(params)
    assert {"1.running_mean", "1.running_var", "1.num_batches_tracked"} <= set(_state(fn))


@case("params/grad_then_adamw_leaves_buffers")
def _adamw_buffers():
    m = _mlp_bn().eval()
    params, fn = jaxtorch.extract(m)
    state0 = {k: np.asarray(v) for k, v in _state(fn).items()}
    x = jnp.ones((5, 3))
    opt = optax.adamw(1e-2)
    opt_state = opt.init(params)
    for _ in range(5):
        grads = jax.grad(lambda p: fn(p, x).sum())(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    for k, v in _state(fn).items():
        np.testing.assert_array_equal(np.asarray(v), state0[k])
    assert m.training is False


@case("params/frozen_parameter_is_state")
def _frozen():
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    m[0].weight.requires_grad_(False)
    params, fn = jaxtorch.extract(m)
    assert "0.weight" not in params and "0.weight" in _state(fn)


@case("params/tied_weights_once")
def _tied():
    m = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 5, bias=False))
    m[1].weight = m[0].weight
    params, _ = jaxtorch.extract(m)
    assert list(params) == ["0.weight"], list(params)


@case("params/int_parameter_is_state")
def _int_param():
    m = nn.Linear(2, 2)
    m.steps = nn.Parameter(torch.tensor([3]), requires_grad=False)
    params, fn = jaxtorch.extract(m)
    assert "steps" not in params and "steps" in _state(fn)


@case("params/train_step_honours_requires_grad")
def _step_frozen():
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    m[0].weight.requires_grad_(False)
    frozen = m[0].weight.detach().clone()
    init, step = jaxtorch.train.make_train_step(m, lambda out, y: ((out - y) ** 2).mean(), optax.sgd(0.1))
    state = init()
    for _ in range(3):
        state, _ = step(state, jnp.ones((4, 3)), jnp.zeros((4, 1)))
    jaxtorch.load_into(m, state)
    equal(m[0].weight.detach(), frozen)


@case("params/torch_module_to_jax_grads_only_params")
def _eqx_grads():
    import equinox as eqx

    m = jaxtorch.torch_module_to_jax(_mlp_bn().eval())
    grads = eqx.filter_grad(lambda mod, x: mod(x).sum())(m, jnp.ones((5, 3)))
    leaves = [x for x in jax.tree_util.tree_leaves(grads) if eqx.is_array(x)]
    assert len(leaves) == 6, len(leaves)


@case("params/errors/none_params")
def _none_params():
    _, fn = jaxtorch.extract(nn.Linear(2, 2))
    with pytest.raises(Exception) as e:
        fn(None, jnp.ones((1, 2)))
    clear_error(e.value, "params")


@case("params/errors/torch_tensor_in_params")
def _torch_in_params():
    m = nn.Linear(2, 2)
    params, fn = jaxtorch.extract(m)
    params = {**params, "weight": torch.ones(2, 2)}
    with pytest.raises(Exception) as e:
        fn(params, jnp.ones((1, 2)))
    clear_error(e.value, "to_jax")


@case("params/errors/buffer_in_params")
def _buffer_in_params():
    params, fn = jaxtorch.extract(_mlp_bn().eval())
    params = {**params, "1.running_mean": jnp.zeros(4)}
    with pytest.raises(Exception) as e:
        fn(params, jnp.ones((2, 3)))
    clear_error(e.value, "state")


@case("params/errors/missing_param")
def _missing():
    params, fn = jaxtorch.extract(nn.Linear(2, 2))
    params = {k: v for k, v in params.items() if k != "bias"}
    with pytest.raises(Exception) as e:
        fn(params, jnp.ones((1, 2)))
    clear_error(e.value, "bias")


@case("params/errors/tied_alias_name")
def _alias():
    m = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 5, bias=False))
    m[1].weight = m[0].weight
    params, fn = jaxtorch.extract(m)
    params = {"1.weight": params["0.weight"]}
    with pytest.raises(Exception) as e:
        fn(params, jnp.ones((2,), jnp.int32))
    clear_error(e.value, "tied", "0.weight")


@case("params/errors/load_into_list")
def _load_into_list():
    with pytest.raises(Exception) as e:
        jaxtorch.load_into(nn.Linear(2, 2), {"bias": [1.0, 2.0]})
    clear_error(e.value, "bias")


@case("params/errors/wrong_shape")
def _wrong_shape():
    params, fn = jaxtorch.extract(nn.Linear(2, 2))
    params = {**params, "weight": jnp.ones((3, 3))}
    with pytest.raises(Exception) as e:
        fn(params, jnp.ones((1, 2)))
    clear_error(e.value, "weight", "shape")


# ---- the mode is fixed when fn is made -----------------------------------------------------------
@case("mode/jit_then_module_train_keeps_fn_mode")
def _stale_mode():
    m = _mlp_bn()
    m(torch.randn(8, 3))  # non-trivial running statistics
    m.eval()
    params, fn = jaxtorch.extract(m)
    x = torch.randn(6, 3)
    f = jax.jit(fn)
    f(params, jaxtorch.to_jax(x))
    m.train()
    with torch.no_grad():
        expected = m.eval()(x)
    m.train()
    close(f(params, jaxtorch.to_jax(x)), expected)
    assert fn.training is False


@case("mode/extract_train_true_matches_torch_train")
def _train_mode():
    m = _mlp_bn().eval()
    params, fn = jaxtorch.extract(m, train=True, mutable=True)
    x = torch.randn(6, 3)
    out, new_state = fn(params, jaxtorch.to_jax(x))
    ref = _mlp_bn().train()
    expected = ref(x)
    close(out, expected)
    close(new_state["1.running_mean"], ref[1].running_mean)
    assert m.training is False


@case("mode/module_modes_restored_after_call")
def _restored():
    m = _mlp_bn().train()
    m[1].eval()  # mixed modes
    params, fn = jaxtorch.extract(m, train=False)
    fn(params, jnp.ones((4, 3)))
    assert m.training and not m[1].training and m[0].training


@case("mode/torch_module_to_jax_fixed_mode")
def _eqx_mode():
    import equinox as eqx

    m = _mlp_bn()
    m(torch.randn(8, 3))
    m.eval()
    jm = jaxtorch.torch_module_to_jax(m)
    x = torch.randn(4, 3)
    f = eqx.filter_jit(lambda mod, x: mod(x))
    with torch.no_grad():
        expected = m(x)
    f(jm, jaxtorch.to_jax(x))
    m.train()
    close(f(jm, jaxtorch.to_jax(x)), expected)


# ---- torch inputs are read as snapshots ------------------------------------------------------------
@case("snapshot/train_step_batch_overwritten")
def _step_batch():
    m = nn.Linear(3, 1)
    init, step = jaxtorch.train.make_train_step(m, lambda out, y: ((out - y) ** 2).mean(), optax.sgd(0.0))
    state = init()
    xb, yb = torch.ones(64, 3), torch.zeros(64, 1)
    for _ in range(5):
        xb.fill_(1.0)
        state, loss = step(state, xb, yb)
        xb.fill_(float("nan"))
        assert np.isfinite(float(loss)), loss


@case("snapshot/device_loader_reused_buffer")
def _loader():
    buf = torch.zeros(4)

    def batches():
        for i in range(3):
            buf.fill_(i)
            yield buf

    got = [float(np.asarray(b)[0]) for b in jaxtorch.train.DeviceLoader(batches(), prefetch=2)]
    assert got == [0.0, 1.0, 2.0], got


@case("snapshot/shard_batch_then_write")
def _shard_batch():
    t = torch.arange(8.0)
    mesh = jaxtorch.train.data_mesh()
    s = jaxtorch.train.shard_batch(t, mesh)
    t.fill_(7)
    np.testing.assert_array_equal(np.asarray(s), np.arange(8.0))


@case("snapshot/compile_input_then_write")
def _compile_input():
    lin = nn.Linear(3, 3)
    f = jaxtorch.compile(lin)
    x = torch.ones(2, 3)
    with torch.no_grad():
        out = f(x)
        expected = lin(torch.ones(2, 3))
    x.fill_(100.0)
    close(out, expected)


@case("snapshot/jit_input_then_write")
def _jit_input():
    f = jaxtorch.jit(lambda a: a * 2)
    x = torch.ones(3)
    out = f(x)
    x.fill_(5.0)
    equal(out.cpu(), torch.full((3,), 2.0))


# ---- one rule for writes to CPU tensors inside JAX-first functions -------------------------------
WRITES = {
    "add_scalar": lambda c, x: c.add_(1),
    "add_tensor": lambda c, x: c.add_(torch.ones(3)),
    "fill_": lambda c, x: c.fill_(0),
    "iadd": lambda c, x: c.__iadd__(2),
    "clamp_": lambda c, x: c.clamp_(0, 0.5),
    "exp_": lambda c, x: c.exp_(),
    "normal_": lambda c, x: c.normal_(),
    "uniform_": lambda c, x: c.uniform_(),
    "zero_": lambda c, x: c.zero_(),
    "copy_": lambda c, x: c.copy_(x),
    "setitem": lambda c, x: c.__setitem__(0, 5.0),
    "mul_": lambda c, x: c.mul_(3),
    "masked_fill_": lambda c, x: c.masked_fill_(torch.tensor([True, False, True]), 1.0),
    "index_put_": lambda c, x: c.index_put_((torch.tensor([1]),), torch.tensor(9.0)),
    "foreach_add_": lambda c, x: torch._foreach_add_([c], 1.0),
    "out=": lambda c, x: torch.add(x, 1, out=c),
    "resize_": lambda c, x: c.resize_(5),
}

for _name, _write in WRITES.items():

    @case(f"write_rule/call_torch/{_name}")
    def _call_torch_write(write=_write):
        c = torch.ones(3)

        def f(x):
            write(c, x)
            return x * 2

        with pytest.raises(jaxtorch.StateWriteError):
            jaxtorch.call_torch(f, jnp.ones(3))
        equal(c, torch.ones(3))

    @case(f"write_rule/jit_call_torch/{_name}")
    def _jit_write(write=_write):
        c = torch.ones(3)

        def f(x):
            write(c, x)
            return x * 2

        with pytest.raises(jaxtorch.StateWriteError):
            jax.jit(lambda x: jaxtorch.call_torch(f, x))(jnp.ones(3))
        equal(c, torch.ones(3))


class _Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.count = torch.zeros(())  # a plain attribute, not a buffer

    def forward(self, x):
        self.count += 1
        return self.lin(x)


@case("write_rule/module_plain_tensor_counter")
def _counter():
    m = _Counter()
    params, fn = jaxtorch.extract(m)
    with pytest.raises(jaxtorch.StateWriteError):
        jax.jit(fn)(params, jnp.ones((1, 2)))
    assert float(m.count) == 0.0


@case("write_rule/batchnorm_train_non_mutable")
def _bn_non_mutable():
    params, fn = jaxtorch.extract(_mlp_bn().train())
    with pytest.raises(jaxtorch.StateWriteError):
        fn(params, jnp.ones((4, 3)))


@case("write_rule/batchnorm_train_torch_module_to_jax")
def _bn_eqx():
    m = jaxtorch.torch_module_to_jax(_mlp_bn().train())
    with pytest.raises(jaxtorch.StateWriteError):
        m(jnp.ones((4, 3)))


@case("write_rule/batchnorm_mutable_carries")
def _bn_mutable():
    m = _mlp_bn().train()
    params, fn = jaxtorch.extract(m, mutable=True)
    x = torch.randn(6, 3)
    out, new_state = fn(params, jaxtorch.to_jax(x))
    ref = _mlp_bn().train()
    close(out, ref(x))
    close(new_state["1.running_var"], ref[1].running_var)
    equal(m[1].running_var, torch.ones(4))  # the module itself is untouched


@case("write_rule/pytorch_first_cpu_write_still_legal")
def _legal():
    c = torch.ones(3)
    with jaxtorch.default_env():
        c.add_(1)
        y = torch.ones(3, device="jax") + 1
    equal(c, torch.full((3,), 2.0))
    equal(y.cpu(), torch.full((3,), 2.0))


# ---- threads --------------------------------------------------------------------------------------
@case("threads/extract_fn_from_threads")
def _threads_fn():
    m = _mlp_bn().eval()
    params, fn = jaxtorch.extract(m)
    x = torch.randn(4, 3)
    with torch.no_grad():
        expected = m(x).numpy()
    errors: list = []

    def work():
        try:
            for _ in range(5):
                np.testing.assert_allclose(np.asarray(fn(params, jaxtorch.to_jax(x))), expected, rtol=1e-5, atol=1e-6)
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
