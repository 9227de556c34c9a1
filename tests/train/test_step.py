"""make_train_step, extract(mutable=True) and rng, against eager PyTorch."""

import copy

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

import jaxtorch
from jaxtorch.train import MixedPrecision, make_train_step

from ._models import CNN, MLP, BNNet


def mse(out, y):
    return jnp.mean((out - y) ** 2)


def _data(n=8, d=8, k=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g), torch.randn(n, k, generator=g)


def _torch_steps(model, opt, batches):
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _assert_params_match(state, model, atol=1e-5):
    values = {**state.params, **state.model_state}
    assert set(values) == set(model.state_dict())
    for name, t in model.state_dict().items():
        np.testing.assert_allclose(
            np.asarray(values[name], np.float64), t.double().numpy(), atol=atol, rtol=1e-5, err_msg=name
        )


# ---- extract(mutable=True) and rng -------------------------------------------------------
def test_batchnorm_stats_match_torch():
    model = BNNet().train()
    ref = copy.deepcopy(model)
    params, fn = jaxtorch.extract(model, mutable=True)
    x = torch.randn(16, 6) * 3 + 1
    state = fn.state
    for _ in range(3):
        out, state = jax.jit(fn)(params, jaxtorch.to_jax(x), state=state)
        expected = ref(x)
    np.testing.assert_allclose(out, expected.detach().numpy(), atol=1e-4)
    for name in ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked"):
        np.testing.assert_allclose(state[name], ref.state_dict()[name].numpy(), atol=1e-4, err_msg=name)
    assert int(state["bn.num_batches_tracked"]) == 3
    assert model.bn.num_batches_tracked.item() == 0  # the module itself is untouched


def test_eval_mode_leaves_buffers():
    model = BNNet().eval()
    params, fn = jaxtorch.extract(model, mutable=True)
    out, new = fn(params, jnp.ones((4, 6)))
    assert set(new) == set(fn.state) == {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked"}
    for k in fn.state:
        np.testing.assert_array_equal(new[k], fn.state[k])
    np.testing.assert_allclose(out, model(torch.ones(4, 6)).detach().numpy(), atol=1e-5)


def test_dropout_follows_key_under_jit():
    model = torch.nn.Dropout(0.5).train()
    params, fn = jaxtorch.extract(model)
    f = jax.jit(fn)
    x = jnp.ones((64,))
    a, b, c = (
        f(params, x, rng=jax.random.key(1)),
        f(params, x, rng=jax.random.key(1)),
        f(params, x, rng=jax.random.key(2)),
    )
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert set(np.unique(np.asarray(a)).tolist()) <= {0.0, 2.0}
    with pytest.raises(jaxtorch.MissingKeyError):
        f(params, x)


# ---- make_train_step ---------------------------------------------------------------------
def test_sgd_matches_torch():
    model = MLP()
    ref = copy.deepcopy(model)
    init, step = make_train_step(model, mse, optax.sgd(0.1, momentum=0.9))
    state = init()
    batches = [_data(seed=i) for i in range(4)]
    losses = []
    for x, y in batches:
        state, loss = step(state, x, y)
        losses.append(float(loss))
    expected = _torch_steps(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9), batches)
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    _assert_params_match(state, ref)
    assert int(state.step) == 4


def test_adam_with_batchnorm_matches_torch():
    model = BNNet().train()
    ref = copy.deepcopy(model)
    init, step = make_train_step(model, mse, optax.adam(1e-2))
    state = init()
    batches = [(torch.randn(16, 6), torch.randn(16, 2)) for _ in range(5)]
    losses = []
    for x, y in batches:
        state, loss = step(state, x, y)
        losses.append(float(loss))
    expected = _torch_steps(ref, torch.optim.Adam(ref.parameters(), lr=1e-2), batches)
    np.testing.assert_allclose(losses, expected, rtol=1e-4, atol=1e-5)
    _assert_params_match(state, ref, atol=1e-4)


