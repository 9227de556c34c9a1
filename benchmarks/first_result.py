"""Time to first result (issue 16): from a torch module to the first jitted forward result and to
the first jitted gradient, in a fresh process, split into extract / trace + lower / XLA compile /
first run, each as a ratio to one eager PyTorch forward of the same model measured in that process.

    python benchmarks/first_result.py                     # GPT-2 12x256 (8x128) and ResNet-18 (8x3x112x112)
    python benchmarks/first_result.py --repeat 5 --only gpt2
    python benchmarks/first_result.py --no-cache          # skip the persistent-cache rows
    python benchmarks/first_result.py --only gpt2:6,gpt2:24 --kinds gradient --no-cache   # depth scaling
    python benchmarks/first_result.py --flags=--xla_llvm_disable_expensive_passes=true   # an XLA option A/B

How: every measurement is its own Python process (`--child MODEL KIND`), so XLA, LLVM, YNNPACK and
jaxtorch's caches are cold. The child imports everything and builds the torch model first (not
timed), then times `jaxtorch.extract(model)`, `jax.jit(f).lower(...)` (trace + lower to StableHLO),
`.compile()` (XLA) and the first call of the compiled function up to `block_until_ready`, then
the second call and the median of 5 more (the steady state, shown in the A/B table); only
then does it time the eager torch forward (`torch.no_grad()`, one warm-up, median of 5), so torch
warms nothing the JAX side uses. The parent runs the children alternating (gpt2 forward, resnet
forward, gpt2 gradient, resnet gradient, then the cache pairs, repeated), so load drifting on a
shared machine hits every row alike, and reports medians and ranges of `--repeat` (3) rounds.
`--before DIR` alternates this checkout's children with DIR's jaxtorch (the same child code), and
`--flags` alternates children with and without extra XLA_FLAGS (jaxtorch never sets XLA options
itself); both print an after / before table.

Compilation cache rows: a child with JAX's persistent compilation cache enabled in a fresh
directory fills it, and a second child with the same directory runs the same model: its time to
first result over the cold (cache-less) time of the same round. Enabling the cache is the one line
the README documents:

    jax.config.update("jax_compilation_cache_dir", "/tmp/jax-cache")

plus (here, to cache small programs too) `jax_persistent_cache_min_compile_time_secs = 0` and
`jax_persistent_cache_min_entry_size_bytes = -1`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
STEPS = ("extract", "trace", "compile", "run")


def _enable_cache(path: str) -> None:
    import jax

    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def _model(name: str):
    """(torch model, torch input, output -> array, loss(output, labels) in JAX, labels).

    `name`: "gpt2" (12 layers), "gpt2:N" (N layers), "resnet18" or "resnet18:flax" (extracted
    with `conv_layout="flax"`: convolution weights in XLA's layout)."""
    import jax.numpy as jnp
    import optax
    import torch

    sys.path.insert(0, str(HERE))
    from models import cnn, gpt2

    if name.partition(":")[0] == "gpt2":
        model = gpt2(int(name.partition(":")[2] or 12))
        x = torch.randint(0, 8192, (8, 128), generator=torch.Generator().manual_seed(0))
        labels = x
        out = lambda o: o.logits
    else:
        model = cnn("resnet18")
        x = torch.randn(8, 3, 112, 112, generator=torch.Generator().manual_seed(0))
        labels = torch.arange(8)
        out = lambda o: o

    def loss(logits, labels):  # mean cross entropy of every position against its label
        logits = logits.reshape(-1, logits.shape[-1]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels.reshape(-1)).mean()

    return model, x, out, loss, labels


def child(name: str, kind: str, cache: str | None) -> dict:
    """One cold measurement; returns seconds per step, the total and the eager torch forward."""
    import jax
    import torch

    import jaxtorch

    if cache:
        _enable_cache(cache)
    model, x, out, loss, labels = _model(name)
    jx, jlabels = jaxtorch.to_jax(x), jaxtorch.to_jax(labels)
    t = {}
    c0 = time.process_time()
    t0 = time.perf_counter()
    params, fn = jaxtorch.extract(model, conv_layout="flax" if name.endswith(":flax") else "torch")
    t["extract"] = time.perf_counter() - t0
    if kind == "forward":
        f = jax.jit(lambda p, i: out(fn(p, i)))
        args = (params, jx)
    else:
        # gradient with respect to the floating-point entries (BatchNorm's step counter is an integer)
        floats = {k: v for k, v in params.items() if jax.numpy.issubdtype(v.dtype, jax.numpy.floating)}
        rest = {k: v for k, v in params.items() if k not in floats}
        f = jax.jit(jax.grad(lambda p, r, i, y: loss(out(fn({**p, **r}, i)), y)))
        args = (floats, rest, jx, jlabels)
    t0 = time.perf_counter()
    lowered = f.lower(*args)
    t["trace"] = time.perf_counter() - t0
    t0, c1 = time.perf_counter(), time.process_time()
    compiled = lowered.compile()
    t["compile"] = time.perf_counter() - t0
    t["compile_cpu"] = time.process_time() - c1
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    t["run"] = time.perf_counter() - t0
    t["total"] = sum(t[s] for s in STEPS)
    t["total_cpu"] = time.process_time() - c0
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    t["second_run"] = time.perf_counter() - t0
    steady = []
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        steady.append(time.perf_counter() - t0)
    t["steady"] = statistics.median(steady)
    eager = []
    with torch.no_grad():
        for _ in range(6):
            t0 = time.perf_counter()
            model(x)
            eager.append(time.perf_counter() - t0)
    t["eager"] = statistics.median(eager[1:])
    return t


def _spawn(name: str, kind: str, cache: str | None = None, root: Path = HERE.parent, flags: str | None = None) -> dict:
    """Run one child; `root` is the checkout whose jaxtorch it imports (this one by default), `flags`
    the child's XLA_FLAGS (None: this process's environment)."""
    cmd = [sys.executable, __file__, "--child", name, kind] + (["--cache", cache] if cache else [])
    env = dict(os.environ, PYTHONPATH=str(root))
    if flags is not None:
        env["XLA_FLAGS"] = flags
    res = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if res.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def _fmt(xs: list[float], scale: float = 1.0, unit: str = "") -> str:
    xs = [x * scale for x in xs]
    med = statistics.median(xs)
    return f"{med:.2f}{unit} ({min(xs):.2f}-{max(xs):.2f})" if len(xs) > 1 else f"{med:.2f}{unit}"


def _show(label: str, r: dict) -> str:
    return label + ": " + " ".join(f"{k} {v * 1e3:.0f} ms" for k, v in r.items())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", nargs=2, metavar=("MODEL", "KIND"), help=argparse.SUPPRESS)
    ap.add_argument("--cache", help=argparse.SUPPRESS)
    ap.add_argument("--repeat", type=int, default=3, help="rounds of alternating processes (median, range)")
    ap.add_argument(
        "--only",
        default="gpt2,resnet18",
        help="comma-separated subset of: gpt2, gpt2:N (N layers instead of 12), resnet18",
    )
    ap.add_argument("--kinds", default="forward,gradient", help="comma-separated subset of: forward, gradient")
    ap.add_argument("--no-cache", action="store_true", help="skip the persistent compilation cache rows")
    ap.add_argument(
        "--before",
        type=Path,
        help="another checkout (e.g. `git worktree add /tmp/before HEAD~1`): "
        "its children alternate with this checkout's, and a before/after table is printed",
    )
    ap.add_argument(
        "--flags",
        help="XLA_FLAGS for the 'after' children (e.g. '--xla_backend_optimization_level=1'); "
        "without --before, 'before' is this checkout with the inherited XLA_FLAGS",
    )
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(*args.child, args.cache)))
        return
    if args.before or args.flags is not None:  # label -> (checkout, XLA_FLAGS)
        roots = {"after": (HERE.parent, args.flags), "before": (args.before or HERE.parent, None)}
    else:
        roots = {"": (HERE.parent, None)}
    models = [m for m in args.only.split(",") if m]
    jobs = [(m, k) for k in args.kinds.split(",") for m in models]
    runs: dict = {(label, *job): [] for job in jobs for label in roots}
    cached: dict = {m: [] for m in models}
    for r in range(args.repeat):
        for job in jobs:
            for label, (root, flags) in sorted(roots.items(), key=lambda kv: (kv[0] == "after") == (r % 2 == 0)):
                runs[(label, *job)].append(_spawn(*job, root=root, flags=flags))
                print(_show(f"round {r + 1} {label} {job[0]} {job[1]}", runs[(label, *job)][-1]), flush=True)
        if args.no_cache or "forward" not in args.kinds:
            continue
        for m in models:
            with tempfile.TemporaryDirectory() as d:
                root, flags = roots.get("after", roots.get(""))
                _spawn(m, "forward", d, root, flags)  # fills the cache
                cached[m].append(_spawn(m, "forward", d, root, flags))
            print(_show(f"round {r + 1} {m} forward, warm cache", cached[m][-1]), flush=True)

    print(
        f"\n| time to first result (fresh process, median (range) of {args.repeat}) | / eager forward | target | "
        "extract / trace / compile / first run, s | compile, CPU s | eager torch forward |\n"
        "|---|---|---|---|---|---|"
    )
    for (label, m, k), rs in runs.items():
        ratio = _fmt([r["total"] / r["eager"] for r in rs], unit="x")
        split = " / ".join(_fmt([r[s] for r in rs]) for s in STEPS)
        target = "<= 5x" if k == "forward" else "half of before"
        print(
            f"| {m} first jitted {k} {label} | {ratio} | {target} | {split} | {_fmt([r['compile_cpu'] for r in rs])} "
            f"| {_fmt([r['eager'] for r in rs], 1e3)} ms |"
        )
    for m in cached:
        if not cached[m]:
            continue
        cold = runs[(next(iter(roots)), m, "forward")]
        ratio = _fmt([c["total"] / r["total"] for c, r in zip(cached[m], cold)], unit="x")
        split = " / ".join(_fmt([c[s] for c in cached[m]]) for s in STEPS)
        print(
            f"| {m} first jitted forward, second process, persistent cache / cold | {ratio} | < 0.3x | {split} | "
            f"{_fmt([c['compile_cpu'] for c in cached[m]])} | cold total {_fmt([r['total'] for r in cold])} s |"
        )
    if "before" in roots:
        print(
            "\n| after / before, same rounds (median (range)) | total | trace | compile | compile, CPU | first run "
            "| steady run |\n|---|---|---|---|---|---|---|"
        )
        for m, k in jobs:
            a, b = runs[("after", m, k)], runs[("before", m, k)]
            cells = [
                _fmt([x[s] / y[s] for x, y in zip(a, b)], unit="x")
                for s in ("total", "trace", "compile", "compile_cpu", "run", "steady")
            ]
            print(f"| {m} first jitted {k} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
