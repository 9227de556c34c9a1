"""Benchmark: a torch_xla-style training loop in jaxtorch's lazy mode (issue 15).

The loop is the unmodified PyTorch one plus `mark_step()`: `zero_grad`, Hugging Face
GPT-2's own loss (4 layers, width 256, 4 heads, vocab 8192, random weights, dropout off),
`loss.backward()`, `torch.optim.AdamW.step()`, `mark_step()`, on a batch of 8 x 128 tokens.
The same step runs four ways, interleaved step by step after warm-up (a busy machine
slows all alike), medians reported as ratios to the lazy step:

- lazy: `jaxtorch.lazy()`; the step is recorded and runs as one cached XLA program;
- `jaxtorch.jit`: the same step function compiled whole (modules/optimizer as state);
- eager mode: `jaxtorch.enable_globally()` without lazy (each op dispatched to JAX);
- eager PyTorch on the CPU.

Also printed: compilations after the third lazy step (target 0), the recording cost
(Python time from the start of the step to `mark_step`) as a share of the lazy step, and
the floor under it: the same step in eager PyTorch on the CPU with tiny arrays (width 64,
vocab 128, a 1x4 batch: the cost of running the step's Python once: HF's modules, autograd's
engine, the optimizer's loops).

Every row waits for its loss at the same points: after every step by default (the lazy
step then pays its recording on top of the program), or, with `--sync-every N`, after
every N steps, as a loop that logs the loss every N steps does (JAX dispatches each
program asynchronously, so the lazy loop records step k+1 while step k runs, and
`jaxtorch.jit`'s Python overhead overlaps too); a sample is then N steps, reported per step.

    python benchmarks/lazy.py                 # 4 layers, 8x128, 5 timed steps
    python benchmarks/lazy.py --steps 10 --layers 2
    python benchmarks/lazy.py --sync-every 5  # 5 samples of 5 steps each
    python benchmarks/lazy.py --layers 2 --width 128 --batch 4 --seq 32 --skip eager,torch  # tiny (issue 21)
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

import jaxtorch
import jaxtorch.xla as xm
from benchmarks.models import gpt2


def make(layers: int, seq: int, device: str, width: int = 256):
    """A GPT-2 (same initial weights every call) and its AdamW, on `device`."""
    model = gpt2(layers, width=width, seq=seq).train().to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def step(model, opt, ids):
    """One torch training step; returns the loss tensor."""
    opt.zero_grad()
    loss = model(ids, labels=ids).loss
    loss.backward()
    opt.step()
    return loss


def framework_floor(layers: int, seq: int, steps: int = 7) -> float:
    """Median seconds of the same step in eager PyTorch on the CPU with next to no compute
    (width 64, vocab 128, a 1x4 batch: the same ops, tiny arrays) and the jax device's
    foreach AdamW: what running the step's Python once costs (HF's modules, autograd's
    engine, the optimizer's loops). Recording runs the same code once per step."""
    model = gpt2(layers, width=64, vocab=128, seq=seq).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    ids = torch.randint(0, 128, (1, 4), generator=torch.Generator().manual_seed(0))
    times = []
    for _ in range(3 + steps):
        t0 = time.perf_counter()
        step(model, opt, ids)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[3:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--skip", default="", help="comma-separated: eager,torch,jit")
    parser.add_argument(
        "--sync-every", type=int, default=1, help="steps per timed sample; every row waits for its loss once per sample"
    )
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    g = torch.Generator().manual_seed(0)
    ids_cpu = torch.randint(0, 8192, (args.batch, args.seq), generator=g)
    jaxtorch.enable_globally()
    ids = ids_cpu.to("jax")

    runs, record = {}, []

    lz_model, lz_opt = make(args.layers, args.seq, "jax", args.width)

    parts: dict[str, list[float]] = {}  # row -> [launch, wait] seconds of each waited step

    def lazy_step(wait: bool):
        with jaxtorch.lazy():
            t0 = time.perf_counter()
            loss = step(lz_model, lz_opt, ids)
            t1 = time.perf_counter()
            record.append(t1 - t0)
            xm.mark_step()
        if wait:
            t2 = time.perf_counter()
            loss.jax().block_until_ready()
            parts.setdefault("lazy", []).append((t2 - t1, time.perf_counter() - t2))

    def waiting(name, run_step):
        """A row's step: `run_step()` returns the loss; `wait` blocks on it."""

        def run(wait: bool):
            t0 = time.perf_counter()
            loss = run_step()
            if wait:
                t1 = time.perf_counter()
                loss.item() if loss.device.type == "cpu" else loss.jax().block_until_ready()
                parts.setdefault(name, []).append((t1 - t0, time.perf_counter() - t1))

        return run

    runs["lazy"] = lazy_step
    if "jit" not in skip:
        jt_model, jt_opt = make(args.layers, args.seq, "jax", args.width)
        compiled = jaxtorch.jit(step)
        runs["jaxtorch.jit"] = waiting("jaxtorch.jit", lambda: compiled(jt_model, jt_opt, ids))
    if "eager" not in skip:
        eg_model, eg_opt = make(args.layers, args.seq, "jax", args.width)
        runs["eager mode"] = waiting("eager mode", lambda: step(eg_model, eg_opt, ids))
    if "torch" not in skip:
        tc_model, tc_opt = make(args.layers, args.seq, "cpu", args.width)
        runs["eager PyTorch CPU"] = waiting("eager PyTorch CPU", lambda: step(tc_model, tc_opt, ids_cpu))

    xm.clear_metrics()
    first = {}
    compiles_by_step = []
    for _ in range(args.warmup):
        for name, run in runs.items():
            t0 = time.perf_counter()
            run(True)
            first.setdefault(name, []).append(time.perf_counter() - t0)
            if name == "lazy":
                compiles_by_step.append(xm.metrics().compiles)
    record.clear()
    parts.clear()
    times: dict[str, list[float]] = {name: [] for name in runs}
    n = args.sync_every
    for _ in range(args.steps):
        for name, run in runs.items():
            t0 = time.perf_counter()
            for j in range(n):
                run(j == n - 1)
                if name == "lazy":
                    compiles_by_step.append(xm.metrics().compiles)
            times[name].append((time.perf_counter() - t0) / n)
    m = xm.metrics()
    med = {name: statistics.median(ts) for name, ts in times.items()}
    print(
        f"GPT-2 {args.layers}x{args.width}, batch {args.batch}x{args.seq}, AdamW, backward + step + mark_step; "
        f"torch {torch.__version__}, jax {jax.__version__}, {jax.devices()[0].platform}, "
        f"{args.steps} timed samples of {n} step(s) (loss waited for once per sample) after {args.warmup} "
        f"warm-up steps, interleaved; load average {os.getloadavg()[0]:.1f}"
    )
    for name, ts in times.items():
        print(
            f"{name:>18}: median {med[name] * 1e3:8.1f} ms/step (range {min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f}); "
            f"warm-up steps {', '.join(f'{t:.1f}' for t in first[name])} s; lazy / this {med['lazy'] / med[name]:.2f}x"
        )
    after3 = compiles_by_step[-1] - compiles_by_step[2]
    rec = statistics.median(record)
    print(
        f"lazy: compilations per step {compiles_by_step} -> {after3} after the third step; "
        f"{m.cache_hits} cache hits; unplanned executions {sum(m.unplanned.values())}"
    )
    floor = framework_floor(args.layers, args.seq)
    print(
        f"lazy: recording {rec * 1e3:.1f} ms/step = {rec / med['lazy'] * 100:.0f}% of the step "
        f"({m.ops_recorded[-1]} ops recorded per step); the same step's Python in eager PyTorch "
        f"(CPU, tiny arrays, foreach AdamW) {floor * 1e3:.1f} ms: recording / that {rec / floor:.2f}x"
    )
    for name in ("lazy", "jaxtorch.jit"):
        if name in parts:
            launch = statistics.median(p[0] for p in parts[name]) * 1e3
            wait = statistics.median(p[1] for p in parts[name]) * 1e3
            what = "recording excluded: mark_step" if name == "lazy" else "the call"
            print(
                f"{name}: waited steps: launch ({what}) {launch:.1f} ms + waiting for the loss {wait:.1f} ms (medians)"
            )
    print(xm.metrics_report())


if __name__ == "__main__":
    main()
