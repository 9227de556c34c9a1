"""Reduction lowerings: sums, means, extrema, statistics, cumulative ops."""

from __future__ import annotations

import jax.numpy as jnp
import torch

from ._semantics import canon_dims
from .registry import register

aten = torch.ops.aten


@register(aten.sum.default)
def sum_(a, dtype=None):
    return jnp.sum(a, dtype=dtype)
