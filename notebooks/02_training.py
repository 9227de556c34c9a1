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
# # Training a PyTorch model with JAX and optax
#
# `jaxtorch.train.make_train_step(model, loss_fn, optimizer)` turns a `torch.nn.Module` into a jitted
# training step: the forward is the torch code, the gradient is `jax.grad`, the update is any optax
# optimizer, and the whole step is one XLA program. We will
#
# 1. train a small CNN (BatchNorm + dropout) on synthetic images, with a progress bar,
# 2. plot the loss curve,
# 3. save a checkpoint, load it back and resume training,
# 4. put the trained weights back into the torch module and evaluate it in eager PyTorch.

# %%
# %matplotlib inline
import os
import tempfile

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax
import torch
from torch import nn
from tqdm.auto import tqdm

import jaxtorch
from jaxtorch.train import load_checkpoint, load_into, make_train_step, save_checkpoint


# %% [markdown]
# ## Data and model
#
# Each 16x16 image is noise with one faintly brightened quadrant; the label is that quadrant (4 classes).
# The model is plain PyTorch.

# %%
def make_data(n, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 1, 16, 16)).astype(np.float32)
    y = rng.integers(0, 4, size=n).astype(np.int32)
    for i, q in enumerate(y):
        r, c = divmod(int(q), 2)
        x[i, 0, 8 * r:8 * r + 8, 8 * c:8 * c + 8] += 0.25
    return x, y


class CNN(nn.Module):
    def __init__(self, n_classes=4):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(0.2), nn.Linear(32 * 4 * 4, n_classes))

    def forward(self, x):
        return self.head(self.features(x))


x_train, y_train = make_data(2048, seed=0)
x_test, y_test = make_data(512, seed=1)
torch.manual_seed(0)
model = CNN().train()
print(model)


# %% [markdown]
# ## The training step
#
# `loss_fn(outputs, targets)` is written in JAX (here optax's cross entropy). `init()` copies the model's
# trainable parameters (`state.params`, what AdamW updates) and the rest (`state.model_state`: buffers such
# as BatchNorm's statistics, which only the forward changes, and frozen parameters) into a `TrainState`;
# `step(state, x, y, key)` returns the new state and the loss. The state passed in is donated (its memory
# reused), so always continue from the state `step` returns. The key feeds dropout: a new key per step
# gives new dropout masks without recompiling.

# %%
def cross_entropy(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


init, step = make_train_step(model, cross_entropy, optax.adamw(3e-3))
state = init()
print("state.params:", len(state.params), "arrays, e.g.",
      {k: v.shape for k, v in list(state.params.items())[:3]})
print("buffers are carried in model_state:", [k for k in state.model_state if "running" in k][:2], "...")
print("step counter:", int(state.step))

# %%
key = jax.random.key(0)
BATCH = 64


def train(state, first, last):
    losses = []
    with tqdm(range(first, last), desc="train", unit="step", mininterval=0.5) as bar:
        for i in bar:
            idx = np.random.default_rng(i).choice(len(x_train), BATCH, replace=False)
            state, loss = step(state, x_train[idx], y_train[idx], jax.random.fold_in(key, i))
            losses.append(float(loss))
            bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
    return state, losses


state, losses = train(state, 0, 100)   # the first step compiles (a few seconds); the rest are fast
print(f"after {int(state.step)} steps: loss {np.mean(losses[:10]):.3f} -> {np.mean(losses[-10:]):.3f}")

# %% [markdown]
# ## Checkpoint and resume
#
# `save_checkpoint` writes the whole `TrainState` (parameters, BatchNorm statistics, Adam moments, step)
# to one `.safetensors` file; nothing in it is executed on load. `load_checkpoint` gives back the same
# pytree, and training continues from step 100.

# %%
run_dir = tempfile.mkdtemp()
ckpt = os.path.join(run_dir, "cnn.safetensors")
save_checkpoint(state, ckpt)
print(f"saved {os.path.getsize(ckpt) / 1e3:.0f} kB at step {int(state.step)}")

restored = load_checkpoint(ckpt)
same = all(np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(restored)))
print("restored state is identical:", same, "| type:", type(restored).__name__, "| step:", int(restored.step))

state, more = train(restored, int(restored.step), 200)
losses += more
print(f"resumed to step {int(state.step)}: last 10 steps' loss {np.mean(losses[-10:]):.3f}")

# %% [markdown]
# ## The loss curve

# %%
smooth = np.convolve(losses, np.ones(10) / 10, mode="valid")
fig, ax = plt.subplots(figsize=(7, 3.5))
ax.plot(losses, alpha=0.35, label="loss per step")
ax.plot(np.arange(9, len(losses)), smooth, label="mean of 10 steps")
ax.axvline(100, color="gray", linestyle="--", label="checkpoint / resume")
ax.set_xlabel("step"); ax.set_ylabel("cross entropy"); ax.legend(); ax.set_title("CNN trained with optax through jaxtorch")
plt.show()

# %% [markdown]
# ## Back to PyTorch
#
# `load_into(model, state)` writes the trained weights *and* BatchNorm running statistics into the
# torch module in place. From there it is an ordinary PyTorch model: evaluate it eagerly, `torch.save` it,
# export it.

# %%
load_into(model, state)
model.eval()
with torch.no_grad():
    logits_torch = model(torch.from_numpy(x_test))
accuracy = (logits_torch.argmax(-1).numpy() == y_test).mean()
print(f"eager PyTorch test accuracy: {accuracy:.1%} (chance is 25%)")
print("bn running_mean (first 4):", model.features[1].running_mean[:4].numpy().round(3))

# the same numbers from the JAX side, in eval mode
params, fn = jaxtorch.extract(model)
logits_jax = jax.jit(fn)(params, jnp.asarray(x_test))
print("max |jax - torch| on the test set:", float(jnp.max(jnp.abs(logits_jax - logits_torch.numpy()))))
