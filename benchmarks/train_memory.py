"""Peak host memory of `make_train_step` + AdamW (float32) on a Llama, as a ratio to the weight bytes.

Each configuration runs in its own subprocess: the baseline is the resident memory after the
libraries (jaxtorch, optax, transformers' Llama code) are imported, the peak is the process's
maximum resident set size (`ru_maxrss`) after building the model (random weights,
`transformers.LlamaConfig`), `init()` and a few steps. The figure is
`(peak - baseline) / weight bytes`. Two references run in the same way, in the same run:
`torch forward` (build the model, one forward) and the weight bytes themselves (1.00x).

The torch module is either kept alive in the caller (`alive`: a user's script that later
calls `load_into(model, state)`; its weights, 1x, are the user's and count in the peak) or
dropped after `init()` (`deleted`: `del model; gc.collect()`; the step holds the module only
weakly once traced, so its weights are freed).

What the steps need: the TrainState's params (1x), AdamW's two moments (2x) and the transient
gradients with XLA's temporaries (`XLA temp`, from `compiled.memory_analysis()`); donation (the
default) lets XLA write the new params and moments over the old. So the floor is about
`3x + XLA temp`, plus 1x while the caller keeps the module.

Usage:
    python benchmarks/train_memory.py                    # small Llama, < 2 min on 2 CPU cores
    python benchmarks/train_memory.py --preset 336m      # the issue's 336 M-parameter Llama (1,282 MiB)
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
    "small": (512, 1408, 4, 8, 4, 8000),  # 20 M parameters
    "medium": (768, 2048, 8, 12, 4, 32000),  # 99.5 M
    "336m": (1024, 2816, 24, 16, 4, 32000),  # 336.1 M, 1,282 MiB in float32 (issue 24's model)
}
CONFIGS = {
    "torch forward": None,
    "default": {},
    "default (deleted)": {},
    "donate=False": {"donate": False},
    "donate=False (deleted)": {"donate": False},
}


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def child(preset: str, config: str, steps: int) -> dict:
    """Run one configuration in this process; the measurements as a dict."""
    import gc
    import resource

    import jax
    import jax.numpy as jnp
    import optax
    import torch
    import transformers
    from transformers.models.llama import modeling_llama  # noqa: F401  (transformers imports lazily)

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
    params = sum(p.numel() for p in model.parameters())
    ids_t = torch.randint(0, vocab, (1, 64))
    result = {"backend": jax.default_backend(), "config": config, "params": params, "weight_MiB": weight_bytes / 2**20}
    if CONFIGS[config] is None:  # the reference: torch alone
        with torch.no_grad():
            model(ids_t)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return {**result, "peak_above_baseline_MiB": (peak - base) / 2**20, "ratio": (peak - base) / weight_bytes}

    def lm_loss(out, ids):
        return optax.softmax_cross_entropy_with_integer_labels(out.logits[:, :-1], ids[:, 1:]).mean()

    init, step = make_train_step(model, lm_loss, optax.adamw(1e-4), **CONFIGS[config])
    state = init()
    if config.endswith("(deleted)"):  # the caller drops the module: its weights are freed
        del model
        gc.collect()
    ids = jnp.asarray(ids_t.numpy())
    losses = []
    for _ in range(steps):
        state, loss = step(state, ids, ids)
        losses.append(float(loss))
    jax.block_until_ready(state)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    stats = jax.devices()[0].memory_stats() or {}  # on a GPU: the device's own peak (the host figure is then ~0)
    device_peak = stats.get("peak_bytes_in_use")
    # after the peak is read: the step's own temporaries as XLA planned them (the compilation is
    # cached; lowering traces again, which needs the module: the same program as the alive row)
    deleted = config.endswith("(deleted)")
    analysis = None if deleted else step.lower(state, ids, ids).compile().memory_analysis()
    return {
        **result,
        "device_peak_ratio": device_peak / weight_bytes if device_peak else None,
        "xla_temp_ratio": analysis.temp_size_in_bytes / weight_bytes if analysis is not None else None,
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
    print(f"{'config':22s} {'params':>12s} {'weights MiB':>12s} {'peak-base MiB':>14s} {'peak/weights':>13s}  XLA temp")
    for config in args.configs.split(","):
        cmd = [sys.executable, os.path.abspath(__file__), "--preset", args.preset, "--steps", str(args.steps)]
        out = subprocess.run([*cmd, "--child", config], env=env, capture_output=True, text=True)
        if out.returncode:
            print(f"{config:22s} failed: {out.stderr.strip().splitlines()[-1:]}")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        temp = r.get("xla_temp_ratio")
        device = r.get("device_peak_ratio")
        print(
            f"{config:22s} {r['params']:12,d} {r['weight_MiB']:12.1f} {r['peak_above_baseline_MiB']:14.1f} "
            f"{r['ratio']:12.2f}x  "
            + (f"{temp:.2f}x" if temp is not None else "-")
            + (f"  ({r['backend']} device peak / weights: {device:.2f}x)" if device else ""),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