def test_frozen_params_are_bit_identical():
    model = MLP()
    init, step = make_train_step(model, mse, optax.adam(1e-2), trainable="fc2.*")
    state = init()
    before = {k: np.array(v) for k, v in {**state.params, **state.model_state}.items()}
    assert set(state.params) == set(state.opt_state[0].mu) == {"fc2.weight", "fc2.bias"}
    assert set(state.model_state) == {"fc1.weight", "fc1.bias"}
    for i in range(3):
        state, _ = step(state, *_data(seed=i))
    for k in ("fc1.weight", "fc1.bias"):
        v = state.model_state[k]
        assert np.array_equal(np.asarray(v), before[k]) and v.dtype == before[k].dtype
    assert not np.array_equal(np.asarray(state.params["fc2.weight"]), before["fc2.weight"])

    trainable = lambda name, v: name.endswith("bias")
    _, step2 = make_train_step(model, mse, optax.sgd(0.1), trainable=trainable, donate=False)
    init2, _ = make_train_step(model, mse, optax.sgd(0.1), trainable=trainable)
    s = init2()
    s2, _ = step2(s, *_data())
    np.testing.assert_array_equal(s2.model_state["fc1.weight"], s.model_state["fc1.weight"])
    assert not np.array_equal(s2.params["fc1.bias"], s.params["fc1.bias"])


def test_requires_grad_false_is_never_trained_and_buffers_only_change_through_the_forward():
    """Issue 22: a parameter with requires_grad=False is state, never trained (with AdamW's
    weight decay too), and so are buffers the forward does not write (eval-mode BatchNorm)."""
    model = BNNet().eval()
    model.fc.weight.requires_grad_(False)
    model.register_buffer("unused", torch.arange(3.0))
    init, step = make_train_step(model, mse, optax.adamw(1e-1, weight_decay=0.5))
    state = init()
    assert set(state.params) == {"bn.weight", "bn.bias", "out.weight", "out.bias"}
    assert "fc.weight" in state.model_state and "bn.running_var" in state.model_state
    before = {k: np.array(v) for k, v in state.model_state.items()}
    for _ in range(3):
        state, _ = step(state, torch.randn(8, 6), torch.randn(8, 2))
    for k, v in state.model_state.items():
        assert np.array_equal(np.asarray(v), before[k]) and v.dtype == before[k].dtype, k
    jaxtorch.load_into(model, state)
    assert model.fc.weight.requires_grad is False


def test_state_is_donated_by_default_and_kept_with_donate_false():
    model = MLP()
    x, y = _data()
    init, step = make_train_step(model, mse, optax.adamw(1e-2))
    s0 = init()
    step(s0, x, y)
    assert s0.params["fc1.weight"].is_deleted()
    init_k, step_k = make_train_step(model, mse, optax.adamw(1e-2), donate=False)
    k0 = init_k()
    step_k(k0, x, y)
    assert not k0.params["fc1.weight"].is_deleted()


def test_step_keeps_no_reference_to_the_module_weights():
    """Issue 24: after `init`, only the TrainState holds arrays of the weights (the step keeps
    no snapshot of the module sharing its memory), so donation can free every old array."""
    import gc

    model = MLP(d_in=13, d_hidden=7, d_out=4)  # shapes no other test uses
    init, step = make_train_step(model, mse, optax.adamw(1e-2))
    state = init()
    state, _ = step(state, torch.randn(8, 13), torch.randn(8, 4))
    gc.collect()
    held = {id(x) for x in jax.tree_util.tree_leaves(state)}
    extra = [a.shape for a in jax.live_arrays() if a.shape in {(7, 13), (4, 7)} and id(a) not in held]
    assert not extra, f"arrays of the weights kept outside the TrainState: {extra}"
    assert step is not None and init is not None


def test_accumulation_equals_full_batch():
    model = MLP()
    x, y = _data(n=16)
    init, step = make_train_step(model, mse, optax.adam(1e-2))
    init4, step4 = make_train_step(model, mse, optax.adam(1e-2), accumulate=4)
    s1, s4 = init(), init4()
    for _ in range(2):
        s1, l1 = step(s1, x, y)
        s4, l4 = step4(s4, x, y)
    np.testing.assert_allclose(l4, l1, rtol=1e-5)
    for k in s1.params:
        np.testing.assert_allclose(s4.params[k], s1.params[k], atol=1e-5, err_msg=k)
    with pytest.raises(ValueError, match="does not divide"):
        make_train_step(model, mse, optax.sgd(0.1), accumulate=3)[1](init(), x, y)


def test_accumulation_threads_batchnorm_stats():
    model = BNNet().train()
    ref = copy.deepcopy(model)
    init, step = make_train_step(model, mse, optax.sgd(0.0), accumulate=2)
    x, y = torch.randn(16, 6), torch.randn(16, 2)
    state, _ = step(init(), x, y)
    ref(x[:8]), ref(x[8:])  # torch: two micro-batches, two running-stat updates
    for name in ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked"):
        np.testing.assert_allclose(state.model_state[name], ref.state_dict()[name].numpy(), atol=1e-4, err_msg=name)


