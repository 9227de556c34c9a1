"""`conv_layout="flax"`: convolution weights handed out once in XLA's layout, as `.kernel`."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from torch import nn

import jaxtorch
from jaxtorch.train import make_train_step


class Mixed(nn.Module):
    """Every kind of convolution the layout touches (plain, strided, grouped, depthwise, 1-d,
    3-d, one used twice) and the ones it must leave alone (transposed, linear)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.grouped = nn.Conv2d(8, 8, 3, padding=1, groups=2, bias=False)
        self.depthwise = nn.Conv2d(8, 16, 3, padding=1, groups=8)
        self.shared = nn.Conv2d(16, 16, 1)
        self.up = nn.ConvTranspose2d(16, 4, 2, stride=2)
        self.c1 = nn.Conv1d(4, 6, 3)
        self.c3 = nn.Conv3d(1, 2, (1, 3, 3))
        self.head = nn.Linear(6 + 2, 5)

    def forward(self, x):
        h = torch.relu(self.bn(self.stem(x)))
        h = self.depthwise(self.grouped(h))
        h = self.shared(torch.relu(self.shared(h)))
        h = self.up(h)  # (B, 4, 16, 16)
        a = self.c1(h.mean(dim=3)).mean(dim=2)  # (B, 6)
        b = self.c3(h[:, :1].unsqueeze(1)).mean(dim=(2, 3, 4))  # (B, 2)
        return self.head(torch.cat([a, b], dim=1))


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = Mixed()
    m(torch.randn(2, 3, 16, 16))  # BatchNorm statistics that are not the defaults
    return m.eval()


@pytest.fixture(scope="module")
def x():
    return torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))


CONVS = ["stem", "grouped", "depthwise", "shared", "c1", "c3"]


def test_names_and_shapes(model):
    params, _ = jaxtorch.extract(model, conv_layout="flax")
    torch_params, _ = jaxtorch.extract(model)
    for name in CONVS:
        w = getattr(model, name).weight
        assert f"{name}.weight" not in params
        want = np.transpose(w.detach().numpy(), tuple(range(2, w.ndim)) + (1, 0))
        np.testing.assert_array_equal(np.asarray(params[f"{name}.kernel"]), want)
    assert params["stem.kernel"].shape == (3, 3, 3, 8)  # (*kernel, in, out) as Flax's nn.Conv
    assert params["depthwise.kernel"].shape == (3, 3, 1, 16)  # in / groups
    # everything else keeps torch's name, layout and order of the entries
    kept = [k for k in torch_params if k.rpartition(".")[0] not in CONVS or not k.endswith("weight")]
    assert [k for k in params if not k.endswith("kernel")] == kept
    assert params["up.weight"].shape == tuple(model.up.weight.shape)


def test_forward_and_gradient_match(model, x):
    params, fn = jaxtorch.extract(model, conv_layout="flax")
    tparams, tfn = jaxtorch.extract(model)
    jx = jnp.asarray(x.numpy())
    with torch.no_grad():
        want = model(x).numpy()
    got = jax.jit(fn)(params, jx)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(got), np.asarray(jax.jit(tfn)(tparams, jx)), rtol=1e-6, atol=1e-6)

    ct = jnp.asarray(np.random.default_rng(0).standard_normal(want.shape), jnp.float32)
    floats = {k: v for k, v in params.items() if jnp.issubdtype(v.dtype, jnp.floating)}
    rest = {k: v for k, v in params.items() if k not in floats}
    grads = jax.grad(lambda p: jnp.sum(fn({**rest, **p}, jx) * ct))(floats)
    model.zero_grad()
    (model(x) * torch.from_numpy(np.array(ct))).sum().backward()
    for name in CONVS:
        w = getattr(model, name).weight
        want_g = np.transpose(w.grad.numpy(), tuple(range(2, w.ndim)) + (1, 0))
        np.testing.assert_allclose(np.asarray(grads[f"{name}.kernel"]), want_g, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(grads["up.weight"]), model.up.weight.grad.numpy(), rtol=1e-4, atol=1e-5)


def _entry_relayouts(compiled_text: str) -> int:
    entry = compiled_text[compiled_text.index("\nENTRY") :].splitlines()
    return sum(1 for ln in entry if re.search(r"%(transpose|copy)[\w.-]* = ", ln))


