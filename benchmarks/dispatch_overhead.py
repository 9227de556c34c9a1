"""Benchmark: the interpreter's per-op cost for eager ops on the jax device, by kind of op.

Each row times a loop of one op on small tensors (64 elements) and reports microseconds per op
(median of `--rounds` rounds of `--ops` ops, interleaved) and the ratio to a plain `jnp` op on
the same arrays, timed in the same run (`jnp.add(a, b)`: JAX's own dispatch, the floor jaxtorch
adds its work to). Rows:

- `jnp.add float32`: the reference;
- `add float32`, `add int32`, `add int64`: `a + b` on `JaxTensor`s (int32 results need their
  torch dtype worked out: see `jaxtorch.bridge.dispatch._result_dtype`);
- `add_ float32`: `a.add_(b)` (an in-place op: computed, then written back);
- `view float32`: `a.view(8, 8)` (a view op: the result keeps its root);
- `add int32 + int64`: mixed int32/int64 promotion (a cached meta lookup).

Each row is measured three times: with plain `import jaxtorch` (`JaxTensor.__torch_dispatch__`),
under `jaxtorch.default_env()` (the modes `enable_globally` pushes, and the function mode), and
under `default_env(jax_by_default=True)`, the scope `call_torch`/`extract` run torch code in
(factories on the jax device, and the write rule of `_writes` checked for every op). JAX dispatches
asynchronously: the loops do not wait for values. With `--cpu`, loops are timed by this thread's
CPU time (`time.thread_time`), steadier on a shared machine; with `--profile NAME`, one row runs
under cProfile instead and the top functions are printed.

    python benchmarks/dispatch_overhead.py
    python benchmarks/dispatch_overhead.py --cpu --ops 3000 --rounds 9
    python benchmarks/dispatch_overhead.py --profile "add int32"
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import os
import pstats
import statistics
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax.numpy as jnp
import torch

import jaxtorch

_clock = [time.perf_counter]


def _loop(step: Callable[[], object], n: int) -> float:
    """Microseconds per call of `step` over `n` calls."""
    clock = _clock[0]
    t0 = clock()
    for _ in range(n):
        step()
    return (clock() - t0) / n * 1e6


def _cases() -> dict[str, Callable[[], object]]:
    """name -> a zero-argument op on fresh small tensors (the same tensors every call)."""
    f32 = torch.randn(64).to("jax"), torch.randn(64).to("jax")
    i32 = torch.arange(64, dtype=torch.int32).to("jax"), torch.arange(64, dtype=torch.int32).to("jax")
    i64 = torch.arange(64).to("jax"), torch.arange(64).to("jax")
    acc = torch.zeros(64).to("jax")
    ja, jb = f32[0].jax(), f32[1].jax()
    return {
        "jnp.add float32": lambda: jnp.add(ja, jb),
        "add float32": lambda: f32[0] + f32[1],
        "add int32": lambda: i32[0] + i32[1],
        "add int64": lambda: i64[0] + i64[1],
        "add int32 + int64": lambda: i32[0] + i64[1],
        "add_ float32": lambda: acc.add_(f32[1]),
        "view float32": lambda: f32[0].view(8, 8),
    }


def _measure(ops: int, rounds: int) -> dict[str, float]:
    cases = _cases()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for i in range(rounds + 1):
        for name, step in cases.items():
            t = _loop(step, ops)
            if i:  # the first round warms the caches
                times[name].append(t)
    return {name: statistics.median(ts) for name, ts in times.items()}


_SCOPES: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
    "plain": contextlib.nullcontext,
    "default_env": jaxtorch.default_env,
    "jax_by_default": lambda: jaxtorch.default_env(jax_by_default=True),
}


def _profile(name: str, ops: int) -> None:
    step = _cases()[name]
    _loop(step, 200)  # warm
    prof = cProfile.Profile()
    prof.enable()
    _loop(step, ops)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--cpu", action="store_true", help="time by this thread's CPU time, not the wall clock")
    parser.add_argument("--profile", metavar="NAME", help="profile one row (see the names printed) and exit")
    parser.add_argument("--scope", choices=sorted(_SCOPES), default="plain", help="with --profile: where")
    args = parser.parse_args()
    if args.cpu:
        _clock[0] = time.thread_time
    if args.profile:
        with _SCOPES[args.scope]():
            _profile(args.profile, args.ops)
        return
    res = {}
    for scope, enter in _SCOPES.items():
        with enter():
            res[scope] = _measure(args.ops, args.rounds)
    print(
        f"per-op eager dispatch, 64-element tensors, {args.ops} ops x {args.rounds} rounds "
        f"({'thread CPU time' if args.cpu else 'wall clock'}); torch {torch.__version__}; "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    print(f"{'op':>20} | " + " | ".join(f"{scope + ' us':>15} {'x jnp':>6}" for scope in res))
    for name in res["plain"]:
        cells = [f"{r[name]:15.2f} {r[name] / r['jnp.add float32']:6.2f}" for r in res.values()]
        print(f"{name:>20} | " + " | ".join(cells))


if __name__ == "__main__":
    main()
