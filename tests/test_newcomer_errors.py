"""The errors a newcomer meets in the first hour say what to do, and doing it works.

Each test hits the error the way a new user does (a whole model through `extract` /
`jax.jit`, `make_train_step`, or the PyTorch-first `enable_globally()` + `.to("jax")`),
checks the actionable part of the message, then follows that advice and checks the
result against eager PyTorch. (`tests/bridge/test_errors.py` covers the bare ops.)
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from torch import nn

import jaxtorch
import jaxtorch.coverage
import jaxtorch.train

# Custom ops no lowering exists for (a model using a kernel from some extension library).
_lib = torch.library.Library("jaxtorch_newcomer", "DEF")
_lib.define("swish(Tensor x) -> Tensor")
_lib.impl("swish", lambda x: x * torch.sigmoid(x), "CPU")
_lib.define("never_lowered(Tensor x) -> Tensor")
_lib.impl("never_lowered", lambda x: x * torch.sigmoid(x), "CPU")


def _x(*shape):
    return torch.randn(*shape)


@pytest.fixture
def pytorch_first():
    jaxtorch.enable_globally()
    yield
    jaxtorch.disable_globally()


class CustomOpNet(nn.Module):
    def __init__(self, op):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.op = op

    def forward(self, x):
        return self.op(self.fc(x))


# ---- unsupported op ------------------------------------------------------------------
def test_unsupported_op_message_gives_a_register_op_line_that_works():
    model = CustomOpNet(torch.ops.jaxtorch_newcomer.swish)
    params, fn = jaxtorch.extract(model)
    x = _x(3, 4)
    with pytest.raises(jaxtorch.UnsupportedOpError) as e:
        jax.jit(fn)(params, jaxtorch.to_jax(x))
    msg = str(e.value)
    assert "jaxtorch_newcomer::swish" in msg
    snippet = re.search(r"`(jaxtorch\.register_op\(.*?\))`", msg).group(1)
    assert snippet == "jaxtorch.register_op(torch.ops.jaxtorch_newcomer.swish.default, jax_impl)"

    def jax_impl(x):  # "takes and returns jax arrays"
        return x * jax.nn.sigmoid(x)

    eval(snippet, {"jaxtorch": jaxtorch, "torch": torch, "jax_impl": jax_impl})  # the message's line, verbatim
    out = jax.jit(fn)(params, jaxtorch.to_jax(x))
    np.testing.assert_allclose(np.asarray(out), model(x).detach().numpy(), rtol=1e-6, atol=1e-6)


def test_unsupported_op_message_points_to_coverage_check_which_finds_it():
    model = CustomOpNet(torch.ops.jaxtorch_newcomer.never_lowered)
    x = _x(3, 4)
    with pytest.raises(jaxtorch.UnsupportedOpError) as e:
        jaxtorch.call_torch(model, jaxtorch.to_jax(x))
    assert "jaxtorch.coverage.check(model, *args)" in str(e.value)
    problems = jaxtorch.coverage.check(model, x)
    assert len(problems) == 1 and "jaxtorch_newcomer::never_lowered" in problems[0], problems
    assert jaxtorch.coverage.check(nn.Linear(4, 4), x) == []


def test_unsupported_op_pytorch_first(pytorch_first):
    model = CustomOpNet(torch.ops.jaxtorch_newcomer.never_lowered).to("jax")
    with pytest.raises(jaxtorch.UnsupportedOpError, match=r"register_op\(torch\.ops\.jaxtorch_newcomer\.never_lowered"):
        model(_x(3, 4).to("jax"))
    assert isinstance(jaxtorch.UnsupportedOpError(torch.ops.aten.add.Tensor), NotImplementedError)  # torch's own type


# ---- data-dependent shapes under jit -------------------------------------------------
class MaskedMean(nn.Module):
    """The mean of the rows whose first input feature is positive: `x[mask]` has a data-dependent shape."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(x)[x[:, 0] > 0].mean(0)


class MaskedMeanStatic(MaskedMean):
    """The message's rewrite: `torch.where(mask, x, 0)` keeps the shape static."""

    def forward(self, x):
        mask = (x[:, 0] > 0)[:, None]
        return torch.where(mask, self.fc(x), 0).sum(0) / mask.sum()