@pytest.mark.parametrize("policy", [True, "dots_saveable", "nothing_saveable"])
def test_remat_gives_same_step(policy):
    model = CNN()
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 3, (4,))

    def xent(logits, labels):
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    init, step = make_train_step(model, xent, optax.adam(1e-2))
    initr, stepr = make_train_step(model, xent, optax.adam(1e-2), remat=policy)
    key = jax.random.key(0)
    (s, l), (sr, lr) = step(init(), x, y, key), stepr(initr(), x, y, key)
    np.testing.assert_allclose(lr, l, rtol=1e-6)
    for k in s.params:
        np.testing.assert_allclose(sr.params[k], s.params[k], atol=1e-6, err_msg=k)
    jx, jy = jaxtorch.to_jax(x), jaxtorch.to_jax(y)
    assert "remat" in str(jax.make_jaxpr(stepr.pure)(initr(), jx, jy, key))
    assert "remat" not in str(jax.make_jaxpr(step.pure)(init(), jx, jy, key))
    with pytest.raises(ValueError, match="unknown policy"):
        make_train_step(model, xent, optax.sgd(0.1), remat="no_such_policy")


def test_dropout_masks_differ_by_key_and_need_one():
    model = CNN().train()

    def xent(logits, labels):
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    init, step = make_train_step(model, xent, optax.sgd(0.1), donate=False)  # s is used three times
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 3, (4,))
    s = init()
    (_, a), (_, b), (_, c) = (
        step(s, x, y, jax.random.key(0)),
        step(s, x, y, jax.random.key(0)),
        step(s, x, y, jax.random.key(1)),
    )
    assert float(a) == float(b) and float(a) != float(c)
    with pytest.raises(jaxtorch.MissingKeyError):
        step(s, x, y)


def test_mixed_precision_keeps_fp32_master_weights():
    model = MLP()
    x, y = _data(n=16)
    init, step = make_train_step(model, mse, optax.adam(1e-2))
    initm, stepm = make_train_step(model, mse, optax.adam(1e-2), mixed_precision="bf16")
    s, sm = init(), initm()
    for _ in range(3):
        s, l = step(s, x, y)
        sm, lm = stepm(sm, x, y)
    assert all(v.dtype == jnp.float32 for v in sm.params.values())
    assert lm.dtype == jnp.float32
    np.testing.assert_allclose(lm, l, rtol=3e-2)  # bf16 has 8 mantissa bits
    assert not np.array_equal(np.asarray(lm), np.asarray(l))  # the forward really ran in bf16
    hlo = stepm.lower(sm, jaxtorch.to_jax(x), jaxtorch.to_jax(y)).as_text()
    assert "bf16" in hlo

    init16, step16 = make_train_step(model, mse, optax.sgd(0.1), mixed_precision=MixedPrecision(loss_scale=128.0))
    s16, l16 = step16(init16(), x, y)
    _, lref = make_train_step(model, mse, optax.sgd(0.1), mixed_precision="bf16")[1](init16(), x, y)
    np.testing.assert_allclose(l16, lref, rtol=1e-6)  # the reported loss is unscaled


def test_inputs_as_tuple_and_dict():
    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 2)

        def forward(self, a, b=None):
            return self.fc(a) + self.fc(b)

    model = Two()
    a, b, y = torch.randn(3, 4), torch.randn(3, 4), torch.randn(3, 2)
    init, step = make_train_step(model, mse, optax.sgd(0.1))
    _, l1 = step(init(), (a, b), y)
    _, l2 = step(init(), {"a": a, "b": b}, y)
    expected = torch.nn.functional.mse_loss(model(a, b), y).item()
    np.testing.assert_allclose([float(l1), float(l2)], [expected] * 2, rtol=1e-5)


def test_one_compilation_across_steps_and_resume(tmp_path):
    from jaxtorch.train import load_checkpoint, save_checkpoint

    model = MLP()
    init, step = make_train_step(model, mse, optax.adamw(1e-2))
    state = init()
    for i in range(3):
        state, _ = step(state, *_data(seed=i))
    save_checkpoint(state, tmp_path / "c.safetensors")
    state, _ = step(load_checkpoint(tmp_path / "c.safetensors"), *_data())
    assert step.jitted._cache_size() == 1  # init, step outputs and loaded states all look alike to jit


