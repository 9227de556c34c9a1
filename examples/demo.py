"""The README's main job: one PyTorch model run both ways on JAX, checked against PyTorch.

1. JAX-first: `jaxtorch.extract` -> a pure JAX function, jitted and differentiated.
2. PyTorch-first (the two-line change): the model on device "jax", including `loss.backward()`.
3. Training (when `examples/train_cnn.py` is present): a CNN trained with optax through
   `jaxtorch.train.make_train_step`, checkpointed, resumed and loaded back into torch.

Run: `python examples/demo.py`
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch

import jaxtorch


class MyModel(torch.nn.Module):
    """The README's example model: a small CNN classifier for 28x28 images."""

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


def check(name: str, got, want, tol: float = 1e-5) -> None:
    err = float(np.max(np.abs(np.asarray(got) - np.asarray(want))))
    ok = np.allclose(got, want, rtol=tol, atol=tol)
    print(f"  {'OK ' if ok else 'BAD'} {name}: max abs difference {err:.2e}")
    if not ok:
        sys.exit(f"{name} does not match PyTorch")


def main() -> None:
    torch.manual_seed(0)
    model = MyModel().eval()
    x = torch.randn(3, 3, 28, 28)
    ref = model(x)
    ref.square().mean().backward()
    ref_grad = model.conv1.weight.grad.clone()
    model.zero_grad()

    print("JAX-first: params, fn = jaxtorch.extract(model); jax.jit(fn)(params, x)")
    params, fn = jaxtorch.extract(model)
    jx = jaxtorch.to_jax(x)
    logits = jax.jit(fn)(params, jx)
    check("jitted logits", logits, ref.detach().numpy())
    # params are the trainable parameters; buffers (BatchNorm statistics) are fn.state, never differentiated
    grads = jax.jit(jax.grad(lambda p: jnp.mean(fn(p, jx) ** 2)))(params)
    check("jax.grad conv1.weight", grads["conv1.weight"], ref_grad.numpy(), tol=1e-4)

    print("PyTorch-first: jaxtorch.enable_globally(); model.to('jax')")
    jaxtorch.enable_globally()
    try:
        m = MyModel().eval()
        m.load_state_dict(model.state_dict())
        m = m.to("jax")
        res = m(x.to("jax"))
        print(f"  result: {type(res).__name__} on {res.device}, backed by {type(res.jax()).__name__}")
        check("logits on device jax", res.detach().cpu().numpy(), ref.detach().numpy())
        res.square().mean().backward()
        check("loss.backward() conv1.weight.grad", m.conv1.weight.grad.cpu().numpy(), ref_grad.numpy(), tol=1e-4)
    finally:
        jaxtorch.disable_globally()

    train = Path(__file__).with_name("train_cnn.py")
    if train.exists():
        print("Training with optax through jaxtorch.train.make_train_step")
        runpy.run_path(str(train), run_name="__main__")
    print("All results match PyTorch.")


if __name__ == "__main__":
    main()
