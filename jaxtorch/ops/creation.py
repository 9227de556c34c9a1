"""Creation lowerings: zeros/ones/full/arange and friends."""

from __future__ import annotations

import jax.numpy as jnp
import torch

from ..bridge.dtypes import default_float
from .registry import register

aten = torch.ops.aten


@register(aten.ones_like.default)
def ones_like(a, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return jnp.ones(a.shape, dtype or a.dtype)


@register(aten.zeros.default)
def zeros(size, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.zeros(tuple(size), dtype or default_float())
