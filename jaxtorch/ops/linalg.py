"""Linear algebra lowerings: matmuls, einsum, decompositions and solves."""

from __future__ import annotations

import jax.numpy as jnp
import torch

from .registry import register

aten = torch.ops.aten


@register(aten.mm.default)
def mm(a, b):
    return a @ b
