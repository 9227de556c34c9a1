"""Benchmark: peak host memory of `from_pretrained(path, device_map="jax")` (issue 31, item 5).

A Llama (~80 M parameters by default, random weights) is saved with `save_pretrained` into a
temporary directory (never inside the repository), as one file and as shards. Each variant then
loads it in its own subprocess (JAX on the CPU, so the jax device's arrays are host memory too):

- `cpu`: `from_pretrained(path)`, the plain CPU load (the reference: 1x is the weights themselves);
- `device_map="jax"`, `device_map={"": "jax"}`, each without and with `jaxtorch.enable_globally()`;
- `device_map="jax"` from the sharded checkpoint;
- `device_map="jax", dtype=torch.bfloat16` from the float32 file (the weights are half the size);
- `cpu, then .to("jax")`: the path `device_map` avoids (the weights built on the CPU first).

For each: the peak resident memory during the load (`VmHWM`, reset when the load starts; read
from `/proc`, no psutil) above the process's resident memory before it (libraries imported, the
JAX runtime started, the model's code imported by building it on the meta device), divided by
the bytes of the loaded weights; and the same for the resident memory once loaded.
A ratio near 1x means the weights were never held twice.

    python benchmarks/device_map.py                       # ~80 M params, about a minute
    python benchmarks/device_map.py --layers 2 --vocab 4000   # a quick run
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time

from _memory import _peak, _reset_peak, _rss  # (benchmarks/ is the script's folder)

VARIANTS = {  # name -> (checkpoint, from_pretrained keyword arguments as JSON, enable_globally, then .to("jax"))
    "cpu": ("single", {}, False, False),
    'device_map="jax"': ("single", {"device_map": "jax"}, False, False),
    'device_map="jax", enable_globally': ("single", {"device_map": "jax"}, True, False),
    'device_map={"": "jax"}': ("single", {"device_map": {"": "jax"}}, False, False),
    'device_map={"": "jax"}, enable_globally': ("single", {"device_map": {"": "jax"}}, True, False),
    'device_map="jax", sharded': ("sharded", {"device_map": "jax"}, False, False),
    'device_map="jax", sharded, enable_globally': ("sharded", {"device_map": "jax"}, True, False),
    'device_map="jax", dtype=bfloat16': ("single", {"device_map": "jax", "dtype": "bfloat16"}, False, False),
    'device_map="jax", dtype=bfloat16, enable_globally': (
        "single",
        {"device_map": "jax", "dtype": "bfloat16"},
        True,
        False,
    ),
    'cpu, then .to("jax")': ("single", {}, False, True),
}


def child(path: str, variant: str) -> dict:
    """Load the checkpoint at `path` as `variant` says; the measurements as a dict."""
    import jax
    import torch
    import transformers

    import jaxtorch

    checkpoint, kwargs, globally, then_move = VARIANTS[variant]
    kwargs = dict(kwargs)
    if "dtype" in kwargs:
        kwargs["dtype"] = getattr(torch, kwargs["dtype"])
    if globally:
        jaxtorch.enable_globally()
    transformers.logging.disable_progress_bar()
    # not the load's own cost, so before the baseline: the JAX runtime (its first array) and the
    # model's code (transformers imports it lazily), from a model built on the meta device
    (torch.ones(2, device="jax") + 1).cpu()
    with torch.device("meta"):
        transformers.LlamaForCausalLM(transformers.LlamaConfig.from_pretrained(os.path.join(path, checkpoint)))
    gc.collect()
    base = _rss()
    _reset_peak()
    t0 = time.perf_counter()
    model = transformers.LlamaForCausalLM.from_pretrained(os.path.join(path, checkpoint), **kwargs)
    if then_move:
        model.to("jax")
    tensors = [*model.parameters(), *model.buffers()]
    jax.block_until_ready([t.jax() for t in tensors if t.device.type == "jax"])
    seconds = time.perf_counter() - t0
    peak, after = _peak(), _rss()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return {
        "seconds": seconds,
        "peak_above": peak - base,
        "after_above": after - base,
        "weights": weights,
        "devices": sorted({str(t.device) for t in tensors}),
    }


def _run_child(path: str, variant: str) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, __file__, "--child", variant, "--path", path]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"{variant}: {p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=16000)
    ap.add_argument("--variants", default=";".join(VARIANTS), help="names from VARIANTS, separated by ';'")
    ap.add_argument("--child", default=None)
    ap.add_argument("--path", default=None)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.path, args.child)))
        return
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 64,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(config)
    n = sum(p.numel() for p in model.parameters())
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(os.path.join(d, "single"))
        shard = f"{n * 4 // 4 // 10**6 + 1}MB"  # about four shards
        model.save_pretrained(os.path.join(d, "sharded"), max_shard_size=shard)
        del model
        gc.collect()
        print(
            f"Llama {args.layers}x{args.hidden} (intermediate {args.intermediate}, vocab {args.vocab}): "
            f"{n / 1e6:.0f} M params, float32 checkpoint ({n * 4 / 2**20:.0f} MiB; sharded: "
            f"{len([f for f in os.listdir(os.path.join(d, 'sharded')) if f.endswith('.safetensors')])} files)"
        )
        print("| variant | load s | peak above base / weights | resident after / weights | devices |")
        print("|---|---|---|---|---|")
        for variant in args.variants.split(";"):
            r = _run_child(d, variant)
            w = r["weights"]
            print(
                f"| {variant} | {r['seconds']:.2f} | {r['peak_above'] / w:.2f}x "
                f"({r['peak_above'] / 2**20:.0f} / {w / 2**20:.0f} MiB) | {r['after_above'] / w:.2f}x | "
                f"{', '.join(r['devices'])} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
