# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # A Hugging Face Llama in JAX
#
# The path most people come to jaxtorch for: take a Hugging Face causal LM, run its forward under
# `jax.jit`, shard it tensor-parallel over devices, decode greedily with a static KV cache at compiled
# speed, and fine-tune it with LoRA. The model here is a Llama built from a small config with random
# weights (nothing is downloaded), so every number below is about the machinery, not the text.
#
# No accelerator needed: XLA can pretend the CPU is 8 devices. That must be set **before JAX starts**,
# so it is the first cell (restart the kernel if you already imported jax).

# %%
import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import time

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax
import torch
from jax.sharding import PartitionSpec as P
from transformers import LlamaConfig, LlamaForCausalLM

import jaxtorch
from jaxtorch.train import make_train_step, shard, shard_batch

print(jax.device_count(), "devices")

# %% [markdown]
# ## A Llama from a config
#
# Two layers, hidden size 64, four heads: small enough to compile in seconds on a CPU.

# %%
torch.manual_seed(0)
config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128)
model = LlamaForCausalLM(config).eval()
ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
print(f"{sum(p.numel() for p in model.parameters()):,} parameters")

# %% [markdown]
# ## The forward under `jax.jit`
#
# `jaxtorch.extract` turns the module into a dict of JAX arrays and a pure function of them. The
# logits equal eager PyTorch's on the CPU.

# %%
params, fn = jaxtorch.extract(model)
forward = jax.jit(lambda p, x: fn(p, x, use_cache=False).logits)
logits = forward(params, jnp.asarray(ids.numpy()))

with torch.no_grad():
    ref = model(ids, use_cache=False).logits.numpy()
print("logits", logits.shape, "max |jax - torch| =", float(np.abs(np.asarray(logits) - ref).max()))

# %% [markdown]
# ## Tensor parallel over 8 devices
#
# A `("data", "model")` mesh of 2 x 4 devices from `jax.make_mesh` (its axes are *Explicit* by default
# since JAX 0.9: shardings are part of the array types). `jaxtorch.train.shard` places each parameter
# by name rules, Megatron style (torch's `Linear.weight` is `(out, in)`):
#
# * `q_proj`, `k_proj`, `v_proj`, `gate_proj`, `up_proj` are split by output rows: each device holds one
#   attention head and a quarter of the MLP;
# * `o_proj`, `down_proj` are split by input columns; their outputs are summed across devices.
#
# The batch is split over `"data"`. Inside the torch code the mesh's axes run as Auto axes, so XLA's
# sharding propagation (GSPMD) chooses the layout of every intermediate, as torch_xla does.

# %%
mesh = jax.make_mesh((2, 4), ("data", "model"))
rules = [
    (r"(q_proj|k_proj|v_proj|gate_proj|up_proj)\.weight$", P("model", None)),
    (r"(o_proj|down_proj)\.weight$", P(None, "model")),
]
tp_params = shard(params, mesh, rules)
tp_ids = shard_batch(jnp.asarray(ids.numpy()), mesh)
tp_logits = forward(tp_params, tp_ids)

print(mesh)
print("logits", jax.typeof(tp_logits), "| same as one device:", np.allclose(tp_logits, logits, atol=1e-5))

# %%
q = tp_params["model.layers.0.self_attn.q_proj.weight"]
print("q_proj.weight", jax.typeof(q), "-> each device holds", q.addressable_shards[0].data.shape)
jax.debug.visualize_array_sharding(q)
o = tp_params["model.layers.0.self_attn.o_proj.weight"]
print("o_proj.weight", jax.typeof(o))
jax.debug.visualize_array_sharding(o)
print("logits[:, :, 0]: rows split over 'data'")
jax.debug.visualize_array_sharding(tp_logits[:, :, 0])

# %% [markdown]
# ## Greedy generation with a static cache
#
# A `StaticCache` holds fixed-size key/value arrays, so every decode step has the same shapes. A
# decode step written the way `torch.compile` users write it (update the cache in place, return the
# next token) goes through `jaxtorch.jit` as is: the tensors the step writes in place (the cache's
# keys, values and positions) are program state, carried in and out of one XLA program and written
# back into the cache. It compiles twice in all: once for the prompt (prefill), once for the
# one-token steps. The model lives on the `jax` device (`enable_globally` + `.to("jax")`).

# %%
import copy

from transformers.cache_utils import StaticCache

jaxtorch.enable_globally()
jax_model = copy.deepcopy(model).to("jax")


