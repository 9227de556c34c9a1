"""Hugging Face models from tiny random configs (no downloads) through `jaxtorch.extract`:
jitted outputs to 1e-4 relative and `jax.grad` of a scalar loss to 1e-3 relative against
eager PyTorch on the CPU (issue 2's acceptance)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

import jaxtorch
from tests._hf_models import tiny_llama

transformers = pytest.importorskip("transformers", reason="Hugging Face transformers is not installed")


def _gpt2():
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=100, n_positions=64, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(cfg), "logits", {"use_cache": False}


def _bert():
    cfg = transformers.BertConfig(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        intermediate_size=64,
        vocab_size=100,
        max_position_embeddings=64,
    )
    return transformers.BertModel(cfg), "last_hidden_state", {}


def _llama():
    model = tiny_llama(hidden_size=64, intermediate_size=128, vocab_size=100, bos_token_id=0, eos_token_id=0)
    return model, "logits", {"use_cache": False}


MODELS = {"gpt2": _gpt2, "bert": _bert, "llama": _llama}


def _rel(a, b, scale=None) -> float:
    a, b = np.asarray(a), np.asarray(b)
    return float(np.abs(a - b).max() / (scale if scale is not None else max(np.abs(b).max(), 1e-12)))


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_hf_model_jit_and_grad(name, attn):
    torch.manual_seed(0)
    model, key, kw = MODELS[name]()
    model.config._attn_implementation = attn
    model.eval()
    ids = torch.randint(1, 100, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 9:] = 0  # padding in the second row exercises the attention mask
    ref = model(ids, attention_mask=mask, **kw)[key]

    params, fn = jaxtorch.extract(model)
    jids, jmask = jnp.asarray(ids.numpy()), jnp.asarray(mask.numpy())
    out = jax.jit(lambda p, i, m: fn(p, i, attention_mask=m, **kw)[key])(params, jids, jmask)
    assert _rel(out, ref.detach().numpy()) < 1e-4

    cot = torch.randn(ref.shape)
    (ref * cot).sum().backward()

    def loss(p):
        return jnp.sum(fn(p, jids, attention_mask=jmask, **kw)[key] * jnp.asarray(cot.numpy()))

    grads = jax.jit(jax.grad(loss))(params)  # params are the trainable parameters: no filtering
    # Relative to the largest gradient: some parameters (e.g. attention key biases) have a true
    # gradient of zero, where both sides hold only rounding noise.
    scale = max(float(p.grad.abs().max()) for p in model.parameters() if p.grad is not None)
    checked = 0
    for pname, p in model.named_parameters():
        if p.grad is None:
            continue
        assert pname in grads, pname
        err = _rel(grads[pname], p.grad.numpy(), scale)
        assert err < 1e-3, (pname, err)
        checked += 1
    assert checked > 10


@pytest.mark.parametrize("name", list(MODELS))
def test_hf_model_adamw_trains_params_and_leaves_state_bit_identical(name):
    """Issue 22: `jax.grad(loss)(params)` + 20 `optax.adamw` steps work unchanged on `extract`'s
    params; every buffer (rotary `inv_freq`, BERT's int `position_ids`) and a frozen parameter
    stay bit-identical, and the trained params are the module's trainable parameters."""
    torch.manual_seed(0)
    model, key, kw = MODELS[name]()
    model.eval()
    frozen = next(n for n, _ in model.named_parameters() if n.endswith("bias") or "norm" in n)
    model.get_parameter(frozen).requires_grad_(False)
    params, fn = jaxtorch.extract(model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert set(params) == trainable and frozen in fn.state
    assert {n for n, _ in model.named_buffers()} <= set(fn.state)
    before = {k: np.array(v) for k, v in fn.state.items()}
    ids = jnp.asarray(torch.randint(1, 100, (2, 8)).numpy())
    opt = optax.adamw(1e-2)

    @jax.jit
    def step(params, opt_state):
        loss, g = jax.value_and_grad(lambda p: jnp.mean(fn(p, ids, **kw)[key] ** 2))(params)
        updates, opt_state = opt.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state = opt.init(params)
    losses = []
    for _ in range(20):
        params, opt_state, loss = step(params, opt_state)
        losses.append(float(loss))
    assert losses[-1] < losses[0]
    for k, v in fn.state.items():
        assert np.array_equal(np.asarray(v), before[k]) and v.dtype == before[k].dtype, k
