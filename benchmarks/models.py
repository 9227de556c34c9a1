"""Models shared by the benchmarks: a GPT-2-style torch model and a 4-layer GELU MLP,
with the MLP also written by hand in JAX (the reference for the lowering-quality figures)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch
import transformers


def gpt2(n_layer: int, width: int = 256, vocab: int = 8192, seq: int = 128) -> torch.nn.Module:
    """Hugging Face GPT2LMHeadModel from a small config, random weights, dropout off, eval mode."""
    cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=width, n_layer=n_layer,
                                  n_head=max(1, width // 64), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).eval()


class MLP(torch.nn.Module):
    """4 Linear layers of width 1024 with GELU between them."""

    def __init__(self, width: int = 1024, depth: int = 4):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(width, width) for _ in range(depth)])

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.nn.functional.gelu(x)
        return x


def mlp_jax(params: dict, x: jax.Array) -> jax.Array:
    """The same MLP written by hand in JAX (torch layout: y = x @ W.T + b, exact GELU)."""
    n = len([k for k in params if k.endswith(".weight")])
    for i in range(n):
        x = x @ params[f"layers.{i}.weight"].T + params[f"layers.{i}.bias"]
        if i < n - 1:
            x = jax.nn.gelu(x, approximate=False)
    return x