@jaxtorch.jit
def next_token(model, tok, cache):
    """One greedy step: the cache is updated in place, the next token comes back."""
    return model(tok, cache=cache).logits[:, -1:].argmax(-1)


def greedy(model, prompt, n, step):
    """`n` greedy tokens after `prompt`, one forward per token through a static cache."""
    cache = StaticCache(config=config, max_cache_len=prompt.shape[1] + n)
    with torch.no_grad():
        tokens = [step(model, prompt, cache)]
        for _ in range(n - 1):
            tokens.append(step(model, tokens[-1], cache))
    return torch.cat([prompt.cpu()] + [t.cpu() for t in tokens], dim=1)


def eager_step(model, tok, cache):
    return model(tok, cache=cache).logits[:, -1:].argmax(-1)


prompt = ids[:1, :8]
N = 32
# Eager torch on a model this small is all per-op overhead: one thread is its fastest setting (more
# threads only add synchronisation, and on a busy machine they can be many times slower).
torch.set_num_threads(1)
jax_tokens = greedy(jax_model, prompt.to("jax"), N, next_token)
torch_tokens = greedy(model, prompt, N, eager_step)
generated = model.generate(prompt, max_new_tokens=N, do_sample=False, cache_implementation="static",
                           pad_token_id=0)
print("same tokens as torch's loop:", torch.equal(jax_tokens, torch_tokens),
      "| as torch's generate:", torch.equal(jax_tokens, generated))
print("programs compiled:", next_token.compilations, "(prefill and decode)")

# %% [markdown]
# The JAX-first recipe, `jaxtorch.generation.greedy_decoder`, goes one step further: prefill and a
# `lax.scan` over the decode steps are one XLA program, the `StaticCache` its carry (Hugging Face
# caches are pytrees to jaxtorch), so no Python runs between tokens.

# %%
decoder = jaxtorch.generation.greedy_decoder(model, max_cache_len=prompt.shape[1] + N)
scan_tokens = np.asarray(decoder(jnp.asarray(prompt.numpy()), max_new_tokens=N))
print("greedy_decoder, same tokens as torch's loop:", np.array_equal(scan_tokens, torch_tokens[:, -N:].numpy()))

# %% [markdown]
# Tokens per second, best of three runs each (a shared CPU is noisy; the compiled programs are
# already built). Torch runs eagerly on the CPU with one thread, both its `generate` and the same
# hand-written loop.

# %%
def tokens_per_second(run, repeats=3):
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return N / best


rates = {
    "torch generate\n(eager, CPU)": tokens_per_second(
        lambda: model.generate(prompt, max_new_tokens=N, do_sample=False, cache_implementation="static",
                               pad_token_id=0)),
    "torch loop\n(eager, CPU)": tokens_per_second(lambda: greedy(model, prompt, N, eager_step)),
    "jaxtorch.jit loop": tokens_per_second(lambda: greedy(jax_model, prompt.to("jax"), N, next_token)),
    "greedy_decoder\n(one program)": tokens_per_second(
        lambda: decoder(jnp.asarray(prompt.numpy()), max_new_tokens=N).block_until_ready()),
}
for name, rate in rates.items():
    print(f"{name.replace(chr(10), ' '):28s} {rate:8.1f} tokens/s")

fig, ax = plt.subplots(figsize=(7, 3))
ax.bar(list(rates), list(rates.values()), color=["tab:gray", "tab:gray", "tab:blue", "tab:blue"])
ax.set_ylabel("tokens / s")
ax.set_title(f"greedy decoding, {N} tokens, static cache")
plt.show()

# %% [markdown]
# `model.generate` itself works on the `jax` device too; with the forward compiled the way
# `torch.compile` users set it, `model.forward = jaxtorch.compile(model.forward)`, it builds one
# program for the prompt and one for the decode steps (generate's own bookkeeping between them runs
# eagerly, op by op, which is why the hand-written loop above is the fast path).

# %% [markdown]
# ## LoRA fine-tuning
#
# [PEFT](https://github.com/huggingface/peft) wraps the attention projections with low-rank adapters.
# peft sets `requires_grad=False` on the base weights, and `make_train_step` trains only trainable
# parameters (`trainable="*lora_*"` would say the same by name): the base weights are frozen, carried in
# `state.model_state`, and stay bit-identical; the optimizer state exists only for the adapters.

# %%
import peft

lora_model = peft.get_peft_model(
    LlamaForCausalLM(config).eval(),
    peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]),
)
lora_model.print_trainable_parameters()


def lm_loss(out, ids):
    """Next-token cross entropy."""
    return optax.softmax_cross_entropy_with_integer_labels(out.logits[:, :-1], ids[:, 1:]).mean()


