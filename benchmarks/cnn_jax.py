"""The benchmark CNNs of `models.py` written by hand in JAX, in NHWC layout: the reference
(the XLA floor on this machine) for the convolution rows of `vision.py`.

`convert(model, train)` turns a `ResNet18` / `MobileNetV2` torch module into `(params, fn)`:
`params` a pytree of JAX arrays (convolution weights HWIO; in eval mode each BatchNorm folded
into the convolution before it as a per-channel scale and bias), `fn(params, x_nhwc)` the
network. In train mode BatchNorm uses batch statistics and `fn` returns
`(logits, new_batch_norm_stats)`, with torch's running-statistics update.

Example:
    ```python
    from models import cnn
    params, fn = convert(cnn("resnet18"), train=False)
    logits = jax.jit(fn)(params, jnp.zeros((8, 112, 112, 3)))   # (8, 1000)
    ```
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax
from models import MobileNetV2, ResNet18

_DN = ("NHWC", "HWIO", "NHWC")


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


def _conv_bn(conv: torch.nn.Conv2d, bn: torch.nn.BatchNorm2d, train: bool) -> dict:
    """One convolution and the BatchNorm after it: HWIO weight, folded (eval) or raw (train)."""
    w = _np(conv.weight).transpose(2, 3, 1, 0)  # OIHW -> HWIO
    invstd = 1.0 / np.sqrt(_np(bn.running_var) + bn.eps)
    if train:
        return {
            "w": jnp.asarray(w),
            "gamma": jnp.asarray(_np(bn.weight)),
            "beta": jnp.asarray(_np(bn.bias)),
            "mean": jnp.asarray(_np(bn.running_mean)),
            "var": jnp.asarray(_np(bn.running_var)),
        }
    scale = _np(bn.weight) * invstd
    return {"w": jnp.asarray(w * scale), "b": jnp.asarray(_np(bn.bias) - _np(bn.running_mean) * scale)}


def _apply_conv_bn(
    p: dict, x: jax.Array, stride: int, pad: int, groups: int, momentum: float, eps: float, stats: list
) -> jax.Array:
    y = lax.conv_general_dilated(
        x,
        p["w"],
        (stride, stride),
        [(pad, pad)] * 2,
        dimension_numbers=_DN,
        feature_group_count=groups,
        precision=lax.Precision.HIGHEST,
    )
    if "b" in p:  # eval: BatchNorm folded into the weights
        return y + p["b"]
    mean = jnp.mean(y, axis=(0, 1, 2))
    var = jnp.mean(jnp.square(y - mean), axis=(0, 1, 2))
    scale = p["gamma"] * lax.rsqrt(var + eps)
    n = y.size // y.shape[-1]
    stats.append(
        {
            "mean": (1 - momentum) * p["mean"] + momentum * mean,
            "var": (1 - momentum) * p["var"] + momentum * var * (n / (n - 1)),
        }
    )
    return y * scale + (p["beta"] - mean * scale)


def _linear(fc: torch.nn.Linear) -> dict:
    return {"w": jnp.asarray(_np(fc.weight).T), "b": jnp.asarray(_np(fc.bias))}


def _resnet18(model: ResNet18, train: bool) -> tuple[dict, Callable]:
    params = {"stem": _conv_bn(model.conv1, model.bn1, train), "fc": _linear(model.fc), "blocks": []}
    strides = []
    for blk in model.blocks:
        p = {"c1": _conv_bn(blk.conv1, blk.bn1, train), "c2": _conv_bn(blk.conv2, blk.bn2, train)}
        if blk.down is not None:
            p["down"] = _conv_bn(blk.down[0], blk.down[1], train)
        params["blocks"].append(p)
        strides.append(blk.conv1.stride[0])

    def fn(params, x):
        stats = []
        cb = lambda p, x, s, pad: _apply_conv_bn(p, x, s, pad, 1, 0.1, 1e-5, stats)
        x = jax.nn.relu(cb(params["stem"], x, 2, 3))
        x = lax.reduce_window(x, -jnp.inf, lax.max, (1, 3, 3, 1), (1, 2, 2, 1), [(0, 0), (1, 1), (1, 1), (0, 0)])
        for p, s in zip(params["blocks"], strides):
            y = jax.nn.relu(cb(p["c1"], x, s, 1))
            y = cb(p["c2"], y, 1, 1)
            x = jax.nn.relu(y + (cb(p["down"], x, s, 0) if "down" in p else x))
        logits = jnp.mean(x, axis=(1, 2)) @ params["fc"]["w"] + params["fc"]["b"]
        return (logits, stats) if train else logits

    return params, fn


def _mobilenet_v2(model: MobileNetV2, train: bool) -> tuple[dict, Callable]:
    # a flat list of layers: ("cbr", relu6) conv+bn(+relu6), ("block", residual) inverted residuals
    params, plan = [], []
    feats = list(model.features)
    layers = [(feats[0], feats[1], True)]
    for blk in feats[3:-3]:
        body = list(blk.body)
        convs = [
            (body[i], body[i + 1], i + 2 < len(body) and isinstance(body[i + 2], torch.nn.ReLU6))
            for i in range(len(body))
            if isinstance(body[i], torch.nn.Conv2d)
        ]
        layers.append((convs, blk.residual))
    layers.append((feats[-3], feats[-2], True))
    for layer in layers:
        if isinstance(layer[0], list):
            params.append([_conv_bn(c, b, train) for c, b, _ in layer[0]])
            plan.append(("block", [(c.stride[0], c.padding[0], c.groups, r) for c, _, r in layer[0]], layer[1]))
        else:
            c, b, r = layer
            params.append(_conv_bn(c, b, train))
            plan.append(("cbr", (c.stride[0], c.padding[0], c.groups, r), None))
    params = {"features": params, "fc": _linear(model.classifier)}

    def fn(params, x):
        stats = []

        def cbr(p, x, cfg):
            s, pad, g, relu6 = cfg
            y = _apply_conv_bn(p, x, s, pad, g, 0.1, 1e-5, stats)
            return jnp.clip(y, 0, 6) if relu6 else y

        for p, (kind, cfg, residual) in zip(params["features"], plan):
            if kind == "cbr":
                x = cbr(p, x, cfg)
            else:
                y = x
                for pp, c in zip(p, cfg):
                    y = cbr(pp, y, c)
                x = x + y if residual else y
        logits = jnp.mean(x, axis=(1, 2)) @ params["fc"]["w"] + params["fc"]["b"]
        return (logits, stats) if train else logits

    return params, fn


def convert(model: torch.nn.Module, train: bool = False) -> tuple[dict, Callable]:
    """`(params, fn)` of a `models.ResNet18` or `models.MobileNetV2`, written by hand in NHWC.

    **Arguments:**
    - `model`: the torch module (its weights and BatchNorm statistics are copied).
    - `train`: BatchNorm with batch statistics (else folded into the convolutions).

    **Returns:** `(params, fn)`; `fn(params, x_nhwc)` gives logits, or `(logits, stats)` in train
    mode (`stats`: each BatchNorm's updated running mean and variance, in network order).
    """
    if isinstance(model, ResNet18):
        return _resnet18(model, train)
    if isinstance(model, MobileNetV2):
        return _mobilenet_v2(model, train)
    raise TypeError(f"no hand-written JAX version of {type(model).__name__}")


def with_torch_layout(params: dict, fn: Callable) -> tuple[dict, Callable]:
    """The same network taking its convolution weights in torch's OIHW layout, transposed to HWIO
    inside the program (as any program must that gets torch-layout weights as arguments).

    **Arguments:** `params`, `fn` from `convert`.

    **Returns:** `(params_oihw, fn_oihw)`.
    """
    to_oihw = lambda a: a.transpose(3, 2, 0, 1) if a.ndim == 4 else a
    to_hwio = lambda a: a.transpose(2, 3, 1, 0) if a.ndim == 4 else a
    return jax.tree_util.tree_map(to_oihw, params), lambda p, x: fn(jax.tree_util.tree_map(to_hwio, p), x)
