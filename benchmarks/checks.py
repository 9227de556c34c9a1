"""Benchmark: the cost of checked mode (`jaxtorch.checks()`, issue 23) under `jaxtorch.jit`.

A small language-model forward and loss: `nn.Embedding` (vocab 8192, width 256), two
`Linear`+GELU layers, a tied-free output projection and `F.cross_entropy` on a batch of
8 x 128 token ids, compiled with `jaxtorch.jit`. The same function runs with checks off
(the default: the program has no checks at all) and on (the program is wrapped in
`checkify.checkify`; the embedding's ids and the loss targets are range-checked on every
call), interleaved call by call after warm-up (a busy machine slows both alike); medians,
reported as the ratio on / off. Also printed: the forward and backward train step
(`loss.backward()` inside the jitted function).

    python benchmarks/checks.py                  # 30 timed calls each
    python benchmarks/checks.py --calls 10 --vocab 1024
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import torch
import torch.nn.functional as F

import jaxtorch


class TinyLM(torch.nn.Module):
    """Embedding -> 2 x (Linear, GELU) -> vocabulary logits."""

    def __init__(self, vocab: int, width: int):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, width)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(2))
        self.out = torch.nn.Linear(width, vocab)

    def forward(self, ids, targets):
        h = self.emb(ids)
        for layer in self.layers:
            h = F.gelu(layer(h))
        logits = self.out(h)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _time(fn, *args) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args).jax())
    return time.perf_counter() - t0


def measure(fn, args, calls: int) -> tuple[float, float]:
    """Median seconds per call with checks off and on, interleaved."""
    for on in (False, True):  # warm-up: compile both programs
        with jaxtorch.checks(on):
            _time(fn, *args)
            _time(fn, *args)
    off, on_ = [], []
    for _ in range(calls):
        with jaxtorch.checks(False):
            off.append(_time(fn, *args))
        with jaxtorch.checks(True):
            on_.append(_time(fn, *args))
    return statistics.median(off), statistics.median(on_)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    a = p.parse_args()
    torch.manual_seed(0)
    model = TinyLM(a.vocab, a.width).to("jax")
    ids = torch.randint(0, a.vocab, (a.batch, a.seq)).to("jax")
    targets = torch.randint(0, a.vocab, (a.batch, a.seq)).to("jax")

    forward = jaxtorch.jit(lambda ids, t: model(ids, t))

    @jaxtorch.jit
    def train(ids, t):
        loss = model(ids, t)
        loss.backward()
        grads = [p.grad for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return loss + 0 * sum(g.sum() for g in grads)

    print(f"checks on / off, jaxtorch.jit, {a.batch}x{a.seq} ids, vocab {a.vocab}, width {a.width}")
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, torch {torch.__version__}")
    for name, fn in (("forward + loss", forward), ("train step (forward + backward)", train)):
        off, on = measure(fn, (ids, targets), a.calls)
        print(f"{name}: off {off * 1e3:.2f} ms, on {on * 1e3:.2f} ms, ratio {on / off:.3f}x")


if __name__ == "__main__":
    main()
