# ---
# jupyter:
#   jupytext:
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
# # jaxtorch quickstart
#
# jaxtorch runs PyTorch code on JAX. There are two ways in:
#
# * **PyTorch-first** (the two-line change): keep your torch code and put it on the `"jax"` device.
#   Every torch op runs as a JAX op; `loss.backward()` works.
# * **JAX-first**: turn a `torch.nn.Module` into a dict of `jax.Array`s and a *pure* JAX function with
#   `jaxtorch.extract`, then use `jax.jit`, `jax.grad` and `jax.vmap` as with any JAX code.
#
# At the end we look inside the compiled XLA program: it still carries the torch module path and the
# ATen op name of every instruction, so profiles read like your PyTorch source.

# %%
import copy
import re
import time

import jax
import jax.numpy as jnp
import torch

import jaxtorch

print("jax", jax.__version__, "| torch", torch.__version__, "| devices:", jax.devices())


# %% [markdown]
# ## A model written in plain PyTorch
#
# Nothing here knows about JAX. Eager PyTorch on the CPU gives the reference output.

# %%
class TinyCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, kernel_size=3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.conv2 = torch.nn.Conv2d(8, 16, kernel_size=3, stride=2)
        self.fc = torch.nn.Linear(16 * 13 * 13, 10)

    def forward(self, x):
        x = torch.relu(self.bn(self.conv1(x)))
        x = torch.nn.functional.gelu(self.conv2(x))
        return self.fc(x.flatten(1))


torch.manual_seed(0)
model = TinyCNN().eval()
x = torch.randn(4, 3, 28, 28)
ref = model(x)
print("eager PyTorch output:", tuple(ref.shape), ref.dtype)

# %% [markdown]
# ## PyTorch-first: the two-line change
#
# 1. `jaxtorch.enable_globally()` makes `"jax"` a torch device (for this thread).
# 2. `.to("jax")` moves the model and its inputs there.
#
# The result is a torch tensor on device `jax:0`; underneath it is a `jax.Array`, which `res.jax()` returns
# without a copy. `res.cpu()` gives an ordinary CPU torch tensor back.

# %%
jaxtorch.enable_globally()                      # line 1

model_jax = copy.deepcopy(model).to("jax")      # line 2 (a copy, so `model` stays the CPU reference)
res = model_jax(x.to("jax"))

print("type:", type(res).__name__, "| device:", res.device, "| shape:", tuple(res.shape), "| dtype:", res.dtype)
print("res.jax() ->", type(res.jax()).__name__, res.jax().shape, res.jax().dtype, "on", res.jax().devices())
print("max |jax - torch| =", float((res.detach().cpu() - ref.detach()).abs().max()))
res[:2, :4]

# %% [markdown]
# Autograd works as usual: `loss.backward()` fills `.grad` of the parameters on the `jax` device.

# %%
res.logsumexp(-1).mean().backward()
ref.logsumexp(-1).mean().backward()

g_jax, g_torch = model_jax.conv1.weight.grad, model.conv1.weight.grad
print("conv1.weight.grad on", g_jax.device, "| max |jax - torch| =", float((g_jax.cpu() - g_torch).abs().max()))
model.zero_grad()

# %% [markdown]
# A whole torch train step compiles into one XLA program with `@jaxtorch.jit`: modules and optimizers
# passed in are state, so their parameters, `.grad`s and optimizer state (Adam's moments and step) go in
# and come out of the program, and the updates land on the objects as if torch had run eagerly. The first
# step compiles twice (it creates the optimizer state); after that nothing retraces.

# %%
import torch.nn.functional as F

opt = torch.optim.Adam(model_jax.parameters(), lr=1e-3)


@jaxtorch.jit
def train_step(model, opt, x, y):
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss


model_jax.train()
y = torch.randint(0, 10, (4,))
losses = [float(train_step(model_jax, opt, x, y).cpu()) for _ in range(5)]
print("losses:", [round(l, 4) for l in losses], "| compilations:", train_step.compilations)
print("Adam state:", sorted(opt.state[model_jax.conv1.weight]), "on", opt.state[model_jax.conv1.weight]["exp_avg"].device)
model_jax.eval()
jaxtorch.disable_globally()   # back to plain PyTorch for the rest of the notebook

# %% [markdown]
# ## JAX-first: `extract` + `jax.jit`
#
# `params, fn = jaxtorch.extract(model)` gives the trainable parameters as `jax.Array`s (keyed by the
# names `named_parameters` uses) and a pure function `fn(params, *inputs)`. The buffers (BatchNorm's
# running statistics) are the function's state, `fn.state`, used unless `fn(..., state=...)` gives others.
# The mode is fixed now (the model is in `eval()`: `fn.training` is False; `extract(model, train=True)`
# asks for the other). It holds no hidden state, so all of JAX's transformations apply.

