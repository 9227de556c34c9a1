"""Float32 matmul precision: torch's setting, applied to the JAX programs jaxtorch builds.

PyTorch computes float32 matmuls and convolutions in full float32 unless told otherwise
(`torch.set_float32_matmul_precision("high")` allows TF32 / bf16x3); JAX's default on GPUs
and TPUs is faster and less exact. jaxtorch follows torch: lowerings are traced under
`jax.default_matmul_precision` of torch's current setting, so results match eager PyTorch
on every backend by default, and the usual torch switch buys the speed back.
On the CPU all settings compute the same. The setting is read when a program is traced:
a function JAX has already traced (or an op already run eagerly) keeps its precision.

| torch.get_float32_matmul_precision() | JAX precision |
|---|---|
| "highest" (torch's default) | "highest" (full float32) |
| "high" | "high" (bf16x3 / TF32) |
| "medium" | "default" (one bf16 pass) |

Example:
    ```python
    torch.set_float32_matmul_precision("high")   # TF32 on an H100, also through jaxtorch
    with matmul_precision():
        y = lowering(x, w)
    ```
"""

from __future__ import annotations

import jax
import torch

_JAX_NAME = {"highest": "highest", "high": "high", "medium": "default"}


def matmul_precision():
    """A context that traces dots and convolutions at torch's float32 matmul precision."""
    return jax.default_matmul_precision(_JAX_NAME.get(torch.get_float32_matmul_precision(), "highest"))
