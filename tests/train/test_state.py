"""load_into: trained values back into the torch module (parameters, buffers, tied weights)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

import jaxtorch
from jaxtorch.train import load_into, make_train_step

from ._models import BNNet, Tied


def test_load_into_writes_params_and_buffers():
    model = BNNet().train()
    init, step = make_train_step(model, lambda o, y: jnp.mean((o - y) ** 2), optax.adam(1e-2))
    state = init()
    for _ in range(2):
        state, _ = step(state, torch.randn(8, 6), torch.randn(8, 2))
    load_into(model, state)  # a TrainState: params and model_state
    values = {**state.params, **state.model_state}
    for name, t in model.state_dict().items():
        np.testing.assert_array_equal(t.numpy(), np.asarray(values[name]), err_msg=name)
    assert model.bn.num_batches_tracked.dtype == torch.int64 and model.bn.num_batches_tracked.item() == 2
    x = torch.randn(4, 6)
    _, fn = jaxtorch.extract(model.eval())
    out = fn(state.params, jaxtorch.to_jax(x), state=state.model_state)
    np.testing.assert_allclose(model(x).detach().numpy(), out, atol=1e-5)
    with pytest.raises(TypeError, match="model_state"):
        load_into(model, state, state.model_state)


def test_load_into_params_and_state_from_a_mutable_fn():
    model = BNNet().train()
    params, fn = jaxtorch.extract(model, mutable=True)
    _, new_state = fn(params, jnp.ones((4, 6)) * 3)
    assert set(new_state) == {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked"}
    load_into(model, params)  # state=None: buffers left as they are
    assert model.bn.num_batches_tracked.item() == 0
    load_into(model, params, new_state)
    assert model.bn.num_batches_tracked.item() == 1
    np.testing.assert_array_equal(model.bn.running_mean.numpy(), np.asarray(new_state["bn.running_mean"]))
    with pytest.raises(KeyError, match="bn.running_var"):
        load_into(model, params, {"bn.running_mean": new_state["bn.running_mean"]})


def test_load_into_rejects_non_arrays_naming_the_entry():
    model = BNNet()
    params, _ = jaxtorch.extract(model)
    with pytest.raises(jaxtorch.JaxtorchError, match=r"\['out.bias'\] is not an array \(list\).*jnp.asarray"):
        load_into(model, {**params, "out.bias": [1.0, 2.0]})


def test_load_into_tied_weights():
    model = Tied()
    params, _ = jaxtorch.extract(model)
    assert set(params) == {"emb.weight"}
    new = {"emb.weight": jnp.arange(40.0).reshape(10, 4)}
    load_into(model, new)
    assert model.proj.weight is model.emb.weight
    np.testing.assert_array_equal(model.proj.weight.detach().numpy(), np.arange(40.0).reshape(10, 4))
    load_into(model, {"proj.weight": jnp.ones((10, 4))})  # either tied name works
    np.testing.assert_array_equal(model.emb.weight.detach().numpy(), np.ones((10, 4)))


def test_load_into_strict_errors():
    model = BNNet()
    params, _ = jaxtorch.extract(model)
    with pytest.raises(KeyError, match="nope"):
        load_into(model, {**params, "nope": jnp.ones(1)})
    partial = {k: v for k, v in params.items() if k != "out.bias"}
    with pytest.raises(KeyError, match="out.bias"):
        load_into(model, partial)
    load_into(model, partial, strict=False)
    with pytest.raises(ValueError, match="shape"):
        load_into(model, {**params, "out.bias": jnp.ones(3)})


def test_load_into_bf16_and_jax_device_module():
    model = BNNet()
    params, fn = jaxtorch.extract(model)
    params = {**params, **fn.state}
    half = jax.tree_util.tree_map(lambda v: v.astype(jnp.bfloat16) if v.dtype == jnp.float32 else v, params)
    load_into(model, half)
    assert model.fc.weight.dtype == torch.float32
    np.testing.assert_array_equal(model.fc.weight.detach().numpy(), np.asarray(half["fc.weight"], np.float32))

    jmodel = BNNet().to("jax")
    load_into(jmodel, {k: v + 1 if v.dtype == jnp.float32 else v for k, v in params.items()})
    np.testing.assert_allclose(jmodel.fc.weight.detach().cpu().numpy(), np.asarray(params["fc.weight"]) + 1)
