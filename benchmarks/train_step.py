"""Benchmark: a jitted jaxtorch train step of a GPT-2-style model vs eager PyTorch, on the CPU.

The model is Hugging Face's `GPT2LMHeadModel` (4 layers, width 256, 4 heads, random
weights, dropout off) on a batch of 8 x 128 tokens. PyTorch: `loss.backward()` +
`torch.optim.Adam.step()` eagerly. jaxtorch: `jaxtorch.train.make_train_step` with
`optax.adam` (jitted, state donated). Both take the same number of timed steps after
warm-up, interleaved (a busy machine slows both alike); the figure is the ratio of
median step times (below 1: jaxtorch is faster).

    python benchmarks/train_step.py                 # GPT-2's vocabulary (50257)
    python benchmarks/train_step.py --vocab 8192 --steps 10
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
import transformers

from jaxtorch.train import make_train_step


def build(vocab: int, seq: int) -> torch.nn.Module:
    config = transformers.GPT2Config(
        vocab_size=vocab,
        n_positions=seq,
        n_embd=256,
        n_layer=4,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=vocab - 1,
        eos_token_id=vocab - 1,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).train()


def lm_loss(outputs, ids):
    logits = outputs.logits[:, :-1].astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()


def time_steps(run, warmup: int, steps: int) -> list[float]:
    for _ in range(warmup):
        run()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    ids_np = np.random.default_rng(0).integers(0, args.vocab, (args.batch, args.seq)).astype(np.int64)

    # eager PyTorch
    model = build(args.vocab, args.seq)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    ids_t = torch.from_numpy(ids_np)
    losses_t: list[float] = []

    def torch_step():
        opt.zero_grad(set_to_none=True)
        loss = model(ids_t, labels=ids_t).loss
        loss.backward()
        opt.step()
        losses_t.append(loss.item())

    # jaxtorch: the same model (a fresh build of the same initial weights), jitted optax step
    jmodel = build(args.vocab, args.seq)
    init, step = make_train_step(jmodel, lm_loss, optax.adam(1e-4), donate=True)
    box = {"state": init()}
    ids_j = jnp.asarray(ids_np.astype(np.int32))
    key = jax.random.key(0)
    losses_j: list[float] = []

    def jax_step():
        box["state"], loss = step(box["state"], ids_j, ids_j, key)
        losses_j.append(float(loss))  # blocks until the step is finished

    t0 = time.perf_counter()
    jax_step()
    compile_s = time.perf_counter() - t0
    for _ in range(args.warmup):
        torch_step()
        jax_step()
    # interleaved, so that load from other processes hits both sides alike
    t_torch, t_jax = [], []
    for _ in range(args.steps):
        t_torch += time_steps(torch_step, 0, 1)
        t_jax += time_steps(jax_step, 0, 1)

    med_t, med_j = statistics.median(t_torch), statistics.median(t_jax)
    print(
        f"GPT-2-style: 4 layers, width 256, batch {args.batch}x{args.seq}, vocab {args.vocab}; "
        f"torch {torch.__version__}, jax {jax.__version__}, {jax.devices()[0].platform}, "
        f"{torch.get_num_threads()} torch threads; steps interleaved"
    )
    print(f"first losses: torch {losses_t[0]:.4f}  jaxtorch {losses_j[0]:.4f}")
    print(f"eager PyTorch (backward + Adam): median {med_t * 1e3:.1f} ms/step over {args.steps} steps")
    print(
        f"jaxtorch jitted step (optax adam): median {med_j * 1e3:.1f} ms/step (first call incl. compile "
        f"{compile_s:.1f} s)"
    )
    print(f"ratio jaxtorch / PyTorch: {med_j / med_t:.2f}x")


if __name__ == "__main__":
    main()
