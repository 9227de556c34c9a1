"""Benchmark: greedy decoding tokens/s, jaxtorch's compiled static-cache decoding vs torch's eager `generate`.

One small Llama (random weights, Hugging Face `LlamaForCausalLM`), one prompt, greedy
decoding of `--new` tokens (prefill included on both sides), batch `--batch`:

- torch: `model.generate(ids, do_sample=False)` eagerly, with the default dynamic cache
  and with `cache_implementation="static"`, at 1 thread and at all threads
  (`torch.set_num_threads`); its best is the reference.
- jaxtorch, JAX-first: `jaxtorch.generation.greedy_decoder` (prefill and a `lax.scan`
  decode loop over a `StaticCache` pytree, one XLA program).
- jaxtorch, torch-first: a `jaxtorch.jit` step updating a `StaticCache` in place, called
  once per token from Python.

Compilation is outside the timings (one warm-up call each); runs are interleaved and
repeated, the figure is median tokens/s with the range; every side's tokens are checked
to equal torch's before anything is timed.

    python benchmarks/decode.py                    # 4 layers, width 256, 64 new tokens
    python benchmarks/decode.py --repeats 7 --new 128
"""

from __future__ import annotations

import argparse
import copy
import inspect
import os
import statistics
import time

import numpy as np
import torch
import transformers

import jaxtorch
from jaxtorch.generation import greedy_decoder


def build(layers: int, width: int, vocab: int) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        num_hidden_layers=layers,
        hidden_size=width,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=width * 8 // 3,
        vocab_size=vocab,
        max_position_embeddings=1024,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def torch_generate(model, ids, new: int, threads: int, cache: str | None):
    def run():
        torch.set_num_threads(threads)
        kw = {"cache_implementation": cache} if cache else {}
        with torch.no_grad():
            return model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0, **kw)[
                :, ids.shape[1] :
            ]

    return run


def jaxtorch_scan(model, ids, new: int):
    decode = greedy_decoder(model, max_cache_len=ids.shape[1] + new, eos_token_id=None)  # as min_new_tokens=new

    def run():
        return torch.from_numpy(np.asarray(decode(ids, new)).astype(np.int64))

    return run


def jaxtorch_step(model, ids, new: int):
    from transformers.cache_utils import StaticCache

    jm = copy.deepcopy(model).to("jax")

    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"  # < 5.24

    @jaxtorch.jit
    def step(model, tok, cache):
        return model(tok, logits_to_keep=1, **{key: cache}).logits[:, -1:].argmax(-1)

    def run():
        cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + new)
        with torch.no_grad():
            tok = step(jm, ids.to("jax"), cache)
            toks = [tok]
            for _ in range(new - 1):
                tok = step(jm, tok, cache)
                toks.append(tok)
            return torch.cat([t.cpu() for t in toks], dim=1)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    model = build(args.layers, args.width, args.vocab)
    ids = torch.randint(1, args.vocab, (args.batch, args.prompt), generator=torch.Generator().manual_seed(1))
    cores = os.cpu_count() or 1
    sides = {
        "torch generate, dynamic cache, 1 thread": torch_generate(model, ids, args.new, 1, None),
        f"torch generate, dynamic cache, {cores} threads": torch_generate(model, ids, args.new, cores, None),
        "torch generate, static cache, 1 thread": torch_generate(model, ids, args.new, 1, "static"),
        f"torch generate, static cache, {cores} threads": torch_generate(model, ids, args.new, cores, "static"),
        "jaxtorch greedy_decoder (one program, lax.scan)": jaxtorch_scan(model, ids, args.new),
        "jaxtorch.jit step per token (in-place StaticCache)": jaxtorch_step(model, ids, args.new),
    }
    reference = sides["torch generate, static cache, 1 thread"]()
    for name, run in sides.items():  # warm-up (compiles) and the tokens check
        got = run()
        if not torch.equal(got, reference):
            raise SystemExit(f"{name}: tokens differ from torch's")
    rates = {name: [] for name in sides}
    for _ in range(args.repeats):  # interleaved
        for name, run in sides.items():
            t0 = time.perf_counter()
            run()
            rates[name].append(args.new * args.batch / (time.perf_counter() - t0))
    torch.set_num_threads(cores)

    best_torch = max(statistics.median(v) for k, v in rates.items() if k.startswith("torch"))
    print(
        f"Llama {args.layers}x{args.width}, vocab {args.vocab}, batch {args.batch}, prompt {args.prompt}, "
        f"{args.new} new tokens, {args.repeats} interleaved repeats, {cores} cores"
    )
    print("| side | tokens/s (median) | range | / torch's best |")
    print("|---|---|---|---|")
    for name, v in rates.items():
        med = statistics.median(v)
        print(f"| {name} | {med:.0f} | {min(v):.0f}-{max(v):.0f} | {med / best_torch:.2f}x |")


if __name__ == "__main__":
    main()