def test_boolean_mask_under_jit_says_run_eagerly_or_use_where():
    torch.manual_seed(0)
    model = MaskedMean()
    x = _x(8, 4)
    want = model(x).detach().numpy()
    params, fn = jaxtorch.extract(model)
    xj = jaxtorch.to_jax(x)
    with pytest.raises(jaxtorch.DataDependentError) as e:
        jax.jit(fn)(params, xj)
    msg = str(e.value)
    assert "Run it eagerly (outside jax.jit)" in msg and "`torch.where(mask, x, 0)` instead of `x[mask]`" in msg
    np.testing.assert_allclose(np.asarray(fn(params, xj)), want, rtol=1e-5, atol=1e-6)  # advice 1: eagerly
    static = MaskedMeanStatic()
    static.load_state_dict(model.state_dict())
    sparams, sfn = jaxtorch.extract(static)
    np.testing.assert_allclose(np.asarray(jax.jit(sfn)(sparams, xj)), want, rtol=1e-5, atol=1e-6)  # advice 2


def test_item_in_python_control_flow_pytorch_first(pytorch_first):
    def clip_if_large(x):
        return x / x.norm() if x.norm().item() > 1 else x

    x = _x(5).to("jax") * 3
    fast = jaxtorch.compile(clip_if_large)
    with pytest.raises(jaxtorch.DataDependentError, match=r"tensor ops instead of `\.item\(\)`"):
        fast(x)
    np.testing.assert_allclose(clip_if_large(x).cpu().numpy(), (x.cpu() / x.cpu().norm()).numpy(), rtol=1e-6)  # eager
    rewritten = jaxtorch.compile(lambda x: torch.where(x.norm() > 1, x / x.norm(), x))
    np.testing.assert_allclose(rewritten(x).cpu().numpy(), (x.cpu() / x.cpu().norm()).numpy(), rtol=1e-6)


# ---- a CPU tensor mixed in -----------------------------------------------------------
class ScaledLinear(nn.Module):
    def __init__(self, as_buffer: bool):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        if as_buffer:
            self.register_buffer("scale", torch.linspace(0.5, 2.0, 4))
        else:
            self.scale = torch.linspace(0.5, 2.0, 4)  # a plain attribute: .to() does not move it

    def forward(self, x):
        return self.fc(x) * self.scale


def test_forgotten_input_to_jax_says_move_it(pytorch_first):
    model = nn.Linear(4, 2)
    x = _x(3, 4)
    want = model(x).detach().numpy()
    model.to("jax")
    with pytest.raises(jaxtorch.DeviceMismatchError) as e:
        model(x)
    assert "jax:0 and cpu" in str(e.value) and "`t.to('jax')`" in str(e.value)
    assert isinstance(e.value, RuntimeError)  # `except RuntimeError` written for torch's device errors still works
    np.testing.assert_allclose(model(x.to("jax")).detach().cpu().numpy(), want, rtol=1e-6, atol=1e-6)


def test_tensor_attribute_not_moved_says_register_a_buffer(pytorch_first):
    torch.manual_seed(0)
    plain = ScaledLinear(as_buffer=False)
    x = _x(3, 4)
    want = plain(x).detach().numpy()
    with pytest.raises(jaxtorch.DeviceMismatchError, match="register it as a module buffer"):
        plain.to("jax")(x.to("jax"))
    fixed = ScaledLinear(as_buffer=True)
    fixed.load_state_dict(plain.cpu().state_dict(), strict=False)
    out = fixed.to("jax")(x.to("jax"))
    np.testing.assert_allclose(out.detach().cpu().numpy(), want, rtol=1e-6, atol=1e-6)


def test_cpu_tensors_inside_extract_are_converted_as_the_message_says():
    torch.manual_seed(0)
    model = ScaledLinear(as_buffer=False)
    x = _x(3, 4)
    params, fn = jaxtorch.extract(model)
    assert "scale" not in params  # not a buffer: a constant of the program
    np.testing.assert_allclose(
        np.asarray(jax.jit(fn)(params, jaxtorch.to_jax(x))), model(x).detach().numpy(), rtol=1e-6, atol=1e-6
    )


# ---- float64 with JAX's x64 off ------------------------------------------------------
def test_numpy_float64_data_says_use_float_and_that_works(pytorch_first):
    data = np.random.default_rng(0).normal(size=(3, 4))  # NumPy's default: float64
    model = nn.Linear(4, 2).to("jax")
    with pytest.raises(jaxtorch.Float64Error) as e:
        torch.from_numpy(data).to("jax")
    msg = str(e.value)
    assert "`tensor.float()`" in msg and "jax.config.update('jax_enable_x64', True)" in msg
    assert isinstance(e.value, TypeError)
    out = model(torch.from_numpy(data).float().to("jax"))
    want = torch.nn.functional.linear(torch.from_numpy(data).float(), model.weight.cpu(), model.bias.cpu())
    np.testing.assert_allclose(out.detach().cpu().numpy(), want.detach().numpy(), rtol=1e-6, atol=1e-6)