init, step = make_train_step(lora_model, lm_loss, optax.adam(3e-2))  # peft froze the rest: requires_grad=False
state = init()
print(len(state.params), "trained arrays;", len(state.model_state), "in model_state (frozen weights, buffers)")
before = {k: np.asarray(v) for k, v in {**state.params, **state.model_state}.items()}
batch = jnp.asarray(ids.numpy())
losses = []
for _ in range(8):
    state, loss = step(state, batch, batch)
    losses.append(float(loss))
print("losses:", np.round(losses, 3))

after = {**state.params, **state.model_state}
changed = sorted(k for k in before if not np.array_equal(after[k], before[k]))
print(len(changed), "arrays changed, all LoRA:", all("lora_" in k for k in changed))
print("Adam state for", len(state.opt_state[0].mu), "arrays of", len(state.params))

# %% [markdown]
# ## Pretrained weights straight into the tensor-parallel layout
#
# For a model larger than one host, never build it in torch's memory: build it on the **meta device**
# (shapes and dtypes, no data), and let `jaxtorch.load_params` read the checkpoint (a safetensors
# file, a Hugging Face directory of shards, or a torch `.bin`) slice by slice straight into the sharded
# arrays: each device's slice is read from the file, converted, and handed to JAX, so the host never
# holds more than what its devices hold plus one slice. Names map as `from_pretrained` maps them (tied
# weights, `model.` prefixes); the rotary `inv_freq`, which checkpoints do not hold, is computed by the
# module's own code. Here the checkpoint is the model above, saved with `save_pretrained`.

# %%
import tempfile

checkpoint = tempfile.mkdtemp()
model.save_pretrained(checkpoint)

with torch.device("meta"):
    meta_model = LlamaForCausalLM(config).eval()
shapes, meta_fn = jaxtorch.extract(meta_model)  # jax.ShapeDtypeStructs: nothing allocated
print("q_proj.weight on the meta device:", shapes["model.layers.0.self_attn.q_proj.weight"])

tp_loaded, tp_state = jaxtorch.load_params(meta_model, checkpoint, mesh=mesh, rules=rules)
q = tp_loaded["model.layers.0.self_attn.q_proj.weight"]
print("loaded q_proj.weight", jax.typeof(q), "-> each device holds", q.addressable_shards[0].data.shape)

weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
per_device = {}
for array in [*tp_loaded.values(), *tp_state.values()]:
    for s in array.addressable_shards:
        per_device[s.device] = per_device.get(s.device, 0) + s.data.nbytes
print(f"weights {weight_bytes / 1024:.0f} KiB; each device holds {max(per_device.values()) / 1024:.0f} KiB "
      f"({max(per_device.values()) / weight_bytes:.2f}x: attention and MLP split 4 ways, the rest replicated)")

# %% [markdown]
# The jitted forward takes the loaded arrays (`state=` carries the buffers), and greedy generation
# runs on them too: here without a cache, each step one jitted forward over a fixed-length buffer
# (a causal model's logits at position `t` do not see the tokens after it).

# %%
tp_forward = jax.jit(lambda p, s, x: meta_fn(p, x, state=s, use_cache=False).logits)
loaded_logits = tp_forward(tp_loaded, tp_state, tp_ids)
print("loaded, tensor parallel: same logits as torch:", np.allclose(loaded_logits, ref, atol=1e-5))


@jax.jit
def greedy_tokens(p, s, prompt_ids):
    """N greedy tokens after `prompt_ids`, one forward per token over a fixed-length buffer."""
    length = prompt_ids.shape[1]
    buffer = jnp.zeros((prompt_ids.shape[0], length + N), prompt_ids.dtype).at[:, :length].set(prompt_ids)

    def body(t, buffer):
        logits = meta_fn(p, buffer, state=s, use_cache=False).logits
        return buffer.at[:, t].set(jnp.argmax(logits[:, t - 1], axis=-1).astype(buffer.dtype))

    return jax.lax.fori_loop(length, length + N, body, buffer)[:, length:]


loaded_tokens = greedy_tokens(tp_loaded, tp_state, jnp.asarray(prompt.numpy()))
print("greedy from the loaded weights, same tokens as torch's generate:",
      np.array_equal(np.asarray(loaded_tokens), generated[:, -N:].numpy()))

# %% [markdown]
# On a Llama of 336 M parameters, the peak resident memory of `load_params` above a process that only
# imported the libraries is about the bytes the devices hold (see `benchmarks/load.py` and the
# README's "Pretrained weights" section).