# %%
params, fn = jaxtorch.extract(model)
for name, value in list(params.items())[:5]:
    print(f"{name:22s} {str(value.shape):18s} {value.dtype}")
print(f"... {len(params)} parameters; state: {sorted(fn.state)}; training: {fn.training}")

# %%
xj = jaxtorch.to_jax(x)          # a CPU torch tensor -> jax.Array
fast = jax.jit(fn)

t0 = time.perf_counter(); logits = fast(params, xj).block_until_ready(); t1 = time.perf_counter()
fast(params, xj).block_until_ready(); t2 = time.perf_counter()
print(f"first call (trace + compile): {t1 - t0:.2f} s, second call (compiled): {(t2 - t1) * 1e3:.1f} ms")
print("logits:", type(logits).__name__, logits.shape, "| max |jax - torch| =",
      float(jnp.max(jnp.abs(logits - ref.detach().numpy()))))

# %% [markdown]
# Gradients come from `jax.grad`, with respect to `params` as they are: the buffers (among them
# BatchNorm's integer step counter `bn.num_batches_tracked`) are in `fn.state`, never differentiated.

# %%
print("state (not differentiated):", {k: str(v.dtype) for k, v in fn.state.items()})


def loss(params, x):
    return jax.nn.logsumexp(fn(params, x), axis=-1).mean()


grads = jax.jit(jax.grad(loss))(params, xj)
model(x).logsumexp(-1).mean().backward()     # the eager torch reference
print("grad keys:", list(grads)[:4], "...")
print("conv1.weight: max |jax.grad - torch| =",
      float(jnp.max(jnp.abs(grads["conv1.weight"] - model.conv1.weight.grad.numpy()))))
model.zero_grad()

# %% [markdown]
# ## Will my model run? `jaxtorch.coverage.check`
#
# Before porting a big model, ask which of the ops it uses have no JAX lowering. An empty list means
# everything runs (with `jit=True` it also checks the ops trace under `jax.jit`).

# %%
import jaxtorch.coverage

problems = jaxtorch.coverage.check(model, x, jit=True)
print("problems:", problems or "none, every op of TinyCNN runs under jax.jit")

# %% [markdown]
# ## The compiled program still speaks PyTorch
#
# Every op jaxtorch emits is wrapped in a `jax.named_scope` with the torch module path and the ATen op
# name. They appear in the lowered HLO's debug locations (and in profiler traces), so you can tell which
# line of the model a fusion or a slow kernel came from.
#
# A tiny GPT-2 built from a `transformers` config (random weights, nothing downloaded):

# %%
from transformers import GPT2Config, GPT2LMHeadModel

cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32, bos_token_id=0, eos_token_id=0)
gpt2 = GPT2LMHeadModel(cfg).eval()
gparams, gfn = jaxtorch.extract(gpt2)
ids = jnp.arange(16, dtype=jnp.int32)[None] % cfg.vocab_size

lowered = jax.jit(lambda p, i: gfn(p, i).logits).lower(gparams, ids)
hlo = lowered.as_text(debug_info=True)
names = sorted(set(re.findall(r'loc\("jit\(<lambda>\)/([^"]*aten::[^"/]*)', hlo)))
print(f"{len(hlo.splitlines())} lines of StableHLO, {len(names)} distinct (module path, torch op) scopes; "
      "those of the attention:")
print("\n".join(n for n in names if "/attn/" in n))

# %% [markdown]
# The same names in the instructions themselves: the matrix multiply of the attention's input projection
# (`c_attn`, a `Conv1D` doing `aten::addmm`):

# %%
loc_ids = dict(re.findall(r'^(#loc\d+) = loc\("([^"]*)"', hlo, flags=re.M))
shown = 0
for line in hlo.splitlines():
    m = re.search(r"stablehlo\.dot_general.*loc\((#loc\d+)\)", line)
    if m and "c_attn/aten::addmm" in loc_ids.get(m.group(1), ""):
        print(re.sub(r", contracting_dims.*? : ", " ... : ", line.strip()).split(" loc(")[0])
        print("    at", loc_ids[m.group(1)])
        shown += 1
print(shown, "matmul(s) found, one per GPT2Block")

# %% [markdown]
# **Next:** `02_training.ipynb` trains a torch model with optax; `05_interop.ipynb` mixes JAX and PyTorch
# code in both directions.