# ---- issue 30: refusals and errors a user can act on ----------------------------------------------
def test_trainable_pattern_matching_nothing_raises_naming_the_parameters():
    """Issue 30 item 3: a pattern that selects nothing trained nothing, silently."""
    model = MLP()
    for trainable in ("head.*", ["fc2.*", "fc3.*"], lambda name, v: False):
        with pytest.raises(ValueError, match="no trainable parameter") as info:
            make_train_step(model, mse, optax.sgd(0.1), trainable=trainable)
        assert "fc1.weight" in str(info.value) and "fc2.bias" in str(info.value)
    model.fc1.weight.requires_grad_(False)
    with pytest.raises(ValueError, match="frozen.*fc1.weight"):
        make_train_step(model, mse, optax.sgd(0.1), trainable="fc1.weight")
    init, _ = make_train_step(model, mse, optax.sgd(0.1), trainable=(g for g in ["fc2.*"]))  # a generator: read once
    assert set(init().params) == {"fc2.weight", "fc2.bias"}


class _CrossEntropy(torch.nn.Module):
    """A model whose forward computes torch's cross_entropy (its targets are an input)."""

    def __init__(self):
        super().__init__()
        self.net = MLP()

    def forward(self, x, labels):
        return torch.nn.functional.cross_entropy(self.net(x), labels)


def test_checks_raise_torchs_error_and_keep_the_donated_state():
    """Issue 30 item 9: under `jaxtorch.checks()` an out-of-range target raised DonatedStateError
    (the check failed after the state was donated) and the state was lost."""
    model = _CrossEntropy()
    ref = copy.deepcopy(model)
    init, step = make_train_step(model, lambda loss, _: loss, optax.sgd(0.1))
    x, bad, good = torch.randn(8, 8), torch.tensor([0, 1, 2, 3, 4, 0, 1, 2]), torch.tensor([0, 1, 2, 3, 3, 0, 1, 2])
    with pytest.raises(IndexError) as expected:
        torch.nn.functional.cross_entropy(ref.net(x), bad)
    state = init()
    with jaxtorch.checks(), pytest.raises(IndexError) as got:
        step(state, (x, bad), None)
    assert str(got.value) == str(expected.value)
    with jaxtorch.checks():
        state, loss = step(state, (x, good), None)  # the state survived the step that raised
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    expected_loss = ref(x, good)
    expected_loss.backward()
    opt.step()
    np.testing.assert_allclose(float(loss), expected_loss.item(), rtol=1e-6)
    jaxtorch.load_into(model, state)
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), atol=1e-6, err_msg=name)


class _Scaled(torch.nn.Module):
    """An MLP whose forward also takes non-batch arguments (a scalar, HF's `use_cache`, None)."""

    def __init__(self):
        super().__init__()
        self.net = MLP()

    def forward(self, x, scale, use_cache=True, past=None):
        assert use_cache is False and past is None, (use_cache, past)  # Python values, as in torch
        return self.net(x) * scale


@pytest.mark.parametrize("accumulate", [1, 2, 4])
def test_accumulate_passes_non_batch_inputs_to_every_micro_step(accumulate):
    """Issue 30 item 10: `IndexError: tuple index out of range` from splitting a scalar; `use_cache=False`
    must reach the model as a Python bool. Matches torch's gradient accumulation (loss / accumulate per
    micro-batch, one optimizer step)."""
    model = _Scaled()
    ref = copy.deepcopy(model)
    x, y = _data(n=8)
    init, step = make_train_step(model, mse, optax.sgd(0.1), accumulate=accumulate)
    state, loss = step(init(), {"x": x, "scale": 2.0, "use_cache": False, "past": None}, y)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    total = 0.0
    for xs, ys in zip(x.chunk(accumulate), y.chunk(accumulate)):
        micro = torch.nn.functional.mse_loss(ref(xs, 2.0, use_cache=False), ys) / accumulate
        micro.backward()
        total += micro.item()
    opt.step()
    np.testing.assert_allclose(float(loss), total, rtol=1e-5)
    _assert_params_match(state, ref)


def test_accumulate_refuses_arrays_of_another_leading_size():
    class WithTable(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = MLP()

        def forward(self, x, table):
            return self.net(x) + table.sum()

    x, y = _data(n=8)
    _, step = make_train_step(WithTable(), mse, optax.sgd(0.1), accumulate=2)
    init, _ = make_train_step(WithTable(), mse, optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"first dimensions differ.*inputs\[1\]: \(3, 5\)"):
        step(init(), (x, torch.ones(3, 5)), y)