def test_no_weight_relayout_per_call():
    """The reason for the option: XLA:CPU's convolutions read (*kernel, in, out); given
    torch's (out, in, *kernel) the program transposes each weight on every call."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3), nn.ReLU(), nn.Conv2d(16, 32, 3), nn.ReLU(), nn.Conv2d(32, 8, 1)).eval()
    jx = jnp.ones((2, 3, 12, 12))
    counts = {}
    for layout in ("torch", "flax"):
        params, fn = jaxtorch.extract(model, conv_layout=layout)
        counts[layout] = _entry_relayouts(jax.jit(fn).lower(params, jx).compile().as_text())
    assert counts["torch"] - counts["flax"] >= 2, counts  # the 3x3 weights (a 1x1 one is a reshape)


def test_load_into_transposes_back_even_when_shapes_agree():
    """Conv2d(3, 3, 3): (out, in, kh, kw) and (kh, kw, in, out) are both (3, 3, 3, 3), so only
    the name tells the layouts apart; `load_into` must transpose back."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 3, 3))
    params, _ = jaxtorch.extract(model, conv_layout="flax")
    assert params["0.kernel"].shape == model[0].weight.shape
    new = {k: v * 2 for k, v in params.items()}
    want = model[0].weight.detach().numpy() * 2
    jaxtorch.load_into(model, new)
    np.testing.assert_array_equal(model[0].weight.detach().numpy(), want)


def test_wrong_names_raise(model, x):
    params, fn = jaxtorch.extract(model, conv_layout="flax")
    _, tfn = jaxtorch.extract(model)
    jx = jnp.asarray(x.numpy())
    with pytest.raises(jaxtorch.ParamsError, match="conv_layout='flax'"):
        tfn(params, jx)  # kernels given to a torch-layout function
    both = {**params, "stem.weight": jnp.asarray(model.stem.weight.detach().numpy())}
    with pytest.raises(ValueError, match="`stem.weight` is taken in Flax's layout, as `stem.kernel`"):
        fn(both, jx)
    with pytest.raises(ValueError, match="conv_layout must be"):
        jaxtorch.extract(model, conv_layout="nhwc")


def test_mutable_returns_kernels():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).train()
    params, fn = jaxtorch.extract(model, mutable=True, conv_layout="flax")
    assert "0.kernel" in params
    out, new = fn(params, jnp.ones((2, 3, 6, 6)))
    assert set(new) == set(fn.state)  # the state comes back; kernels stay in params
    assert not np.allclose(np.asarray(new["1.running_mean"]), np.asarray(fn.state["1.running_mean"]))


def test_equinox_module(model, x):
    m = jaxtorch.torch_module_to_jax(model, conv_layout="flax")
    assert "stem.kernel" in m.params
    jx = jnp.asarray(x.numpy())
    with torch.no_grad():
        want = model(x).numpy()
    np.testing.assert_allclose(np.asarray(eqx.filter_jit(lambda m, x: m(x))(m, jx)), want, rtol=1e-5, atol=1e-5)
    g = eqx.filter_grad(lambda m: m(jx).sum())(m)
    assert g.params["stem.kernel"].shape == (3, 3, 3, 8)


def test_train_step_matches_torch_layout():
    """Three SGD steps of a BatchNorm CNN: the same losses and weights in either layout, and
    `load_into` puts torch's layout back into the module."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, groups=8),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 3),
    ).train()
    g = torch.Generator().manual_seed(2)
    batches = [
        (jnp.asarray(torch.randn(4, 3, 8, 8, generator=g).numpy()), jnp.asarray(np.arange(4) % 3)) for _ in range(3)
    ]
    xent = lambda out, y: optax.softmax_cross_entropy_with_integer_labels(out, y).mean()
    results = {}
    for layout in ("torch", "flax"):
        init, step = make_train_step(model, xent, optax.sgd(0.1, momentum=0.9), conv_layout=layout)
        state, losses = init(), []
        for bx, by in batches:
            state, loss = step(state, bx, by)
            losses.append(float(loss))
        results[layout] = (state, losses)
    np.testing.assert_allclose(results["flax"][1], results["torch"][1], rtol=1e-5)
    assert "0.kernel" in results["flax"][0].params
    jaxtorch.load_into(model, results["flax"][0])
    torch_state = results["torch"][0]
    values = {**torch_state.params, **torch_state.model_state}
    for name, t in model.state_dict().items():
        np.testing.assert_allclose(t.numpy(), np.asarray(values[name]), rtol=1e-4, atol=1e-5, err_msg=name)
