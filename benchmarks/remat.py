"""Remat (activation checkpointing): memory of a Llama train step with and without it.

One `jaxtorch.jit` train step (forward, `loss.backward()`) of a Llama built from a small
config (random weights), compiled three ways: no remat, and Hugging Face's
`activation_checkpointing_enable()` with `use_reentrant=False` and `True`; then the JAX-first
path (`extract` + `jax.grad`, as `make_train_step` differentiates) without and with it.
Two deterministic figures per program, no run needed:

- XLA's own memory plan (`compiled.memory_analysis()`, temporary buffers): it depends on the
  backend's scheduler (on the CPU even pure JAX's `jax.checkpoint` saves nothing);
- the in-order peak of live bytes (`benchmarks/_liveness.py`): the program's equations run
  in their traced order, each value freed after its last use. This is what remat changes.

A pure-JAX reference (`jax.checkpoint` of an MLP stack) shows both figures for JAX's own
remat. Gradients of the checkpointed steps are compared with the unchecked step's.

    python benchmarks/remat.py             # default backend
    python benchmarks/remat.py --layers 8 --seq 1024
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import torch
import transformers

import jaxtorch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._liveness import peak_live_bytes, programs_recorded


def _temp_mib(jitted, args) -> float:
    return jitted.lower(*args).compile().memory_analysis().temp_size_in_bytes / 2**20


def _live_mib(jitted, args) -> float:
    return peak_live_bytes(jitted.trace(*args).jaxpr) / 2**20


def llama_step(cfg, ids, mode: str):
    """(XLA temp MiB, in-order peak live MiB, loss, grads) of a `jaxtorch.jit` step with
    `loss.backward()` inside, for remat `mode`: none / reentrant / non-reentrant."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).train().to("jax")
    if mode != "none":
        model.activation_checkpointing_enable({"use_reentrant": mode == "reentrant"})

    @jaxtorch.jit
    def step(model, ids):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach()  # (a loss that requires grad makes the program a VJP for a second backward)

    record: list = []
    with programs_recorded(record):
        loss = step(model, ids)
    jitted, args = record[-1]
    grads = {n: p.grad.cpu() for n, p in model.named_parameters()}
    return _temp_mib(jitted, args), _live_mib(jitted, args), float(loss.cpu()), grads


def jax_first_step(cfg, ids, mode: str):
    """(XLA temp MiB, in-order peak live MiB) of `jax.jit(jax.grad(loss))` of the model's
    `extract`ed function: the JAX-first path (`make_train_step` differentiates the same way)."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).train()
    if mode != "none":
        model.activation_checkpointing_enable({"use_reentrant": mode == "reentrant"})
    params, fn = jaxtorch.extract(model)
    x = jaxtorch.to_jax(ids)

    def loss(params, x):
        return fn(params, input_ids=x, labels=x).loss

    grad = jax.jit(jax.grad(loss))
    return _temp_mib(grad, (params, x)), _live_mib(grad, (params, x))


def jax_reference(layers: int, batch: int, dim: int) -> tuple[float, float, float, float]:
    """XLA temp MiB and in-order peak live MiB of `jax.grad` of an MLP stack, without and
    with `jax.checkpoint` per block."""

    def block(p, x):
        return x + jax.nn.gelu(x @ p[0]) @ p[1]

    def loss(ps, x, remat):
        f = jax.checkpoint(block) if remat else block
        for p in ps:
            x = f(p, x)
        return (x**2).mean()

    k = jax.random.key(0)
    ps = [(jax.random.normal(k, (dim, 4 * dim)), jax.random.normal(k, (4 * dim, dim))) for _ in range(layers)]
    x = jax.random.normal(k, (batch, dim))
    out = []
    for remat in (False, True):
        g = jax.jit(jax.grad(lambda ps, x, r=remat: loss(ps, x, r)))
        out += [_temp_mib(g, (ps, x)), _live_mib(g, (ps, x))]
    return out[0], out[2], out[1], out[3]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    a = ap.parse_args()
    cfg = transformers.LlamaConfig(
        num_hidden_layers=a.layers,
        hidden_size=a.hidden,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=4 * a.hidden,
        vocab_size=512,
        max_position_embeddings=a.seq,
        attn_implementation="sdpa",
    )
    ids = torch.randint(0, 512, (a.batch, a.seq), generator=torch.Generator().manual_seed(1)).to("jax")
    where = f"{jax.default_backend()} ({jax.devices()[0].device_kind})"
    print(f"backend: {where}; Llama {a.layers} layers, hidden {a.hidden}, batch {a.batch} x seq {a.seq}")
    print(f"{'':34s} {'XLA temp':>10s} {'in-order peak':>14s}")
    jaxtorch.enable_globally()
    base_mib, base_live, base_loss, base_grads = llama_step(cfg, ids, "none")
    print(f"  jit, no remat:                    {base_mib:7.1f} MiB {base_live:10.1f} MiB  loss {base_loss:.6f}")
    for mode in ("non-reentrant", "reentrant"):
        mib, live, loss, grads = llama_step(cfg, ids, mode)
        diff = max((grads[n] - g).abs().max().item() for n, g in base_grads.items())
        print(
            f"  jit, remat ({mode:13s}):         {mib:7.1f} MiB {live:10.1f} MiB  loss {loss:.6f}"
            f"  max |grad diff| {diff:.2e}"
        )
    jaxtorch.disable_globally()
    for mode in ("none", "non-reentrant"):
        mib, live = jax_first_step(cfg, ids, mode)
        print(f"  extract + jax.grad, {mode:13s}: {mib:7.1f} MiB {live:10.1f} MiB")
    plain, remat, plain_live, remat_live = jax_reference(a.layers, a.batch * a.seq, a.hidden)
    print(f"  pure JAX MLP stack, plain:        {plain:7.1f} MiB {plain_live:10.1f} MiB")
    print(f"  pure JAX MLP stack, jax.checkpoint:{remat:6.1f} MiB {remat_live:10.1f} MiB")


if __name__ == "__main__":
    main()
