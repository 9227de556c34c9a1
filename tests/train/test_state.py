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
    load_into(model, state.params)
    for name, t in model.state_dict().items():
        np.testing.assert_array_equal(t.numpy(), np.asarray(state.params[name]), err_msg=name)
    assert model.bn.num_batches_tracked.dtype == torch.int64 and model.bn.num_batches_tracked.item() == 2
    x = torch.randn(4, 6)
    _, fn = jaxtorch.extract(model.eval())
    np.testing.assert_allclose(model(x).detach().numpy(), fn(state.params, jaxtorch.to_jax(x)), atol=1e-5)


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
    params, _ = jaxtorch.extract(model)
    half = jax.tree_util.tree_map(lambda v: v.astype(jnp.bfloat16) if v.dtype == jnp.float32 else v, params)
    load_into(model, half)
    assert model.fc.weight.dtype == torch.float32
    np.testing.assert_array_equal(model.fc.weight.detach().numpy(), np.asarray(half["fc.weight"], np.float32))

    jmodel = BNNet().to("jax")
    load_into(jmodel, {k: v + 1 if v.dtype == jnp.float32 else v for k, v in params.items()})
    np.testing.assert_allclose(jmodel.fc.weight.detach().cpu().numpy(), np.asarray(params["fc.weight"]) + 1)
