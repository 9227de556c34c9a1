"""PEFT LoRA on a Llama trained by `make_train_step(..., trainable=...)` (issue 12 item 5).

A small Llama from a config with random weights, wrapped by `peft.get_peft_model`; only
the LoRA matrices train: the loss falls, every other array stays bit-identical, and the
first step's gradients equal torch autograd's on the same batch.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

from jaxtorch.train import make_train_step
from tests._hf_models import tiny_llama

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

LORA = "*lora_*"


@pytest.fixture(scope="module")
def lora_llama():
    torch.manual_seed(0)
    model = tiny_llama(max_position_embeddings=32, use_cache=False)
    # init_lora_weights=False: B random, not zero, so A's gradient is not trivially zero either
    config = peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    model = peft.get_peft_model(model, config).eval()
    ids = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(1))
    return model, ids


def lm_loss(out, ids):
    return optax.softmax_cross_entropy_with_integer_labels(out.logits[:, :-1], ids[:, 1:]).mean()


def keep_grads(lr: float) -> optax.GradientTransformation:
    """SGD whose state is the last gradient it saw (so a test can read the step's exact gradients)."""
    return optax.GradientTransformation(
        lambda params: jax.tree_util.tree_map(jnp.zeros_like, params),
        lambda grads, state, params=None: (jax.tree_util.tree_map(lambda g: -lr * g, grads), grads),
    )


def test_peft_names_the_lora_weights_trainable(lora_llama):
    model, _ = lora_llama
    lora = {n for n, p in model.named_parameters() if p.requires_grad}
    assert lora and all("lora_" in n for n in lora)
    assert len(lora) == 2 * 2 * 2  # 2 layers x (q, v) x (A, B)


def test_lora_training_moves_only_lora_weights(lora_llama):
    model, ids = lora_llama
    init, step = make_train_step(model, lm_loss, optax.adam(1e-2), trainable=LORA)
    state = init()
    before = {k: np.asarray(v).copy() for k, v in state.params.items()}
    x = jnp.asarray(ids.numpy())
    losses = []
    for _ in range(6):
        state, loss = step(state, x, x)
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 0.05, losses
    lora = [k for k in before if "lora_" in k]
    assert len(lora) == 8 and set(state.opt_state[0].mu) == set(lora)
    for k, v in before.items():
        if k in lora:
            assert not np.array_equal(np.asarray(state.params[k]), v), k
        else:
            np.testing.assert_array_equal(np.asarray(state.params[k]), v, err_msg=k)


def test_first_step_lora_gradients_equal_torch_autograd(lora_llama):
    model, ids = lora_llama
    init, step = make_train_step(model, lm_loss, keep_grads(0.1), trainable=LORA)
    state, loss = step(init(), jnp.asarray(ids.numpy()), jnp.asarray(ids.numpy()))
    grads = state.opt_state

    model.zero_grad()
    logits = model(input_ids=ids).logits
    ref = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    ref.backward()
    np.testing.assert_allclose(float(loss), ref.item(), rtol=1e-6)
    torch_grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert set(grads) == set(torch_grads)
    for name, g in torch_grads.items():
        assert np.abs(g.numpy()).max() > 0, name
        np.testing.assert_allclose(np.asarray(grads[name]), g.numpy(), rtol=1e-5, atol=1e-7, err_msg=name)
    model.zero_grad()
