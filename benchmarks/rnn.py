"""Benchmark: jitted forward+backward of a 2-layer LSTM through jaxtorch vs eager PyTorch, on the CPU.

`torch.nn.LSTM(256, 256, num_layers=2)` on a (256 steps, batch 32, 256 features) input.
PyTorch: `out.sum().backward()` eagerly (its CPU LSTM kernels, oneDNN where it applies).
jaxtorch: `jax.jit(jax.value_and_grad)` of the same loss through `extract` (one `lax.scan`
per layer forward, one per layer backward). Timings interleaved, medians; the figure is the
ratio jaxtorch / torch (below 1: jaxtorch is faster). Each `--repeat` prints its own ratio.

    python benchmarks/rnn.py
    python benchmarks/rnn.py --hidden 256 --seq 256 --batch 32 --steps 10 --repeat 3
    python benchmarks/rnn.py --torch-threads 1     # torch single-threaded (crowded machines)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import torch

sys.path.insert(0, str(Path(__file__).parent))
from run import interleaved

import jaxtorch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=0,
        help="torch.set_num_threads (0: torch's default); on a crowded machine OpenMP's "
        "spinning threads slow torch's eager LSTM far more than XLA",
    )
    args = parser.parse_args()
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)

    torch.manual_seed(0)
    model = torch.nn.LSTM(args.hidden, args.hidden, num_layers=args.layers)
    x = torch.randn(args.seq, args.batch, args.hidden)
    params, fn = jaxtorch.extract(model)
    jx = jaxtorch.to_jax(x)
    step = jax.jit(jax.value_and_grad(lambda p, x: fn(p, x)[0].sum()))

    def jt():
        loss, grads = step(params, jx)
        jax.block_until_ready(grads)

    def tt():
        model.zero_grad(set_to_none=True)
        model(x)[0].sum().backward()

    t0 = time.perf_counter()
    jt()
    print(f"jaxtorch first call (trace + compile): {time.perf_counter() - t0:.2f} s", flush=True)
    ratios = []
    for r in range(args.repeat):
        t_jt, t_torch = interleaved(jt, tt, args.steps, warmup=2)
        ratios.append(t_jt / t_torch)
        print(
            f"repeat {r}: jaxtorch {t_jt * 1e3:.1f} ms, torch {t_torch * 1e3:.1f} ms, ratio {t_jt / t_torch:.2f}x",
            flush=True,
        )
    print(
        f"LSTM {args.layers}x{args.hidden}, seq {args.seq}, batch {args.batch}, forward+backward, jitted jaxtorch / "
        f"eager torch: median {statistics.median(ratios):.2f}x (range {min(ratios):.2f}x-{max(ratios):.2f}x)"
    )


if __name__ == "__main__":
    main()
