"""Elementwise lowerings: arithmetic, comparison, logical, bitwise and unary math."""

from __future__ import annotations

import jax.numpy as jnp
import torch

from ._semantics import ALWAYS_BOOL, DEFAULT, INT_TO_FLOAT, elementwise
from .registry import register

aten = torch.ops.aten


@register(aten.add.Tensor, aten.add.Scalar)
@elementwise(DEFAULT, n=2)
def add(a, b, alpha=1):
    return a + (b * alpha if alpha != 1 else b)


@register(aten.sub.Tensor, aten.sub.Scalar)
@elementwise(DEFAULT, n=2)
def sub(a, b, alpha=1):
    return a - (b * alpha if alpha != 1 else b)


@register(aten.mul.Tensor, aten.mul.Scalar)
@elementwise(DEFAULT)
def mul(a, b):
    return a * b


@register(aten.div.Tensor, aten.div.Scalar)
@elementwise(INT_TO_FLOAT)
def div(a, b):
    return a / b


@register(aten.eq.Tensor, aten.eq.Scalar)
@elementwise(ALWAYS_BOOL)
def eq(a, b):
    return a == b