def test_double_model_through_extract_says_use_float():
    model = nn.Linear(4, 2).double()
    with pytest.raises(jaxtorch.Float64Error, match=r"`tensor\.float\(\)`"):
        jaxtorch.extract(model)
    params, fn = jaxtorch.extract(model.float())
    x = _x(3, 4)
    np.testing.assert_allclose(np.asarray(fn(params, jaxtorch.to_jax(x))), model(x).detach().numpy(), rtol=1e-6)


def test_float64_following_the_x64_advice_keeps_double_precision():
    data = np.linspace(0, 1, 5) + 1e-12  # below float32 resolution
    jax.config.update("jax_enable_x64", True)  # the message's other advice, verbatim
    try:
        out = jaxtorch.call_torch(lambda t: t * 2, jaxtorch.to_jax(torch.from_numpy(data)))
        assert out.dtype == jnp.float64
        np.testing.assert_array_equal(np.asarray(out), data * 2)
    finally:
        jax.config.update("jax_enable_x64", False)


def test_float64_asked_for_inside_torch_code_raises_the_same_advice():
    with pytest.raises(jaxtorch.Float64Error, match=r"jax_enable_x64.*`tensor\.float\(\)`"):
        jaxtorch.call_torch(lambda t: t.double() * 2, jnp.ones(3))  # never narrowed silently
    out = jaxtorch.call_torch(lambda t: t.float() * 2, jnp.ones(3))  # the advice
    assert out.dtype == jnp.float32 and out.tolist() == [2.0, 2.0, 2.0]


# ---- random ops under jit without a key ----------------------------------------------
class DropoutNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.fc(x))


def test_dropout_in_jitted_extract_says_pass_rng_or_eval():
    model = DropoutNet().train()
    params, fn = jaxtorch.extract(model)
    x = jaxtorch.to_jax(_x(4, 8))
    with pytest.raises(jaxtorch.MissingKeyError) as e:
        jax.jit(fn)(params, x)
    msg = str(e.value)
    assert "`fn(params, *args, rng=jax.random.key(step))`" in msg and "`model.eval()`" in msg
    run = jax.jit(fn)
    a, b = run(params, x, rng=jax.random.key(0)), run(params, x, rng=jax.random.key(1))
    assert not np.array_equal(np.asarray(a == 0), np.asarray(b == 0))  # new key, new mask
    np.testing.assert_array_equal(np.asarray(run(params, x, rng=jax.random.key(0))), np.asarray(a))
    assert "jaxtorch.extract(model, train=False)" in msg  # fn's mode is fixed when it is made
    _, efn = jaxtorch.extract(model, train=False)
    want = model.eval()(torch.from_numpy(np.array(x))).detach().numpy()
    np.testing.assert_allclose(np.asarray(jax.jit(efn)(params, x)), want, rtol=1e-6, atol=1e-6)


def test_dropout_in_train_step_without_rng():
    torch.manual_seed(0)
    model = DropoutNet().train()
    init, step = jaxtorch.train.make_train_step(model, lambda o, y: jnp.mean((o - y) ** 2), optax.sgd(0.1))
    x, y = jnp.ones((4, 8)), jnp.zeros((4, 8))
    with pytest.raises(jaxtorch.MissingKeyError, match="rng="):
        step(init(), x, y)
    state, loss = step(init(), x, y, jax.random.key(0))  # step(state, inputs, targets, rng)
    assert int(state.step) == 1 and np.isfinite(float(loss))


def test_dropout_in_compiled_model_pytorch_first(pytorch_first):
    # as with torch.compile, dropout in a compiled module draws from the global generator
    # (seeded by torch.manual_seed): a fresh mask per call, reproducible from the seed
    model = DropoutNet().train().to("jax")
    fast = jaxtorch.compile(model)
    x = _x(4, 8).to("jax")
    torch.manual_seed(3)
    a, b = fast(x).cpu(), fast(x).cpu()
    torch.manual_seed(3)
    assert torch.equal(fast(x).cpu(), a)
    assert not torch.equal(a, b)
    out = fast(x, rng=jax.random.key(0))  # or an explicit key
    assert torch.equal(fast(x, rng=jax.random.key(0)).cpu(), out.cpu())
    dropped = (out.cpu() == 0).float().mean().item()
    assert 0.2 < dropped < 0.8
    model.eval()
    np.testing.assert_allclose(fast(x).detach().cpu().numpy(), model(x).detach().cpu().numpy(), rtol=1e-6, atol=1e-6)
