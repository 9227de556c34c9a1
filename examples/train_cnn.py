"""Train a PyTorch CNN with JAX: optax step, checkpoint, resume, and back into PyTorch.

A small CNN with BatchNorm and dropout, defined in plain PyTorch, learns a synthetic
task (which of 4 quadrants of a 16x16 image is brightest) with a jitted optax step from
`jaxtorch.train.make_train_step`. Halfway, the run is checkpointed and resumed from the
file; at the end the trained weights and BatchNorm statistics go back into the torch
module, which is evaluated in eager PyTorch.

    python examples/train_cnn.py            # well under a minute on 2 CPU cores
"""

from __future__ import annotations

import os
import tempfile

import jax
import numpy as np
import optax
import torch
from torch import nn
from tqdm import tqdm

from jaxtorch.train import load_checkpoint, load_into, make_train_step, save_checkpoint


class CNN(nn.Module):
    def __init__(self, n_classes: int = 4):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, stride=2, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),  # 16x16 -> 8x8
            nn.Conv2d(16, 32, 3, stride=2, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(),  # 8x8 -> 4x4
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(0.2), nn.Linear(32 * 4 * 4, n_classes))

    def forward(self, x):
        return self.head(self.features(x))


def make_data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Noise images with one brightened quadrant; the label is that quadrant."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 1, 16, 16)).astype(np.float32)
    y = rng.integers(0, 4, size=n)
    for i, q in enumerate(y):
        r, c = divmod(int(q), 2)
        x[i, 0, 8 * r : 8 * r + 8, 8 * c : 8 * c + 8] += 0.25  # faint: takes some steps to learn
    return x, y.astype(np.int32)


def cross_entropy(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def train(model, state, step, x, y, first: int, last: int, key, batch: int = 64, log_every: int = 20):
    losses = []
    # A progress bar on a terminal; in a pipe or a log file (disable=None: stderr is not a terminal)
    # tqdm's redraws would pile up on one line, so print a plain line every `log_every` steps instead.
    with tqdm(range(first, last), desc="train", unit="step", mininterval=1.0, disable=None) as bar:
        for i in bar:
            idx = np.random.default_rng(i).choice(len(x), batch, replace=False)
            state, loss = step(state, x[idx], y[idx], jax.random.fold_in(key, i))
            losses.append(float(loss))
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
            if bar.disable and (i + 1) % log_every == 0:
                print(f"train step {i + 1}/{last}: loss {losses[-1]:.3f}", flush=True)
    return state, losses


def main(steps: int = 120) -> dict:
    torch.manual_seed(0)
    model = CNN().train()
    x, y = make_data(2048, seed=0)
    x_test, y_test = make_data(512, seed=1)

    init, step = make_train_step(model, cross_entropy, optax.adamw(3e-3))
    key = jax.random.key(0)
    state = init()
    half = steps // 2
    state, losses = train(model, state, step, x, y, 0, half, key)

    with tempfile.TemporaryDirectory() as run_dir:
        ckpt = os.path.join(run_dir, "cnn.safetensors")
        save_checkpoint(state, ckpt)
        print(f"checkpoint: {ckpt} ({os.path.getsize(ckpt) / 1e3:.0f} kB) at step {int(state.step)}")
        del state
        state = load_checkpoint(ckpt)  # resume from the file
    state, more = train(model, state, step, x, y, int(state.step), steps, key)
    losses += more
    first, last = np.mean(losses[:10]), np.mean(losses[-10:])
    curve = "  ".join(f"{np.mean(losses[i : i + 10]):.3f}" for i in range(0, len(losses), 20))
    print(f"loss (mean of 10 steps, every 20): {curve}")
    print(f"loss: first 10 steps {first:.3f} -> last 10 steps {last:.3f}")

    load_into(model, state)  # weights (state.params) and BatchNorm running statistics (state.model_state)
    model.eval()
    with torch.no_grad():
        pred = model(torch.from_numpy(x_test)).argmax(-1).numpy()
    accuracy = float((pred == y_test).mean())
    print(f"eager PyTorch test accuracy after load_into: {accuracy:.1%}")
    return {"first_loss": first, "last_loss": last, "accuracy": accuracy}


if __name__ == "__main__":
    main()
