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
# # Lazy execution: porting a torch_xla training loop
#
# torch_xla runs an unmodified PyTorch loop at compiled speed because its tensors are *lazy*:
# every op is recorded in a graph, and `xm.mark_step()` compiles the graph once, caches it by its
# structure and runs it as one XLA program. jaxtorch's lazy mode does the same on JAX:
#
# * ops on the `jax` device (forward, `loss.backward()`, `optimizer.step()`) are recorded, with shapes
#   and dtypes checked as they are recorded;
# * `mark_step()` runs everything pending for all live tensors as one program, cached by the graph's
#   structure, so a steady loop compiles nothing after its second step;
# * reading a value (`.item()`, `print`, `.cpu()`, `bool()`) runs just what that value needs.
#
# The port is two lines: import `jaxtorch.xla` where torch_xla's `xla_model` was, and switch jaxtorch on.

# %%
import torch
import torch.nn.functional as F

import jaxtorch
import jaxtorch.xla as xm  # was: import torch_xla.core.xla_model as xm

jaxtorch.enable_globally(lazy=True)  # the jax device is lazy from here on (xm.xla_device() does it too)
device = xm.xla_device()

# %% [markdown]
# A small classifier and synthetic data (nothing is downloaded). The loop below is the usual torch_xla
# loop: forward, backward, `optimizer_step`, `mark_step`.

# %%
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.LayerNorm(128),
                            torch.nn.Linear(128, 10)).to(device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
g = torch.Generator().manual_seed(1)
data = [(torch.randn(64, 32, generator=g), torch.randint(0, 10, (64,), generator=g)) for _ in range(10)]
data.append((torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)))  # a short last batch


def train_epoch(batches, log_every_step: bool):
    losses = []
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        xm.optimizer_step(opt)
        xm.mark_step()
        if log_every_step:
            print(f"loss {loss.item():.4f}")  # reads a value inside the loop
        losses.append(loss.detach())
    return losses


xm.clear_metrics()
train_epoch(data, log_every_step=True)
print(xm.metrics_report())

# %% [markdown]
# The report shows what a torch_xla user looks for:
#
# * **compiled programs**: step 1 (it also creates AdamW's state), step 2 (the steady graph), and one
#   more for the short last batch: a new shape is a new graph structure, so it compiles again;
# * **cache hits**: the steps in between reused the compiled program;
# * **unplanned executions**: none here, because `loss.item()` comes after `mark_step`, when the loss is
#   already computed. Reading it *before* `mark_step` would run the forward pass a second time, and the
#   report would name the line.
#
# Fixing the recompilation is the same as in torch_xla: keep shapes static (drop the short batch, or pad
# it), and read values after `mark_step` (or only every few steps).

# %%
xm.clear_metrics()
for _epoch in range(2):
    losses = train_epoch(data[:-1], log_every_step=False)  # drop_last: every batch has the same shape
print(xm.metrics_report())
print("last loss", losses[-1].item())

# %% [markdown]
# No compilation at all this time: both graph structures were compiled in the first epoch and every step
# hit the cache. An accidental read in the middle of the step shows up by its line:

# %%
xm.clear_metrics()
x, y = data[0][0].to(device), data[0][1].to(device)
loss = F.cross_entropy(model(x), y)
if loss > 1.0:  # bool() of a pending tensor: runs the forward now
    pass
loss.backward()
opt.step()
xm.mark_step()
print(xm.metrics_report())

# %% [markdown]
# `xm.metrics()` returns the same counters as a dataclass, for assertions in your own tests
# (`assert xm.metrics().compiles == 0`). `jaxtorch.disable_globally()` leaves lazy mode (running what is
# pending); `with jaxtorch.lazy(): ...` scopes it to a block.

# %%
m = xm.metrics()
print(m.compiles, m.cache_hits, m.executions, dict(m.unplanned))
jaxtorch.disable_globally()
