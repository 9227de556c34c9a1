"""Peak host memory of `make_train_step` + AdamW (float32) on a Llama, as a ratio to the weight bytes.

Each configuration runs in its own subprocess: the baseline is the resident memory after the
libraries are imported, the peak is the process's maximum resident set size (`ru_maxrss`) after
building the model (random weights, `transformers.LlamaConfig`), `init()` and a few steps. The
figure is `(peak - baseline) / weight bytes`; the torch module (1x) stays alive throughout, as
in a user's script that later calls `load_into(model, state)`.

What the steps need: the TrainState's params (1x), AdamW's two moments (2x) and the transient
gradients (1x); donation (the default) lets XLA write the new params and moments over the old.

Usage:
    python benchmarks/train_memory.py                    # small Llama, < 2 min on 2 CPU cores
    python benchmarks/train_memory.py --preset 336m      # the issue's 336 M-parameter Llama
    python benchmarks/train_memory.py --jaxtorch /work/main   # another checkout (before/after)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

PRESETS = {
    # hidden, intermediate, layers, heads, kv heads, vocab
    "small": (512, 1408, 4, 8, 4, 8000),
    "medium": (768, 2048, 8, 12, 4, 32000),
    "336m": (1024, 2816, 21, 16, 8, 32000),
}
CONFIGS = {"default": {}, "donate=True": {"donate": True}, "donate=False": {"donate": False}}


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def child(preset: str, config: str, steps: int) -> dict:
    """Run one configuration in this process; the measurements as a dict."""
    import resource

    import jax
    import jax.numpy as jnp
    import optax
    import torch
    import transformers

    import jaxtorch  # noqa: F401
    from jaxtorch.train import make_train_step

    base = _rss()
    hidden, inter, layers, heads, kv, vocab = PRESETS[preset]
    cfg = transformers.LlamaConfig(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        vocab_size=vocab,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        use_cache=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).train()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    def lm_loss(out, ids):
        return optax.softmax_cross_entropy_with_integer_labels(out.logits[:, :-1], ids[:, 1:]).mean()

    init, step = make_train_step(model, lm_loss, optax.adamw(1e-4), **CONFIGS[config])
    state = init()
    ids = jnp.asarray(torch.randint(0, vocab, (1, 64)).numpy())
    losses = []
    for _ in range(steps):
        state, loss = step(state, ids, ids)
        losses.append(float(loss))
    jax.block_until_ready(state)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    stats = jax.devices()[0].memory_stats() or {}  # on a GPU: the device's own peak (the host figure is then ~0)
    device_peak = stats.get("peak_bytes_in_use")
    return {
        "backend": jax.default_backend(),
        "device_peak_ratio": device_peak / weight_bytes if device_peak else None,
        "config": config,
        "params": sum(p.numel() for p in model.parameters()),
        "weight_MiB": weight_bytes / 2**20,
        "peak_above_baseline_MiB": (peak - base) / 2**20,
        "ratio": (peak - base) / weight_bytes,
        "losses": losses,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small", choices=sorted(PRESETS))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated: " + ", ".join(CONFIGS))
    ap.add_argument("--jaxtorch", default=None, help="import jaxtorch from this checkout (default: this one)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.preset, args.child, args.steps)))
        return 0
    root = args.jaxtorch or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    print(f"Llama preset {args.preset}, AdamW float32, {args.steps} steps, jaxtorch from {root}")
    print(f"{'config':14s} {'params':>12s} {'weights MiB':>12s} {'peak-base MiB':>14s} {'peak/weights':>13s}")
    for config in args.configs.split(","):
        cmd = [sys.executable, os.path.abspath(__file__), "--preset", args.preset, "--steps", str(args.steps)]
        out = subprocess.run([*cmd, "--child", config], env=env, capture_output=True, text=True)
        if out.returncode:
            print(f"{config:14s} failed: {out.stderr.strip().splitlines()[-1:]}")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(
            f"{config:14s} {r['params']:12,d} {r['weight_MiB']:12.1f} {r['peak_above_baseline_MiB']:14.1f} "
            f"{r['ratio']:12.2f}x"
            + (
                f"  ({r['backend']} device peak / weights: {r['device_peak_ratio']:.2f}x)"
                if r["device_peak_ratio"]
                else ""
            ),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
