# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Sharding a PyTorch model over 8 devices
#
# JAX shards with GSPMD: place the arrays on a device mesh and `jax.jit` partitions the program. jaxtorch's
# `jaxtorch.train.shard` places a model's parameters (and optimizer state) by *name rules*, so data and
# tensor parallelism of a torch model are a few lines.
#
# No accelerator needed: XLA can pretend the CPU is 8 devices. This must be set **before JAX starts**,
# so it is the first cell (restart the kernel if you already imported jax).

# %%
import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
from jax.sharding import Mesh, PartitionSpec as P

import jaxtorch
from jaxtorch.train import make_train_step, shard, shard_batch

print(jax.device_count(), "devices:", jax.devices())


# %%
class MLP(torch.nn.Module):
    def __init__(self, d_in=32, d_hidden=64, d_out=8):
        super().__init__()
        self.fc1 = torch.nn.Linear(d_in, d_hidden)
        self.fc2 = torch.nn.Linear(d_hidden, d_out)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def mse(out, y):
    return jnp.mean((out - y) ** 2)


torch.manual_seed(0)
model = MLP()
rng = np.random.default_rng(0)
batches = [(rng.normal(size=(64, 32)).astype(np.float32), rng.normal(size=(64, 8)).astype(np.float32))
           for _ in range(5)]


def run(mesh=None, rules=()):
    init, step = make_train_step(model, mse, optax.adam(1e-2))
    state = init()
    if mesh is not None:
        state = shard(state, mesh, rules)          # parameters AND Adam moments, by name
    losses = []
    for x, y in batches:
        if mesh is not None:
            x, y = shard_batch((x, y), mesh)       # rows split over the mesh's "data" axis
        state, loss = step(state, x, y)
        losses.append(float(loss))
    return state, losses


ref_state, ref_losses = run()
print("one device, losses:", np.round(ref_losses, 4))

# %% [markdown]
# ## Data parallel
#
# A one-axis mesh `("data",)` over the 8 devices. Parameters are replicated (no rule matches them); each
# batch is split by rows, so every device sees 8 of the 64 rows. XLA inserts the gradient all-reduce.

# %%
dp_mesh = Mesh(np.array(jax.devices()), ("data",))
x0 = shard_batch(batches[0][0], dp_mesh)
print("batch", x0.shape, "->", x0.sharding.spec, "| rows per device:", x0.addressable_shards[0].data.shape)
jax.debug.visualize_array_sharding(x0[:, :8])   # (a slice, to keep the picture small)

# %%
dp_state, dp_losses = run(dp_mesh)
print("data parallel, losses:", np.round(dp_losses, 4))
print("same as one device:", np.allclose(dp_losses, ref_losses, rtol=1e-5))
print("fc1.weight replicated:", dp_state.params["fc1.weight"].sharding.is_fully_replicated)

# %% [markdown]
# ## Tensor parallel (Megatron-style) on a 2 x 4 mesh
#
# Rules are `(regex, PartitionSpec)` pairs matched against each array's name; the first match wins.
# torch's `Linear.weight` is `(out_features, in_features)`, so:
#
# * `fc1` is split by output columns: weight `P("model", None)`, bias `P("model")`;
# * `fc2` is split by input rows: weight `P(None, "model")` (its output is then summed across devices).
#
# The batch is still split over `"data"`: 2-way data parallel times 4-way tensor parallel.

# %%
mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
rules = [
    (r"fc1\.weight$", P("model", None)),
    (r"fc1\.bias$", P("model")),
    (r"fc2\.weight$", P(None, "model")),
]
tp_state, tp_losses = run(mesh, rules)
print("tensor parallel, losses:", np.round(tp_losses, 4))
print("same as one device:", np.allclose(tp_losses, ref_losses, rtol=1e-5))

# %%
w1, w2 = tp_state.params["fc1.weight"], tp_state.params["fc2.weight"]
print("fc1.weight", w1.shape, w1.sharding.spec, "-> each device holds", w1.addressable_shards[0].data.shape)
jax.debug.visualize_array_sharding(w1)
print("fc2.weight", w2.shape, w2.sharding.spec, "-> each device holds", w2.addressable_shards[0].data.shape)
jax.debug.visualize_array_sharding(w2)

# %% [markdown]
# The optimizer state follows: Adam's first moment of `fc1.weight` lives at the path
# `opt_state.0.mu.fc1.weight`, which the same rule matches, so it is split exactly like its parameter.

# %%
mu = tp_state.opt_state[0].mu["fc1.weight"]
print("Adam mu[fc1.weight]:", mu.sharding.spec, "same placement as the weight:", mu.sharding.is_equivalent_to(w1.sharding, 2))

# %% [markdown]
# ## The same from the PyTorch side
#
# A sharded array is still a torch tensor on the `jax` device (`jaxtorch.torch_view`); torch ops on it run
# as sharded JAX ops and its repr says how it is laid out.

# %%
t = jaxtorch.torch_view(w1)
with jaxtorch.default_env():
    row_norms = t.norm(dim=1)       # a torch op on a sharded tensor
print(type(t).__name__, tuple(t.shape), t.device, "| norms split like the rows:", row_norms.jax().sharding.spec)
print("norms match NumPy:", np.allclose(row_norms.cpu().numpy(), np.linalg.norm(np.asarray(w1), axis=1), rtol=1e-5))
t
