"""Issue 24 item 4: `make_train_step` holds no reference to the torch module's weight memory
once traced (so `del model` frees it), and a donated state fails loudly when used again.

Memory ratios are measured by `benchmarks/train_memory.py` in subprocesses, not here; these
tests check the structure (who holds what) and the numbers against eager torch.
"""

import copy
import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

import jaxtorch
from jaxtorch.train import DonatedStateError, ModuleReleasedError, make_train_step

from ._models import MLP, BNNet


def mse(out, y):
    return jnp.mean((out - y) ** 2)


def _data(n=8, d=8, k=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g), torch.randn(n, k, generator=g)


def _torch_loss(model: torch.nn.Module, state, x, y) -> float:
    """The loss eager torch computes on a copy of `model` holding `state`'s values."""
    twin = jaxtorch.load_into(copy.deepcopy(model), jax.tree_util.tree_map(jnp.copy, state))
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(twin(x), y))


def _refs(model: torch.nn.Module) -> list[weakref.ref]:
    return [weakref.ref(model), *(weakref.ref(t) for t in [*model.parameters(), *model.buffers()])]


def test_init_and_step_hold_no_reference_to_the_module_weights():
    """After init() and one (traced) step, dropping the caller's module frees its parameters
    and buffers: neither `init`, `step` nor the TrainState keeps them alive."""
    model = BNNet()
    twin = copy.deepcopy(model)  # the same run with the module kept alive, to compare against
    refs = _refs(model)
    init, step = make_train_step(model, mse, optax.adamw(1e-2))
    init_t, step_t = make_train_step(twin, mse, optax.adamw(1e-2))
    state, state_t = init(), init_t()
    x, y = _data(d=6, k=2)
    state, _ = step(state, x, y)
    state_t, _ = step_t(state_t, x, y)
    del model
    gc.collect()
    alive = [r() for r in refs if r() is not None]
    assert not alive, f"the module or its tensors are kept alive: {[type(t).__name__ for t in alive]}"
    # the compiled step goes on without the module, bit for bit the run that kept it
    x2, y2 = _data(d=6, k=2, seed=1)
    state, loss = step(state, x2, y2)
    state_t, loss_t = step_t(state_t, x2, y2)
    assert float(loss) == float(loss_t)
    for a, b in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(state_t)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_module_kept_alive_by_the_caller_still_retraces_and_matches_torch():
    model = MLP()
    init, step = make_train_step(model, mse, optax.sgd(0.1))
    state = init()
    state, _ = step(state, *_data())
    x, y = _data(n=5, seed=2)  # a new batch size: the step traces again, through the live module
    expected = _torch_loss(model, state, x, y)
    state, loss = step(state, x, y)
    np.testing.assert_allclose(float(loss), expected, rtol=1e-6)


def test_retrace_after_the_module_is_freed_raises_and_keeps_the_state():
    model = MLP()
    init, step = make_train_step(model, mse, optax.sgd(0.1))
    state = init()
    state, _ = step(state, *_data())
    del model
    gc.collect()
    with pytest.raises(ModuleReleasedError, match="Keep a reference to the module"):
        step(state, *_data(n=5))
    with pytest.raises(ReferenceError):  # also a ReferenceError, as a dead weakref's
        init()
    state, loss = step(state, *_data(seed=3))  # the failed retrace donated nothing
    assert np.isfinite(float(loss)) and int(state.step) == 2


def test_init_reads_the_live_module_each_call_and_explicit_values_need_no_module():
    model = MLP()
    init, step = make_train_step(model, mse, optax.sgd(0.1))
    first = init()
    with torch.no_grad():
        model.fc1.weight.add_(1.0)  # a torch-side change after the first init()
    second = init()
    np.testing.assert_array_equal(np.asarray(second.params["fc1.weight"]), model.fc1.weight.detach().numpy())
    assert not np.array_equal(np.asarray(first.params["fc1.weight"]), np.asarray(second.params["fc1.weight"]))
    del model
    gc.collect()
    third = init(params=dict(second.params), model_state=dict(second.model_state))
    assert set(third.params) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}


def test_a_module_built_inline_trains():
    """`make_train_step(MLP(), ...)`: the step and init keep the module until they used it."""
    init, step = make_train_step(MLP(), mse, optax.sgd(0.1))
    gc.collect()
    state = init()
    for i in range(2):
        state, loss = step(state, *_data(seed=i))
    assert int(state.step) == 2 and np.isfinite(float(loss))


def test_jit_false_keeps_the_module():
    """Unjitted, every step runs the module's forward: it stays alive."""
    model = MLP()
    ref = weakref.ref(model)
    init, step = make_train_step(model, mse, optax.sgd(0.1), jit=False)
    state = init()
    state, _ = step(state, *_data())
    del model
    gc.collect()
    assert ref() is not None
    state, loss = step(state, *_data(seed=1))
    assert int(state.step) == 2


def test_a_donated_state_raises_a_clear_error():
    model = MLP()
    init, step = make_train_step(model, mse, optax.adamw(1e-2))
    old = init()
    new, _ = step(old, *_data())
    with pytest.raises(DonatedStateError, match="donate=False"):
        step(old, *_data())
    with pytest.raises(DonatedStateError, match="donated to an earlier step"):
        jaxtorch.load_into(model, old)
    with pytest.raises(DonatedStateError):  # a donated array mixed into a fresh state
        step(new._replace(params={**new.params, "fc1.weight": old.params["fc1.weight"]}), *_data())
    new, _ = step(new, *_data())  # the state returned goes on
    jaxtorch.load_into(model, new)


def test_donate_false_keeps_every_old_state_usable():
    model = MLP()
    init, step = make_train_step(model, mse, optax.adamw(1e-2), donate=False)
    s0 = init()
    x, y = _data()
    s1, l1 = step(s0, x, y)
    s1b, l1b = step(s0, x, y)  # the same state twice: the same result
    assert float(l1) == float(l1b)
    for a, b in zip(jax.tree_util.tree_leaves(s1), jax.tree_util.tree_leaves(s1b)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    jaxtorch.load_into(model, s0)
    np.testing.assert_allclose(float(l1), _torch_loss(model, s0, x, y), rtol=1e-6)


def test_repr_of_a_freed_function():
    model = MLP()
    fn = jaxtorch.bridge.api._jax_first.module_function(model, mutable=True)
    fn.release_module()
    assert "MLP" in repr(fn)
    del model
    gc.collect()
    assert "freed" in repr(fn)
    with pytest.raises(ModuleReleasedError):
        fn.module  # noqa: B018


def test_a_retrace_after_release_keeps_the_mode_fixed_at_make_time():
    """Released (held weakly), the step still runs every submodule in the mode it had when the
    step was made, whatever `eval()` the caller ran since, and puts the caller's flags back."""
    model = BNNet().train()
    init, step = make_train_step(model, mse, optax.sgd(0.1))
    state, _ = step(init(), *_data(d=6, k=2))
    model.eval()
    x, y = _data(n=5, d=6, k=2, seed=4)  # a new batch size: traced again, through the live module
    twin = jaxtorch.load_into(copy.deepcopy(model), jax.tree_util.tree_map(jnp.copy, state)).train()
    with torch.no_grad():
        expected = float(torch.nn.functional.mse_loss(twin(x), y))  # batch statistics: train mode
    state, loss = step(state, x, y)
    np.testing.assert_allclose(float(loss), expected, rtol=1e-6)
    assert not model.training and not model.bn.training
