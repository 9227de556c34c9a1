"""Benchmark: the cost of one op on the jax device, eagerly and while recording lazily (issue 21).

Three loops of `c = a + b` on float32 vectors of 64 elements, each timed as microseconds per op
(median of `--rounds` rounds of `--ops` ops, interleaved):

- eager CPU torch (the reference: the same Python call, torch's own kernel);
- eager on the jax device (`jaxtorch.enable_globally()`): dispatch, one cached `jax.jit` call,
  the result wrapped (JAX dispatches asynchronously: the loop does not wait for values);
- lazy recording (`jaxtorch.lazy()`): dispatch and recording only; the graph is executed
  after the timed loop, outside the timing.

With `--cpu`, each loop is timed by this thread's CPU time (`time.thread_time`) instead of the
wall clock: on a shared, busy machine that is the steadier figure (JAX's own threads, which run
the eager ops' programs, are not counted).

    python benchmarks/per_op.py
    python benchmarks/per_op.py --ops 5000 --rounds 9
    python benchmarks/per_op.py --cpu
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

import jaxtorch

_clock = [time.perf_counter]


def _loop(a, b, n: int) -> float:
    clock = _clock[0]
    t0 = clock()
    for _ in range(n):
        a + b
    return (clock() - t0) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--cpu", action="store_true", help="time by this thread's CPU time, not the wall clock")
    args = parser.parse_args()
    if args.cpu:
        _clock[0] = time.thread_time
    jaxtorch.enable_globally()
    a_cpu, b_cpu = torch.randn(64), torch.randn(64)
    a, b = a_cpu.to("jax"), b_cpu.to("jax")
    rows: dict[str, list[float]] = {"eager CPU torch": [], "eager jax device": [], "lazy recording": []}
    for i in range(args.rounds + 1):
        cpu = _loop(a_cpu, b_cpu, args.ops)
        eager = _loop(a, b, args.ops)
        (a + b).jax().block_until_ready()
        with jaxtorch.lazy():
            la, lb = a + 0, b + 0  # pending values: every add is recorded
            rec = _loop(la, lb, args.ops)
            jaxtorch.sync()
        if i:  # the first round warms the caches
            rows["eager CPU torch"].append(cpu)
            rows["eager jax device"].append(eager)
            rows["lazy recording"].append(rec)
    ref = statistics.median(rows["eager CPU torch"])
    print(
        f"a + b, float32[64], {args.ops} ops x {args.rounds} rounds "
        f"({'thread CPU time' if args.cpu else 'wall clock'}); "
        f"torch {torch.__version__}; "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    for name, ts in rows.items():
        med = statistics.median(ts)
        print(
            f"{name:>18}: median {med:6.2f} us/op (range {min(ts):.2f}-{max(ts):.2f}); / eager CPU torch "
            f"{med / ref:.2f}x"
        )


if __name__ == "__main__":
    main()
