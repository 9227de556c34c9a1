"""Convolution weights in Flax's layout: `extract(model, conv_layout="flax")`.

torch stores a convolution's weight as `(out, in / groups, *kernel)` (OIHW for `Conv2d`).
XLA's CPU convolutions read `(*kernel, in / groups, out)` (HWIO, the layout of Flax's
`nn.Conv` `kernel`), so a jitted program given torch-layout weights relayouts every one of
them on every call: for a ResNet-18, 20 transposes of 42.6 MiB per forward, a third of its
time on this project's CPU. With `conv_layout="flax"`, `extract` hands out each plain
convolution's weight transposed once, under the name Flax gives it (`conv1.kernel` instead of
`conv1.weight`), and `fn` transposes it back inside the program, where XLA cancels the two
transposes. The new name marks the new layout, so such a value can never be taken for a torch
weight: `load_into` transposes it back, and `bound`'s name check refuses it anywhere else.

Only convolutions (`Conv1d/2d/3d`, grouped and depthwise included) are affected; transposed
convolutions, linear layers and everything else keep torch's names and layouts.

**Example:**
    ```python
    params, fn = jaxtorch.extract(resnet.eval(), conv_layout="flax")
    params["conv1.kernel"].shape        # (7, 7, 3, 64); torch's conv1.weight is (64, 3, 7, 7)
    logits = jax.jit(fn)(params, x)     # the same values as with torch's layout
    ```
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
import torch

from ..._compat import ConvNd, Tracer
from ._binding import named_state

ConvLayout = Literal["torch", "flax"]
Kernels = dict[str, tuple[str, tuple[int, ...]]]  # torch name -> (Flax-style name, permutation)


def check_layout(conv_layout: str) -> None:
    if conv_layout not in ("torch", "flax"):
        raise ValueError(
            f"jaxtorch: conv_layout must be 'torch' (torch's names and layouts) or 'flax' (convolution "
            f"weights as `<module>.kernel`, shaped (*kernel, in, out)), got {conv_layout!r}"
        )


def kernel_permutation(ndim: int) -> tuple[int, ...]:
    """`(out, in, *k) -> (*k, in, out)` for a weight of `ndim` dimensions: `(2, 3, 1, 0)` for 2-d."""
    return tuple(range(2, ndim)) + (1, 0)


def conv_kernels(module: torch.nn.Module, conv_layout: ConvLayout = "flax") -> Kernels:
    """`{torch name: (kernel name, permutation)}` for the weights `conv_layout` relayouts.

    Empty for `"torch"`. For `"flax"`: the `weight` of every non-transposed convolution module
    (by identity, so a weight shared under several names is renamed once, under the name
    `extract` keys it by).
    """
    check_layout(conv_layout)
    if conv_layout == "torch":
        return {}
    convs = {
        id(m.weight)
        for m in module.modules()
        if isinstance(m, ConvNd)
        and not m.transposed
        and not isinstance(m.weight, torch.nn.parameter.UninitializedParameter)
    }
    out: Kernels = {}
    for name, t in named_state(module).items():
        prefix, _, leaf = name.rpartition(".")
        if id(t) in convs and leaf == "weight":
            out[name] = (f"{prefix}.kernel" if prefix else "kernel", kernel_permutation(t.ndim))
    return out


def to_kernels(params: dict, kernels: Kernels) -> dict:
    """Torch-named, torch-layout values (torch tensors or arrays) -> the same dict with
    `kernels`' weights renamed and transposed (order of the entries kept)."""
    out = {}
    for name, value in params.items():
        if name in kernels:
            new, perm = kernels[name]
            out[new] = _relayout(value, perm)
        else:
            out[name] = value
    return out


def from_kernels(params: dict, kernels: Kernels) -> dict:
    """The inverse of `to_kernels`: `.kernel` entries back to torch's name and layout.

    A dict that gives one weight under both names raises `ValueError` (which one is meant?).
    """
    back = {new: (name, tuple(int(i) for i in np.argsort(perm))) for name, (new, perm) in kernels.items()}
    out = {}
    for name, value in params.items():
        if name in back:
            old, inverse = back[name]
            if old in params:
                raise ValueError(
                    f"jaxtorch: params give both `{old}` (torch's layout) and `{name}` (Flax's layout) "
                    "for one convolution weight; keep one"
                )
            if jnp.ndim(value) != len(inverse):
                raise ValueError(
                    f"jaxtorch: `{name}` has shape {tuple(jnp.shape(value))}; a {len(inverse) - 2}-d "
                    f"convolution kernel has {len(inverse)} dimensions (*kernel, in, out)"
                )
            out[old] = _relayout(value, inverse)
        else:
            out[name] = value
    return out


def _relayout(value, perm: tuple[int, ...]):
    """`value` transposed. A torch tensor gives a view (`extract`'s conversion makes it one
    contiguous copy, with torch's threads); a concrete host array is transposed by NumPy, since
    `jnp.transpose` outside `jit` compiles a small program per weight shape (1.4 s for
    ResNet-18's 11 shapes); traced values by `jnp.transpose`, which XLA cancels."""
    if isinstance(value, torch.Tensor):
        return value.detach().permute(perm)
    if (
        isinstance(value, jax.Array)
        and not isinstance(value, Tracer)
        and value.is_fully_addressable
        and len(value.devices()) == 1
        and next(iter(value.devices())).platform == "cpu"
    ):
        return jnp.asarray(np.ascontiguousarray(np.transpose(np.asarray(value), perm)))
    return jnp.transpose(value, perm) if isinstance(value, jax.Array) else np.transpose(value, perm)


__all__ = ["ConvLayout", "check_layout", "conv_kernels", "from_kernels", "kernel_permutation", "to_kernels"]
