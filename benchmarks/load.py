"""Benchmark: loading a Llama checkpoint into tensor-parallel JAX arrays on 8 CPU devices.

Rows (each in its own subprocess with 8 simulated devices,
`XLA_FLAGS=--xla_force_host_platform_device_count=8`):
- `jaxtorch.load_params(model_on_meta, file, mesh=..., rules=TP)`;
- plain safetensors + JAX, no jaxtorch: `safe_open(...).get_slice(name)` and
  `jax.make_array_from_callback` with the same shardings;
- (item 5) `from_pretrained` (memory-mapped) then `jaxtorch.extract`.

For each: wall time of the load (arrays ready), and peak resident memory (`VmHWM`, reset when the load starts) above
the process's own resident memory after importing the libraries and building the model on
the meta device, divided by the bytes the 8 devices hold (replicated arrays count 8 times)
and, for the issue's bound, compared with 1.1x held + the largest single slice. float32 and
bfloat16 checkpoints.

    python benchmarks/load.py                                    # ~70 M params, a couple of minutes
    python benchmarks/load.py --hidden 1024 --intermediate 2304 --layers 24 --vocab 32000   # the issue's 336 M
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

TP_RULES = [
    (r"(q_proj|k_proj|v_proj|gate_proj|up_proj)\.weight$", ("model", None)),
    (r"(o_proj|down_proj)\.weight$", (None, "model")),
    (r"(embed_tokens|lm_head)\.weight$", ("model", None)),
]


def _config(args):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 64,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )


def child(args) -> None:
    """One measurement: prints a JSON line."""
    import jax
    import numpy as np
    import torch
    import transformers
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P
    from safetensors import safe_open

    import jaxtorch
    from jaxtorch.train._sharding import spec_for

    rules = [(r, P(*s)) for r, s in TP_RULES]
    mesh = Mesh(np.array(jax.devices()), ("model",))
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(_config(args))
    gc.collect()
    base = _rss()
    _reset_peak()
    t0 = time.perf_counter()
    if args.child == "load_params":
        dtype = jax.numpy.bfloat16 if args.dtype == "bfloat16" else None  # the file's dtype, as the plain row
        params, state = jaxtorch.load_params(model, args.file, mesh=mesh, rules=rules, dtype=dtype)
        arrays = {**params, **state}
    elif args.child == "plain":
        arrays = {}
        with safe_open(args.file, framework="pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                shape = tuple(sl.get_shape())
                sharding = NamedSharding(mesh, spec_for(name, rules))

                def cb(index, sl=sl):
                    t = sl[index]
                    return (
                        t.view(torch.int16).numpy().view(jax.numpy.bfloat16) if t.dtype == torch.bfloat16 else t.numpy()
                    )

                arrays[name] = jax.make_array_from_callback(shape, sharding, cb)
    elif args.child == "from_pretrained":
        m = transformers.LlamaForCausalLM.from_pretrained(os.path.dirname(args.file), dtype="auto")
        params, fn = jaxtorch.extract(m)
        arrays = {**params, **fn.state}
    else:
        raise SystemExit(f"unknown row {args.child}")
    jax.block_until_ready(arrays)
    seconds = time.perf_counter() - t0
    if os.environ.get("LOAD_DEBUG"):
        print("after", (_rss() - base) / 2**20, file=sys.stderr)
    peak = _peak()
    held = sum(s.data.nbytes for a in arrays.values() for s in a.addressable_shards)
    buffers = {s.data.unsafe_buffer_pointer(): s.data.nbytes for a in arrays.values() for s in a.addressable_shards}
    largest = max(max(s.data.nbytes for s in a.addressable_shards) for a in arrays.values())
    print(
        json.dumps(
            {
                "seconds": seconds,
                "peak_above": peak - base,
                "held": held,
                "distinct": sum(buffers.values()),
                "largest": largest,
            }
        )
    )


def _run_child(row: str, file: str, dtype: str, args) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    cmd = [sys.executable, __file__, "--child", row, "--file", file]
    cmd += ["--hidden", str(args.hidden), "--intermediate", str(args.intermediate)]
    cmd += ["--layers", str(args.layers), "--vocab", str(args.vocab), "--dtype", dtype]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(p.stderr[-3000:])
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=16000)
    ap.add_argument("--child", default=None)
    ap.add_argument("--file", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rows", default="load_params,plain,from_pretrained")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    args = ap.parse_args()
    if args.child:
        return child(args)
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_config(args))
    n = sum(p.numel() for p in model.parameters())
    print(
        f"Llama {args.layers}x{args.hidden} (intermediate {args.intermediate}, vocab {args.vocab}): "
        f"{n / 1e6:.0f} M params"
    )
    print(
        "| checkpoint | row | load s | peak above base / held | peak / (1.1 held + largest slice) | distinct buffers |"
    )
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as d:
        for dtype in [getattr(torch, d) for d in args.dtypes.split(",")]:
            sub = os.path.join(d, str(dtype).split(".")[1])
            model.to(dtype).save_pretrained(sub)
            file = os.path.join(sub, "model.safetensors")
            for row in args.rows.split(","):
                r = _run_child(row, file, str(dtype).split(".")[1], args)
                bound = 1.1 * r["held"] + r["largest"]
                print(
                    f"| {str(dtype).split('.')[1]} | {row} | {r['seconds']:.2f} | "
                    f"{r['peak_above'] / r['held']:.2f}x "
                    f"({r['peak_above'] / 2**20:.0f} / {r['held'] / 2**20:.0f} MiB) | "
                    f"{r['peak_above'] / bound:.2f} | {r['distinct'] / 2**20:.0f} MiB |",
                    flush=True,
                )
        del model


if __name__ == "__main__":
    main()
