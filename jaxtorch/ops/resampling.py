"""Resampling lowerings: upsampling (nearest, nearest-exact, linear, bilinear, bicubic,
trilinear, antialiased bilinear / bicubic), grid sampling in 2-d and 3-d (`F.interpolate`,
`F.upsample`, `F.grid_sample`), and fractional max pooling given its random samples.

Upsampling weights depend only on static shapes, so they are built with NumPy at trace time
(antialiased ones with torch's float32 arithmetic, so they match its CPU kernel) and applied
as one small matmul per spatial axis; nearest modes are one static `take` per axis. Grid
sampling and fractional max pooling gather from the flattened image. Backward ops, which
torch autograd calls on the `jax` device, are the VJP of the forward lowering (or, for
fractional max pooling, a scatter by the returned indices).

Example:
    ```python
    import jax.numpy as jnp, torch, jaxtorch
    x = jnp.arange(16.).reshape(1, 1, 4, 4)
    y = jaxtorch.call_torch(torch.nn.functional.interpolate, x, scale_factor=2, mode="bilinear")  # (1, 1, 8, 8)
    ```
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Any

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from ..bridge.core._dtypes import canonical_int
from ..bridge.core._registry import register
from .nn import _opmath, _scatter_by_index, _vjp

aten = torch.ops.aten


# ---- upsampling -------------------------------------------------------------------------------
def _src_scale(in_size, out_size, align_corners, scale):
    if align_corners:
        return (in_size - 1) / (out_size - 1) if out_size > 1 else 0.0
    return 1.0 / scale if scale is not None and scale > 0 else in_size / out_size


def _linear_matrix(in_size, out_size, align_corners, scale, cubic=False) -> np.ndarray:
    """The static (out, in) weights of linear / cubic interpolation along one axis."""
    s = _src_scale(in_size, out_size, align_corners, scale)
    dst = np.arange(out_size, dtype=np.float64)
    src = dst * s if align_corners else (dst + 0.5) * s - 0.5
    m = np.zeros((out_size, in_size), np.float64)
    rows = np.arange(out_size)
    if not cubic:
        src = np.maximum(src, 0.0)
        i0 = np.minimum(np.floor(src).astype(np.int64), in_size - 1)
        i1 = np.minimum(i0 + 1, in_size - 1)
        lam = src - i0
        np.add.at(m, (rows, i0), 1 - lam)
        np.add.at(m, (rows, i1), lam)
        return m
    a = -0.75
    i0 = np.floor(src).astype(np.int64)
    t = src - i0

    def c1(x):  # |x| <= 1
        return ((a + 2) * x - (a + 3)) * x * x + 1

    def c2(x):  # 1 < |x| < 2
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a

    coeffs = [c2(t + 1), c1(t), c1(1 - t), c2(2 - t)]
    for off, c in zip((-1, 0, 1, 2), coeffs):
        np.add.at(m, (rows, np.clip(i0 + off, 0, in_size - 1)), c)
    return m


def _resample_linear(x, output_size, align_corners, scales, cubic=False):
    n = len(output_size)
    lead = x.ndim - n
    xf = _opmath(x)
    for i, o in enumerate(output_size):
        ax = lead + i
        sc = scales[i] if scales else None
        if x.shape[ax] == o and (sc is None or sc == 1.0):
            continue
        m = jnp.asarray(_linear_matrix(x.shape[ax], int(o), align_corners, sc, cubic), xf.dtype)
        xf = jnp.moveaxis(jnp.tensordot(xf, m, axes=[[ax], [1]]), -1, ax)
    return xf.astype(x.dtype)


def _resample_nearest(x, output_size, scales, exact):
    n = len(output_size)
    lead = x.ndim - n
    for i, o in enumerate(output_size):
        ax = lead + i
        size = x.shape[ax]
        s = _src_scale(size, int(o), False, scales[i] if scales else None)
        dst = np.arange(int(o), dtype=np.float64)
        src = np.floor((dst + 0.5) * s) if exact else np.floor(dst * np.float32(s))
        idx = np.minimum(src.astype(np.int64), size - 1).astype(np.int32)
        if size != o or not np.array_equal(idx, np.arange(size)):
            x = jnp.take(x, jnp.asarray(idx), axis=ax)
    return x


def _scales(*s):
    return None if all(v is None for v in s) else list(s)


@register(aten.upsample_nearest1d.default)
def upsample_nearest1d(self, output_size, scales=None):
    return _resample_nearest(self, output_size, _scales(scales), False)


@register(aten.upsample_nearest2d.default)
def upsample_nearest2d(self, output_size, scales_h=None, scales_w=None):
    return _resample_nearest(self, output_size, _scales(scales_h, scales_w), False)


@register(aten.upsample_nearest3d.default)
def upsample_nearest3d(self, output_size, scales_d=None, scales_h=None, scales_w=None):
    return _resample_nearest(self, output_size, _scales(scales_d, scales_h, scales_w), False)


@register(aten._upsample_nearest_exact1d.default)
def _upsample_nearest_exact1d(self, output_size, scales=None):
    return _resample_nearest(self, output_size, _scales(scales), True)


@register(aten._upsample_nearest_exact2d.default)
def _upsample_nearest_exact2d(self, output_size, scales_h=None, scales_w=None):
    return _resample_nearest(self, output_size, _scales(scales_h, scales_w), True)


@register(aten._upsample_nearest_exact3d.default)
def _upsample_nearest_exact3d(self, output_size, scales_d=None, scales_h=None, scales_w=None):
    return _resample_nearest(self, output_size, _scales(scales_d, scales_h, scales_w), True)


@register(aten.upsample_linear1d.default)
def upsample_linear1d(self, output_size, align_corners, scales=None):
    return _resample_linear(self, output_size, align_corners, _scales(scales))


@register(aten.upsample_bilinear2d.default)
def upsample_bilinear2d(self, output_size, align_corners, scales_h=None, scales_w=None):
    return _resample_linear(self, output_size, align_corners, _scales(scales_h, scales_w))


@register(aten.upsample_trilinear3d.default)
def upsample_trilinear3d(self, output_size, align_corners, scales_d=None, scales_h=None, scales_w=None):
    return _resample_linear(self, output_size, align_corners, _scales(scales_d, scales_h, scales_w))


@register(aten.upsample_bicubic2d.default)
def upsample_bicubic2d(self, output_size, align_corners, scales_h=None, scales_w=None):
    return _resample_linear(self, output_size, align_corners, _scales(scales_h, scales_w), cubic=True)


def _aa_matrix(in_size: int, out_size: int, align_corners: bool, scale, cubic: bool) -> np.ndarray:
    """The static (out, in) weights of torch's antialiased bilinear / bicubic resize along one axis
    (`_compute_weights_aa` in ATen's UpSampleKernel.cpp, in its float32 arithmetic): a triangle
    (or a = -0.5 cubic) filter whose support widens by the downscale factor, each row normalized."""
    f32 = np.float32
    if align_corners:
        s = f32(in_size - 1) / f32(out_size - 1) if out_size > 1 else f32(0)
    else:
        s = f32(1.0 / scale) if scale is not None and scale > 0 else f32(in_size) / f32(out_size)
    support = f32(2.0 if cubic else 1.0) * (s if s >= 1 else f32(1))
    invscale = f32(1) / s if s >= 1 else f32(1)
    width = int(np.ceil(support)) * 2 + 1
    center = s * (np.arange(out_size, dtype=f32) + f32(0.5))
    xmin = np.maximum(((center - support).astype(np.float64) + 0.5).astype(np.int64), 0)
    xmax = np.minimum(((center + support).astype(np.float64) + 0.5).astype(np.int64), in_size)
    xsize = np.clip(xmax - xmin, 0, width)
    j = np.arange(width)
    src = xmin[:, None] + j
    x = np.abs(((src.astype(f32) - center[:, None]).astype(np.float64) + 0.5) * invscale).astype(f32)
    if cubic:
        a = f32(-0.5)
        w = np.where(
            x < 1, ((a + 2) * x - (a + 3)) * x * x + 1, np.where(x < 2, ((a * x - 5 * a) * x + 8 * a) * x - 4 * a, 0)
        )
    else:
        w = np.where(x < 1, 1 - x, 0)
    w = np.where(j < xsize[:, None], w, 0).astype(f32)
    total = np.cumsum(w, axis=1, dtype=f32)[:, -1:]  # summed left to right, like torch
    w = np.where(total != 0, w / np.where(total != 0, total, 1), w).astype(f32)
    m = np.zeros((out_size, in_size), f32)
    np.add.at(m, (np.repeat(np.arange(out_size), width), np.minimum(src, in_size - 1).ravel()), w.ravel())
    return m


def _resample_aa(x, output_size, align_corners, scales, cubic):
    """Antialiased resize of the last len(output_size) axes; an axis whose size does not change is
    left alone, as torch does."""
    lead = x.ndim - len(output_size)
    xf = _opmath(x)
    for i, o in enumerate(output_size):
        ax = lead + i
        if x.shape[ax] == o:
            continue
        m = jnp.asarray(_aa_matrix(x.shape[ax], int(o), align_corners, scales[i] if scales else None, cubic), xf.dtype)
        xf = jnp.moveaxis(jnp.tensordot(xf, m, axes=[[ax], [1]], precision=lax.Precision.HIGHEST), -1, ax)
    return xf.astype(x.dtype)


@register(aten._upsample_bilinear2d_aa.default)
def _upsample_bilinear2d_aa(self, output_size, align_corners, scales_h=None, scales_w=None):
    """`F.interpolate(mode="bilinear", antialias=True)`.

    Example:
        ```python
        y = jaxtorch.call_torch(F.interpolate, jnp.ones((1, 3, 10, 20)), size=(3, 5), mode="bilinear",
                                antialias=True)   # (1, 3, 3, 5)
        ```
    """
    return _resample_aa(self, output_size, align_corners, _scales(scales_h, scales_w), cubic=False)


@register(aten._upsample_bicubic2d_aa.default)
def _upsample_bicubic2d_aa(self, output_size, align_corners, scales_h=None, scales_w=None):
    """`F.interpolate(mode="bicubic", antialias=True)` (Keys cubic with a = -0.5, like PIL)."""
    return _resample_aa(self, output_size, align_corners, _scales(scales_h, scales_w), cubic=True)


def _upsample_backward(forward):
    def backward(grad_output, output_size, input_size, *args):
        x = jnp.zeros(tuple(input_size), grad_output.dtype)
        return _vjp(lambda a: forward(a, output_size, *args), (x,), grad_output)[0]

    return backward


for _name, _fwd in [
    ("upsample_nearest1d", upsample_nearest1d),
    ("upsample_nearest2d", upsample_nearest2d),
    ("upsample_nearest3d", upsample_nearest3d),
    ("_upsample_nearest_exact1d", _upsample_nearest_exact1d),
    ("_upsample_nearest_exact2d", _upsample_nearest_exact2d),
    ("_upsample_nearest_exact3d", _upsample_nearest_exact3d),
    ("upsample_linear1d", upsample_linear1d),
    ("upsample_bilinear2d", upsample_bilinear2d),
    ("upsample_trilinear3d", upsample_trilinear3d),
    ("upsample_bicubic2d", upsample_bicubic2d),
    ("_upsample_bilinear2d_aa", _upsample_bilinear2d_aa),
    ("_upsample_bicubic2d_aa", _upsample_bicubic2d_aa),
]:
    register(getattr(aten, _name + "_backward").default)(_upsample_backward(_fwd))


# ---- grid sampling ----------------------------------------------------------------------------
def _reflect(coord, twice_low, twice_high):
    if twice_low == twice_high:
        return jnp.zeros_like(coord)
    lo, span = twice_low / 2, (twice_high - twice_low) / 2
    c = jnp.abs(coord - lo)
    extra, flips = jnp.fmod(c, span), jnp.floor(c / span)
    return jnp.where(jnp.fmod(flips, 2) == 0, extra + lo, span - extra + lo)


def _pad_coord(coord, size, padding_mode, align_corners):
    if padding_mode == 1:  # border
        return jnp.clip(coord, 0, size - 1)
    if padding_mode == 2:  # reflection
        coord = _reflect(coord, 0, 2 * (size - 1)) if align_corners else _reflect(coord, -1, 2 * size - 1)
        return jnp.clip(coord, 0, size - 1)
    return coord


def _weighted_taps(input, coords, weights=None):
    """sum over k of `weights[:, k]` times `input` (N, C, *S) at the integer coordinates
    `coords[:, k]` (one (N, K, *G) array per spatial axis, in the order of S), a tap outside the
    image counting zero. All K taps are one gather from the flattened image."""
    N, C, *S = input.shape
    inside: Any = True  # (then a boolean array, and the flat index an int32 array)
    idx: Any = 0
    for c, size in zip(coords, S):
        inside = inside & (c >= 0) & (c <= size - 1)
        idx = idx * size + jnp.clip(c, 0, size - 1).astype(jnp.int32)
    idx = idx.reshape(N, 1, -1)
    vals = jnp.take_along_axis(input.reshape(N, C, -1), jnp.broadcast_to(idx, (N, C, idx.shape[-1])), axis=2)
    vals = vals.reshape((N, C) + coords[0].shape[1:])
    if weights is not None:
        vals = vals * weights[:, None]
    return jnp.sum(jnp.where(inside[:, None], vals, 0), axis=2)


def _source_coords(input, grid, padding_mode, align_corners, pad=True):
    """Grid (N, *G, n) in [-1, 1], x first -> pixel coordinates per spatial axis of `input`, in the
    order of its axes (D, H, W), padded unless `pad` is False."""
    sizes = input.shape[2:]
    n = len(sizes)
    coords = []
    for ax, size in enumerate(sizes):
        g = grid[..., n - 1 - ax]
        c = (g + 1) / 2 * (size - 1) if align_corners else ((g + 1) * size - 1) / 2
        coords.append(_pad_coord(c, size, padding_mode, align_corners) if pad else c)
    return coords


def _grid_sample(input, grid, interpolation_mode, padding_mode, align_corners):
    """Bilinear / trilinear (0) or nearest (1) sampling in any number of spatial dimensions:
    a weighted sum of the 2^n corner taps, or the tap at the rounded (half to even) coordinate."""
    coords = _source_coords(input, grid, padding_mode, align_corners)
    if interpolation_mode == 1:
        return _weighted_taps(input, [jnp.round(c)[:, None] for c in coords]).astype(input.dtype)
    lo = [jnp.floor(c) for c in coords]
    frac = [c - f for c, f in zip(coords, lo)]
    corners = list(itertools.product((0, 1), repeat=len(coords)))
    taps = [jnp.stack([f + corner[ax] for corner in corners], axis=1) for ax, f in enumerate(lo)]
    weights = jnp.stack(
        [functools.reduce(jnp.multiply, [t if b else 1 - t for t, b in zip(frac, corner)]) for corner in corners],
        axis=1,
    )
    return _weighted_taps(input, taps, weights).astype(input.dtype)


def _grid_sample_bicubic(input, grid, padding_mode, align_corners):
    """Bicubic (a = -0.75) sampling of a 4-d input; padding applies to each of the 16 taps."""
    iy, ix = _source_coords(input, grid, padding_mode, align_corners, pad=False)
    H, W = input.shape[2:]
    x0, y0 = jnp.floor(ix), jnp.floor(iy)
    a = -0.75

    def coeffs(t):
        c1 = lambda s: ((a + 2) * s - (a + 3)) * s * s + 1
        c2 = lambda s: ((a * s - 5 * a) * s + 8 * a) * s - 4 * a
        return [c2(t + 1), c1(t), c1(1 - t), c2(2 - t)]

    cx, cy = coeffs(ix - x0), coeffs(iy - y0)
    xs = [_pad_coord(x0 - 1 + i, W, padding_mode, align_corners) for i in range(4)]
    ys = [_pad_coord(y0 - 1 + j, H, padding_mode, align_corners) for j in range(4)]
    taps = [
        jnp.stack([ys[j] for j in range(4) for i in range(4)], axis=1),
        jnp.stack([xs[i] for j in range(4) for i in range(4)], axis=1),
    ]
    weights = jnp.stack([cy[j] * cx[i] for j in range(4) for i in range(4)], axis=1)
    return _weighted_taps(input, taps, weights).astype(input.dtype)


@register(aten.grid_sampler_2d.default)
def grid_sampler_2d(input, grid, interpolation_mode, padding_mode, align_corners):
    """`F.grid_sample` on 4-d inputs: bilinear (0), nearest (1) or bicubic (2) sampling with zeros (0),
    border (1) or reflection (2) padding.

    Example:
        ```python
        y = jaxtorch.call_torch(F.grid_sample, jnp.ones((1, 2, 4, 4)), jnp.zeros((1, 3, 3, 2)),
                                align_corners=False)   # (1, 2, 3, 3)
        ```
    """
    if interpolation_mode == 2:
        return _grid_sample_bicubic(input, grid, padding_mode, align_corners)
    return _grid_sample(input, grid, interpolation_mode, padding_mode, align_corners)


@register(aten.grid_sampler_3d.default)
def grid_sampler_3d(input, grid, interpolation_mode, padding_mode, align_corners):
    """`F.grid_sample` on 5-d inputs: trilinear (0) or nearest (1) sampling with zeros (0), border (1)
    or reflection (2) padding; `grid[..., 0]` indexes W, `[..., 1]` H and `[..., 2]` D."""
    return _grid_sample(input, grid, interpolation_mode, padding_mode, align_corners)


def _grid_sampler_backward(forward):
    def backward(grad_output, input, grid, interpolation_mode, padding_mode, align_corners, output_mask):
        gi, gg = _vjp(
            lambda x, g: forward(x, g, interpolation_mode, padding_mode, align_corners), (input, grid), grad_output
        )
        return (gi if output_mask[0] else None, gg)

    return backward


register(aten.grid_sampler_2d_backward.default)(_grid_sampler_backward(grid_sampler_2d))
register(aten.grid_sampler_3d_backward.default)(_grid_sampler_backward(grid_sampler_3d))


# ---- fractional max pooling -------------------------------------------------------------------
def _fractional_starts(sample, in_size: int, out_size: int, pool: int):
    """Window starts (..., out_size) for per-plane samples (...) in [0, 1), in torch's float32
    arithmetic (`generate_intervals` in ATen's FractionalMaxPool2d.cpp); the last window ends
    at the input's end."""
    last = jnp.full(sample.shape + (1,), in_size - pool, jnp.int32)
    if out_size == 1:
        return last
    alpha = np.float32(in_size - pool) / np.float32(out_size - 1)
    s = sample.astype(jnp.float32)[..., None]
    i = jnp.arange(out_size - 1, dtype=jnp.float32)
    starts = ((i + s) * alpha).astype(jnp.int32) - (s * alpha).astype(jnp.int32)
    return jnp.concatenate([starts, last], axis=-1)


def _fractional_max_pool(x, kernel_size, output_size, random_samples, sample_axes, slack=0):
    """(values, flat spatial indices) of the max over pseudo-random windows whose starts come from
    `random_samples` (N, C, n); `sample_axes[j]` is the spatial axis that sample j places. Like torch,
    refuses windows that reach past the input's end by more than `slack` (0 in 2-d, -1 in 3-d)."""
    n = len(kernel_size)
    batched = x.ndim == n + 2
    x = x if batched else x[None]
    N, C, *S = x.shape
    k, out = [int(v) for v in kernel_size], [int(v) for v in output_size]
    if any(o + kk - 1 > s + slack for o, kk, s in zip(out, k, S)):
        raise ValueError(f"fractional_max_pool: output_size {out} + kernel_size {k} - 1 is too large for input {S}")
    idx: Any = 0  # (then an array)
    for j, ax in enumerate(sample_axes):
        starts = _fractional_starts(random_samples[..., j], S[ax], out[ax], k[ax])  # (N, C, out[ax])
        pos = starts[..., None] + jnp.arange(k[ax])  # (N, C, out[ax], k[ax])
        shape = [N, C] + [1] * (2 * n)
        shape[2 + ax], shape[2 + n + ax] = out[ax], k[ax]
        stride = math.prod(S[ax + 1 :])
        idx = idx + (pos * stride).reshape(shape)
    idx = jnp.broadcast_to(idx, (N, C, *out, *k)).reshape(N, C, -1)
    vals = jnp.take_along_axis(x.reshape(N, C, -1), idx, axis=2).reshape(N, C, *out, -1)
    idx = idx.reshape(vals.shape)
    # torch keeps the first maximum, except that every NaN replaces the running maximum
    nan = jnp.isnan(vals)
    last_nan = vals.shape[-1] - 1 - jnp.argmax(nan[..., ::-1], axis=-1)
    sel = jnp.where(jnp.any(nan, axis=-1), last_nan, jnp.argmax(vals, axis=-1))[..., None]
    values = jnp.take_along_axis(vals, sel, axis=-1)[..., 0]
    indices = jnp.take_along_axis(idx, sel, axis=-1)[..., 0].astype(canonical_int())
    return (values, indices) if batched else (values[0], indices[0])


@register(aten.fractional_max_pool2d.default)
def fractional_max_pool2d(self, kernel_size, output_size, random_samples):
    """`F.fractional_max_pool2d` given its samples: (values, flat h * W + w indices). Sample 0 places
    the windows along W, sample 1 along H. Deterministic: `torch.rand`, which draws the samples
    inside `F.fractional_max_pool2d`, cannot reproduce torch's own stream."""
    return _fractional_max_pool(self, kernel_size, output_size, random_samples, (1, 0))


@register(aten.fractional_max_pool3d.default)
def fractional_max_pool3d(self, kernel_size, output_size, random_samples):
    """`F.fractional_max_pool3d` given its samples: samples 0, 1, 2 place the windows along T, H, W."""
    return _fractional_max_pool(self, kernel_size, output_size, random_samples, (0, 1, 2), slack=-1)


@register(aten.fractional_max_pool2d_backward.default)
def fractional_max_pool2d_backward(grad_output, self, kernel_size, output_size, indices):
    return _scatter_by_index(grad_output, self, indices, 2)


@register(aten.fractional_max_pool3d_backward.default)
def fractional_max_pool3d_backward(grad_output, self, kernel_size, output_size, indices):
    return _scatter_by_index(grad_output, self, indices, 3)
