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


def _meta_and_reference() -> tuple[torch.nn.Module, torch.nn.Module]:
    """The same module built on the meta device and on the CPU: a tied weight, a frozen parameter,
    an int64 buffer and a non-persistent buffer."""

    def build() -> torch.nn.Module:
        m = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False), torch.nn.BatchNorm1d(5))
        m[1].weight = m[0].weight
        m[2].weight.requires_grad_(False)
        m.register_buffer("scale", torch.full((5,), 2.0), persistent=False)
        return m

    with torch.device("meta"):
        meta = build()
    torch.manual_seed(0)
    ref = build()
    with torch.no_grad():
        ref[2].running_mean.uniform_()
        ref[2].num_batches_tracked.fill_(3)
    return meta, ref


def test_load_into_meta_model_materializes_like_assign():
    """Issue 30 item 18: before, load_into succeeded and left every weight on the meta device."""
    meta, ref = _meta_and_reference()
    params, fn = jaxtorch.extract(ref)
    load_into(meta, params, fn.state)
    assert meta[1].weight is meta[0].weight  # still tied
    for (name, got), (_, want) in zip(meta.named_parameters(), ref.named_parameters(), strict=True):
        assert type(got) is torch.nn.Parameter and got.requires_grad == want.requires_grad, name
    loaded = {**dict(meta.named_parameters()), **dict(meta.named_buffers())}
    for name, want in {**dict(ref.named_parameters()), **dict(ref.named_buffers())}.items():
        got = loaded[name]
        assert got.device.type == "cpu" and got.dtype == want.dtype, name
        assert torch.equal(got, want), name
    assert "scale" not in meta.state_dict()  # non-persistent stays non-persistent
    x = torch.tensor([[0, 1, 4]])
    torch.testing.assert_close(meta.eval()(x[0]), ref.eval()(x[0]), rtol=0, atol=0)


def test_load_into_meta_model_without_the_state_names_to_empty():
    meta, ref = _meta_and_reference()
    params, _ = jaxtorch.extract(ref)
    with pytest.raises(jaxtorch.ParamsError, match="to_empty") as info:
        load_into(meta, params)
    assert "2.running_mean" in str(info.value)
    assert meta[0].weight.is_meta  # nothing written
