"""Shape lowerings: views, reshapes, permutes, concatenation and splitting."""

from __future__ import annotations

import jax.numpy as jnp
import torch

from ._semantics import canon_dim
from .registry import register

aten = torch.ops.aten


@register(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def view(a, size):
    return jnp.reshape(a, tuple(size))


@register(aten.t.default)
def t(a):
    return a.T if a.ndim == 2 else a


@register(aten.transpose.int)
def transpose(a, dim0, dim1):
    return jnp.swapaxes(a, canon_dim(dim0, a.ndim), canon_dim(dim1, a.ndim))


@register(aten.select.int)
def select(a, dim, index):
    return jnp.take(a, index, axis=canon_dim(dim, a.ndim))
