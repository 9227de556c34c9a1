"""Neural-network lowerings: convolution, pooling, normalization, activations, embedding,
dropout (loss functions: `losses`; upsampling and grid sampling: `resampling`).

Each lowering takes the ATen op's arguments (tensors as JAX arrays) and returns JAX arrays.
They are written for XLA: convolutions are one `lax.conv_general_dilated` (depthwise ones a
fused sum of shifted slices, which XLA:CPU runs 10-40x faster), pooling is
`lax.reduce_window`, normalizations and softmax compute in float32 for half inputs (as torch
does) in forms that fuse, and resampling with static weights is a small matmul.

Backward ops (`convolution_backward`, `avg_pool2d_backward`, ...), which torch autograd calls
on the `jax` device, are the VJP of the forward lowering unless a closed form is shorter.

Example:
    ```python
    import jax.numpy as jnp, torch, jaxtorch
    x, w = jnp.ones((1, 2, 5, 5)), jnp.ones((3, 2, 3, 3))
    y = jaxtorch.call_torch(torch.nn.functional.conv2d, x, w, padding=1)   # (1, 3, 5, 5)
    ```
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from ..bridge.core._checks import ON as _CHECKS
from ..bridge.core._checks import check, check_index
from ..bridge.core._dtypes import canonical_int
from ..bridge.core._registry import keep_whole, kernel, register
from ._accumulate import accumulation_dtype, is_half, opmath, upcast
from ._accumulate import upcast as _opmath
from ._derivatives import torch_derivative
from ._semantics import binary, broadcast_to, category, result_type

aten = torch.ops.aten


# ---- helpers ----------------------------------------------------------------------------------
def _tup(v, n: int) -> tuple[int, ...]:
    """An int or list (possibly of length 1) -> an n-tuple of ints."""
    if isinstance(v, int):
        return (v,) * n
    v = tuple(int(a) for a in v)
    return v * n if len(v) == 1 else v


def _vjp(fn: Callable, primals: Sequence, cotangent) -> tuple:
    """Gradients of `fn` at `primals` for the output cotangent (backward ops as VJPs)."""
    _, pullback = jax.vjp(fn, *primals)
    return pullback(cotangent)


def _bcast_channel(v: jax.Array, ndim: int) -> jax.Array:
    """A per-channel vector shaped (C,) -> (1, C, 1, ...) for an ndim-d NC... input."""
    return v.reshape((1, -1) + (1,) * (ndim - 2))


def _spatial_spec(n: int) -> str:
    return "DHW"[-n:] if n <= 3 else "".join(chr(ord("a") + i) for i in range(n))


# ---- convolution ------------------------------------------------------------------------------
def _conv(x, w, stride, padding, dilation, transposed, output_padding, groups):
    """The convolution, accumulated (and returned) in float32 for half operands."""
    n = w.ndim - 2
    stride, padding, dilation = _tup(stride, n), _tup(padding, n), _tup(dilation, n)
    sp = _spatial_spec(n)
    if not transposed and groups > 1 and groups == x.shape[1] and math.prod(w.shape[2:]) <= _DEPTHWISE_MAX_TAPS:
        return _depthwise(x, w, stride, padding, dilation)
    if not transposed:
        dn = lax.conv_dimension_numbers(x.shape, w.shape, ("NC" + sp, "OI" + sp, "NC" + sp))
        return lax.conv_general_dilated(
            x,
            w,
            stride,
            [(p, p) for p in padding],
            rhs_dilation=dilation,
            dimension_numbers=dn,
            feature_group_count=groups,
            preferred_element_type=accumulation_dtype(x.dtype),
        )
    output_padding = _tup(output_padding, n) if output_padding else (0,) * n
    k = w.shape[2:]
    if groups == 1:
        rhs, spec = w, "IO" + sp  # torch's (C_in, C_out, k...) layout, read in place
    else:
        cin, cout_g = w.shape[0], w.shape[1]
        rhs = w.reshape((groups, cin // groups, cout_g) + k)
        rhs = jnp.swapaxes(rhs, 1, 2).reshape((groups * cout_g, cin // groups) + k)
        spec = "OI" + sp
    rhs = lax.rev(rhs, tuple(range(2, 2 + n)))
    pads = [(d * (kk - 1) - p, d * (kk - 1) - p + op) for kk, p, d, op in zip(k, padding, dilation, output_padding)]
    dn = lax.conv_dimension_numbers(x.shape, rhs.shape, ("NC" + sp, spec, "NC" + sp))
    return lax.conv_general_dilated(
        x,
        rhs,
        (1,) * n,
        pads,
        lhs_dilation=stride,
        rhs_dilation=dilation,
        dimension_numbers=dn,
        feature_group_count=groups,
        preferred_element_type=accumulation_dtype(x.dtype),
    )


_DEPTHWISE_MAX_TAPS = 64  # kernels up to 8x8 (ConvNeXt's 7x7 included)


def _depthwise(x, w, stride, padding, dilation):
    """A depthwise convolution (one group per input channel, `w` shaped (C * m, 1, k...)) as a sum
    over the kernel's taps of strided slices of the padded input times a per-channel weight.

    XLA fuses the sum into one loop; XLA:CPU runs the same `feature_group_count` convolution
    10-40x slower (a grouped convolution kernel with one channel per group). Half inputs
    accumulate in float32, and the result stays float32 (as `_conv`'s). The result differs
    from a convolution by float32 round-off (the order of the sum), and its gradients are the exact VJP of the same sum.
    """
    n = w.ndim - 2
    batch, c_in = x.shape[:2]
    c_out, k = w.shape[0], w.shape[2:]
    xf, wf = _opmath(x), _opmath(w)
    # channels last before the padding, as XLA:CPU lays out the convolutions around it: the pad
    # is then written channels-last too, fused into the producer's epilogue (no relayout)
    perm = (0,) + tuple(range(2, n + 2)) + (1,)
    pads = [(0, 0, 0)] + [(p, p, 0) for p in padding] + [(0, 0, 0)]
    xp = lax.pad(jnp.transpose(xf, perm), jnp.zeros((), xf.dtype), pads)
    if c_out != c_in:  # channel multiplier m: output channel o reads input channel o // m
        xp = lax.broadcast_in_dim(xp, xp.shape + (c_out // c_in,), tuple(range(n + 2)))
        xp = xp.reshape(xp.shape[:-2] + (c_out,))
    size = [(xp.shape[1 + i] - dilation[i] * (k[i] - 1) - 1) // stride[i] + 1 for i in range(n)]
    out = None
    for tap in itertools.product(*(range(kk) for kk in k)):
        start = [t * d for t, d in zip(tap, dilation)]
        limit = [b + s * (o - 1) + 1 for b, s, o in zip(start, stride, size)]
        piece = lax.slice(xp, (0, *start, 0), (batch, *limit, c_out), (1, *stride, 1))
        term = piece * wf[(slice(None), 0) + tap]
        out = term if out is None else out + term
    assert out is not None  # (a kernel has at least one tap)
    return jnp.transpose(out, tuple(np.argsort(perm)))


def _transposed_half(x, w, bias, stride, padding, dilation, output_padding, groups):
    """A float16/bfloat16 transposed convolution computed as CPU torch's `slow_conv_transpose{2,3}d`
    computes it, so the result is torch's to the bit: its GEMM gives the columns
    `x[ci] * w[ci, co, tap]` summed over input channels in float32 and rounded to the half dtype;
    `col2im` then adds each kernel tap's columns into the output in the half dtype (one rounding per
    add, taps in row-major order); the bias is added last, one half-precision add.

    Example: `_transposed_half(x16, w16, None, (2, 2), (1, 1), (1, 1), (0, 0), 1)`."""
    n = w.ndim - 2
    stride, padding, dilation = _tup(stride, n), _tup(padding, n), _tup(dilation, n)
    output_padding = _tup(output_padding, n) if output_padding else (0,) * n
    half = jnp.result_type(x.dtype, w.dtype)
    batch, cin, size, k = x.shape[0], x.shape[1], x.shape[2:], w.shape[2:]
    cout_g = w.shape[1]
    xg = upcast(x).reshape((batch, groups, cin // groups) + size)
    wg = upcast(w).reshape((groups, cin // groups, cout_g) + k)
    sp = "".join(chr(ord("p") + i) for i in range(n))
    kk = "".join(chr(ord("h") + i) for i in range(n))
    cols = jnp.einsum(f"bgc{sp},gco{kk}->bgo{kk}{sp}", xg, wg, precision=lax.Precision.HIGHEST)
    cols = cols.reshape((batch, groups * cout_g) + k + size).astype(half)  # the GEMM's half columns
    out_size = [
        (s - 1) * st - 2 * p + d * (kn - 1) + op + 1
        for s, st, p, d, kn, op in zip(size, stride, padding, dilation, k, output_padding)
    ]
    out = jnp.zeros((batch, groups * cout_g, *out_size), half)
    zero = jnp.zeros((), half)
    for tap in itertools.product(*(range(kn) for kn in k)):
        piece = cols[(slice(None), slice(None)) + tap]
        pads = [(0, 0, 0), (0, 0, 0)]
        for s, st, p, d, t, o in zip(size, stride, padding, dilation, tap, out_size):
            low = t * d - p
            pads.append((low, o - low - ((s - 1) * st + 1), st - 1))
        out = (out.astype(jnp.float32) + lax.pad(piece, zero, pads).astype(jnp.float32)).astype(half)
    if bias is not None:
        out = (out.astype(jnp.float32) + _bcast_channel(bias, out.ndim).astype(jnp.float32)).astype(half)
    return out


def _onednn_takes_half(dtype) -> bool:
    """Whether CPU torch runs a `dtype` (float16/bfloat16) convolution through oneDNN on this processor:
    torch's own guard (`mkldnn_bf16_device_check` / `mkldnn_fp16_device_check`: AVX-512 or AMX for
    bfloat16, AVX-512-FP16 or AMX-FP16 for float16) and `torch.backends.mkldnn.enabled`. oneDNN
    accumulates a transposed convolution in float32, bias included, and rounds once; torch's own
    `slow_conv_transpose` (every other processor) rounds per kernel tap (`_transposed_half`).

    Example: `_onednn_takes_half(jnp.bfloat16)` is True on an AVX-512 Xeon, False on an AVX2 machine."""
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return False
    check = "_is_mkldnn_bf16_supported" if dtype == jnp.bfloat16 else "_is_mkldnn_fp16_supported"
    return bool(getattr(torch.ops.mkldnn, check)())


@register(aten.convolution.default)
def convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    """`F.conv{1,2,3}d` / `conv_transpose{1,2,3}d`: one `lax.conv_general_dilated`; half
    inputs accumulate in float32, bias included, and round once (torch's CPU kernel). A half
    transposed convolution rounds as torch's CPU kernel on this processor does: oneDNN's (round
    once) where torch uses oneDNN, else `slow_conv_transpose`'s (`_transposed_half`)."""
    half = jnp.result_type(input.dtype, weight.dtype)
    if transposed and is_half(half) and not _onednn_takes_half(half):
        return _transposed_half(input, weight, bias, stride, padding, dilation, output_padding, groups)
    out = _conv(input, weight, stride, padding, dilation, transposed, output_padding, groups)
    if bias is not None:
        out = out + _bcast_channel(bias, out.ndim).astype(out.dtype)
    return out.astype(jnp.result_type(input.dtype, weight.dtype))


@register(aten._convolution.default)
def _convolution(
    input,
    weight,
    bias,
    stride,
    padding,
    dilation,
    transposed,
    output_padding,
    groups,
    benchmark=False,
    deterministic=False,
    cudnn_enabled=True,
    allow_tf32=True,
):
    return convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)


@register(aten.convolution_backward.default)
def convolution_backward(
    grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups, output_mask
):
    """Gradients of `convolution` for input, weight and bias (None where `output_mask` is False)."""
    dtype = jnp.result_type(input.dtype, weight.dtype)
    fn = lambda x, w: _conv(x, w, stride, padding, dilation, transposed, output_padding, groups).astype(dtype)
    gx, gw = _vjp(fn, (input, weight), grad_output)
    gb = None
    if output_mask[2]:
        gb = jnp.sum(grad_output, axis=(0,) + tuple(range(2, grad_output.ndim)))
    return (gx if output_mask[0] else None, gw if output_mask[1] else None, gb)


# ---- pooling ----------------------------------------------------------------------------------
def _pool_out(size, k, s, p, d, ceil_mode) -> tuple[int, int]:
    """torch's pooling output length and the high-side padding it implies (may be negative)."""
    out = (size + 2 * p - d * (k - 1) - 1 + (s - 1 if ceil_mode else 0)) // s + 1
    if ceil_mode and (out - 1) * s >= size + p:
        out -= 1
    hi = (out - 1) * s + d * (k - 1) + 1 - size - p
    return out, hi


def _pool_setup(x, n, kernel_size, stride, padding, dilation, ceil_mode):
    k = _tup(kernel_size, n)
    s = _tup(stride, n) if stride else k
    p, d = _tup(padding, n), _tup(dilation, n)
    lead = x.ndim - n
    geo = [_pool_out(x.shape[lead + i], k[i], s[i], p[i], d[i], ceil_mode) for i in range(n)]
    pads = [(0, 0, 0)] * lead + [(p[i], geo[i][1], 0) for i in range(n)]
    return k, s, d, lead, pads


def _max_pool(x, n, kernel_size, stride, padding, dilation, ceil_mode, with_indices):
    k, s, d, lead, pads = _pool_setup(x, n, kernel_size, stride, padding, dilation, ceil_mode)
    low = -np.inf if category(x.dtype) >= 2 else int(jnp.iinfo(x.dtype).min)
    window, strides, wdil = (1,) * lead + k, (1,) * lead + s, (1,) * lead + d
    dilated = any(dd != 1 for dd in d)
    if not with_indices and not dilated:  # reduce_window_max: fast, and differentiable by JAX
        return lax.reduce_window(lax.pad(x, jnp.array(low, x.dtype), pads), low, lax.max, window, strides, "VALID")
    ind = _max_pool_indices(x, lead, pads, window, strides, wdil, low)
    if dilated:  # JAX cannot differentiate dilated reduce_window_max: gather the winners instead
        values = jnp.take_along_axis(
            x.reshape(x.shape[:lead] + (-1,)), ind.reshape(ind.shape[:lead] + (-1,)), axis=-1
        ).reshape(ind.shape)
    else:
        values = lax.reduce_window(lax.pad(x, jnp.array(low, x.dtype), pads), low, lax.max, window, strides, "VALID")
    return (values, ind.astype(canonical_int())) if with_indices else values


def _max_pool_indices(x, lead, pads, window, strides, wdil, low):
    """Flat spatial index of each window's max, torch's scan: the first max wins, and a NaN beats
    everything before it (so the last NaN wins)."""
    spatial = x.shape[lead:]
    big = jnp.iinfo(jnp.int32).max
    idx = jnp.broadcast_to(jnp.arange(math.prod(spatial), dtype=jnp.int32).reshape(spatial), x.shape)
    xs = lax.stop_gradient(x)

    def pick(a, b):
        (av, ai), (bv, bi) = a, b
        a_nan, b_nan = av != av, bv != bv
        take_b = jnp.where(a_nan | b_nan, b_nan & (~a_nan | (bi > ai)), (bv > av) | ((bv == av) & (bi < ai)))
        return jnp.where(take_b, bv, av), jnp.where(take_b, bi, ai)

    lowv = jnp.array(low, x.dtype)
    _, ind = lax.reduce_window(
        (lax.pad(xs, lowv, pads), lax.pad(idx, jnp.int32(big), pads)),
        (lowv, jnp.array(big, jnp.int32)),
        pick,
        window,
        strides,
        "VALID",
        window_dilation=wdil,
    )
    return ind


def _picked_by_index(n: int):
    """The derivative of a max-pool with indices, torch's: each output's tangent is the input's
    tangent at the flat spatial index it returned (ties go to torch's index, not split)."""

    def rule(t, out, self, *args, **kwargs):
        ind = out[1]
        lead = self.ndim - n
        flat = t.reshape(t.shape[:lead] + (-1,))
        picked = jnp.take_along_axis(flat, ind.reshape(ind.shape[:lead] + (-1,)).astype(jnp.int32), axis=-1)
        return picked.reshape(ind.shape), None

    return rule


@register(aten.max_pool2d_with_indices.default)
@torch_derivative(_picked_by_index(2))
def max_pool2d_with_indices(self, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    return _max_pool(self, 2, kernel_size, stride, padding, dilation, ceil_mode, True)


@register(aten.max_pool3d_with_indices.default)
@torch_derivative(_picked_by_index(3))
def max_pool3d_with_indices(self, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    return _max_pool(self, 3, kernel_size, stride, padding, dilation, ceil_mode, True)


@register(aten.max_pool1d_with_indices.default)
@torch_derivative(_picked_by_index(1))
def max_pool1d_with_indices(self, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    return _max_pool(self, 1, kernel_size, stride, padding, dilation, ceil_mode, True)


@register(aten.max_pool1d.default)
def max_pool1d(self, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    return _max_pool(self, 1, kernel_size, stride, padding, dilation, ceil_mode, False)


@register(aten.max_pool2d.default)
def max_pool2d(self, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    return _max_pool(self, 2, kernel_size, stride, padding, dilation, ceil_mode, False)


@register(aten.max_pool3d.default)
def max_pool3d(self, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    return _max_pool(self, 3, kernel_size, stride, padding, dilation, ceil_mode, False)


def _scatter_by_index(grad_output, self, indices, n):
    """Add each output gradient into the input position its flat spatial index names."""
    lead = self.shape[: self.ndim - n]
    rows = math.prod(lead)
    g = grad_output.reshape(rows, -1)
    ind = indices.reshape(rows, -1)
    out = jnp.zeros((rows, math.prod(self.shape[self.ndim - n :])), grad_output.dtype)
    out = out.at[jnp.arange(rows)[:, None], ind].add(g)
    return out.reshape(self.shape)


@register(aten.max_pool2d_with_indices_backward.default)
def max_pool2d_with_indices_backward(grad_output, self, kernel_size, stride, padding, dilation, ceil_mode, indices):
    return _scatter_by_index(grad_output, self, indices, 2)


@register(aten.max_pool3d_with_indices_backward.default)
def max_pool3d_with_indices_backward(grad_output, self, kernel_size, stride, padding, dilation, ceil_mode, indices):
    return _scatter_by_index(grad_output, self, indices, 3)


@register(aten.adaptive_max_pool2d_backward.default)
def adaptive_max_pool2d_backward(grad_output, self, indices):
    return _scatter_by_index(grad_output, self, indices, 2)


@register(aten.adaptive_max_pool3d_backward.default)
def adaptive_max_pool3d_backward(grad_output, self, indices):
    return _scatter_by_index(grad_output, self, indices, 3)


def _avg_pool(x, n, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    k, s, _, lead, pads = _pool_setup(x, n, kernel_size, stride, padding, 1, ceil_mode)
    window, strides = (1,) * lead + k, (1,) * lead + s
    xf = _opmath(x)
    zero = 0.0 if category(xf.dtype) >= 2 else 0  # a Python scalar, so JAX sees reduce_window_sum
    total = lax.reduce_window(lax.pad(xf, jnp.array(zero, xf.dtype), pads), zero, lax.add, window, strides, "VALID")
    if divisor_override:
        out = total / divisor_override
    else:
        # How many elements each window averages over: a static, data-independent count.
        spatial = x.shape[lead:]
        p = _tup(padding, n)
        ones = jnp.ones(spatial, jnp.float32)
        if count_include_pad:  # the padded input counts; the ceil_mode overhang does not
            ones = lax.pad(ones, 1.0, [(pp, pp, 0) for pp in p])
            ones = lax.pad(ones, 0.0, [(0, pd[1] - pp, 0) for pd, pp in zip(pads[lead:], p)])
        else:
            ones = lax.pad(ones, 0.0, pads[lead:])
        count = lax.reduce_window(ones, 0.0, lax.add, k, s, "VALID")  # constant-folded by XLA
        out = total / jnp.maximum(count, 1).astype(xf.dtype)
    if category(x.dtype) < 2:
        return jnp.trunc(out).astype(x.dtype)
    return out.astype(x.dtype)


@register(aten.avg_pool2d.default)
def avg_pool2d(self, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True, divisor_override=None):
    return _avg_pool(self, 2, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)


@register(aten.avg_pool3d.default)
def avg_pool3d(self, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True, divisor_override=None):
    return _avg_pool(self, 3, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)


@register(aten.avg_pool1d.default)
def avg_pool1d(self, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True):
    return _avg_pool(self, 1, kernel_size, stride, padding, ceil_mode, count_include_pad, None)


@register(aten.avg_pool2d_backward.default)
def avg_pool2d_backward(
    grad_output, self, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override
):
    f = lambda x: _avg_pool(
        x,
        2,
        kernel_size,
        stride,
        padding,
        ceil_mode,
        count_include_pad,
        divisor_override,
    )
    return _vjp(f, (self,), grad_output)[0]


@register(aten.avg_pool3d_backward.default)
def avg_pool3d_backward(
    grad_output, self, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override
):
    f = lambda x: _avg_pool(
        x,
        3,
        kernel_size,
        stride,
        padding,
        ceil_mode,
        count_include_pad,
        divisor_override,
    )
    return _vjp(f, (self,), grad_output)[0]


def _adaptive_bounds(size: int, out: int) -> list[tuple[int, int]]:
    return [((i * size) // out, -(-((i + 1) * size) // out)) for i in range(out)]


def _adaptive_avg(x, output_size, n):
    lead = x.ndim - n
    out_size = [x.shape[lead + i] if o is None else int(o) for i, o in enumerate(_tup(output_size, n))]
    xf = _opmath(x)
    for i, o in enumerate(out_size):
        ax = lead + i
        size = xf.shape[ax]
        if size % o == 0:  # equal windows: a reshape and a mean, which XLA fuses
            xf = jnp.mean(xf.reshape(xf.shape[:ax] + (o, size // o) + xf.shape[ax + 1 :]), axis=ax + 1)
        else:  # overlapping windows: a static averaging matrix
            m = np.zeros((o, size), np.float32)
            for j, (s, e) in enumerate(_adaptive_bounds(size, o)):
                m[j, s:e] = 1.0 / (e - s)
            xf = jnp.moveaxis(jnp.tensordot(xf, jnp.asarray(m, xf.dtype), axes=[[ax], [1]]), -1, ax)
    return xf.astype(x.dtype)


@register(aten._adaptive_avg_pool2d.default, aten.adaptive_avg_pool2d.default)
def adaptive_avg_pool2d(self, output_size):
    return _adaptive_avg(self, output_size, 2)


@register(aten._adaptive_avg_pool3d.default, aten.adaptive_avg_pool3d.default)
def adaptive_avg_pool3d(self, output_size):
    return _adaptive_avg(self, output_size, 3)


@register(aten.adaptive_avg_pool1d.default)
def adaptive_avg_pool1d(self, output_size):
    return _adaptive_avg(self, output_size, 1)


@register(aten._adaptive_avg_pool2d_backward.default)
def _adaptive_avg_pool2d_backward(grad_output, self):
    return _vjp(lambda x: _adaptive_avg(x, grad_output.shape[-2:], 2), (self,), grad_output)[0]


@register(aten._adaptive_avg_pool3d_backward.default)
def _adaptive_avg_pool3d_backward(grad_output, self):
    return _vjp(lambda x: _adaptive_avg(x, grad_output.shape[-3:], 3), (self,), grad_output)[0]


def _adaptive_max(x, output_size, n):
    lead = x.ndim - n
    out_size = _tup(output_size, n)
    spatial = x.shape[lead:]
    flat_index = jnp.zeros((), jnp.int32)
    for i, o in enumerate(out_size):
        size = spatial[i]
        bounds = _adaptive_bounds(size, o)
        kmax = max(e - s for s, e in bounds)
        idx = np.array([[min(s + j, e - 1) for j in range(kmax)] for s, e in bounds], np.int32)  # (o, kmax)
        ax = lead + 2 * i
        x = jnp.take(x, jnp.asarray(idx.reshape(-1)), axis=ax).reshape(x.shape[:ax] + (o, kmax) + x.shape[ax + 1 :])
        flat_index = flat_index[..., None, None] * size + jnp.asarray(idx) if i else jnp.asarray(idx)
    # x: lead + (o1, k1, o2, k2, ...) -> lead + (o1, o2, ..., k1*k2*...)
    perm = tuple(range(lead)) + tuple(lead + 2 * i for i in range(n)) + tuple(lead + 2 * i + 1 for i in range(n))
    x = jnp.transpose(x, perm).reshape(x.shape[:lead] + tuple(out_size) + (-1,))
    fperm = tuple(2 * i for i in range(n)) + tuple(2 * i + 1 for i in range(n))
    flat_index = jnp.transpose(flat_index, fperm).reshape(tuple(out_size) + (-1,))
    values = jnp.max(x, axis=-1)
    arg = jnp.argmax(lax.stop_gradient(x), axis=-1)
    nan_arg = (
        x.shape[-1] - 1 - jnp.argmax(jnp.isnan(lax.stop_gradient(x))[..., ::-1], axis=-1)  # last NaN
        if category(x.dtype) >= 2
        else arg
    )
    has_nan = jnp.any(jnp.isnan(lax.stop_gradient(x)), axis=-1) if category(x.dtype) >= 2 else False
    arg = jnp.where(has_nan, nan_arg, arg)
    fi = jnp.broadcast_to(flat_index, x.shape[:lead] + flat_index.shape)
    indices = jnp.take_along_axis(fi, arg[..., None], axis=-1)[..., 0]
    return values, indices.astype(canonical_int())


@register(aten.adaptive_max_pool2d.default)
@torch_derivative(_picked_by_index(2))
def adaptive_max_pool2d(self, output_size):
    return _adaptive_max(self, output_size, 2)


@register(aten.adaptive_max_pool3d.default)
@torch_derivative(_picked_by_index(3))
def adaptive_max_pool3d(self, output_size):
    return _adaptive_max(self, output_size, 3)


@register(aten.adaptive_max_pool1d.default)
@torch_derivative(_picked_by_index(1))
def adaptive_max_pool1d(self, output_size):
    return _adaptive_max(self, output_size, 1)


# ---- normalization ----------------------------------------------------------------------------
def _one_dim(t, what: str = "TensorAccessor") -> None:
    """torch's CPU kernels read running statistics (and, backward, the weight) as 1-dim tensors."""
    if t is not None and t.ndim != 1:
        raise RuntimeError(f"{what} expected 1 dims but tensor has {t.ndim}")


def _per_channel(t, channels: int, name: str):
    """A batch_norm weight or bias: torch accepts any shape holding one element per channel
    (`(C,)`, `(1, C, 1, 1)`, ...) and reads it flat."""
    if t is None:
        return None
    if t.size != channels:
        raise RuntimeError(f"{name} should contain {channels} elements not {t.size}")
    return t.reshape(channels)


def _batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps):
    """(out, save_mean, save_invstd, new_running_mean, new_running_var), torch's formulas."""
    _one_dim(running_mean)
    _one_dim(running_var)
    weight = _per_channel(weight, input.shape[1], "weight")
    bias = _per_channel(bias, input.shape[1], "bias")
    axes = (0,) + tuple(range(2, input.ndim))
    x = _opmath(input)
    if training:
        mean = jnp.mean(x, axis=axes)
        var = jnp.mean(jnp.square(x - _bcast_channel(mean, x.ndim)), axis=axes)
        invstd = lax.rsqrt(var + eps)
        new_rm, new_rv = running_mean, running_var
        if running_mean is not None:
            new_rm = ((1 - momentum) * running_mean + momentum * mean).astype(running_mean.dtype)
        if running_var is not None:
            count = x.size // x.shape[1]
            unbiased = var * (count / max(count - 1, 1))
            new_rv = ((1 - momentum) * running_var + momentum * unbiased).astype(running_var.dtype)
        save_mean, save_invstd = mean, invstd
    else:
        mean, invstd = running_mean.astype(x.dtype), lax.rsqrt(running_var.astype(x.dtype) + eps)
        new_rm, new_rv = running_mean, running_var
        save_mean = save_invstd = jnp.zeros((0,), x.dtype)
    scale = invstd if weight is None else invstd * weight.astype(x.dtype)
    shift = -mean * scale if bias is None else bias.astype(x.dtype) - mean * scale
    out = x * _bcast_channel(scale, x.ndim) + _bcast_channel(shift, x.ndim)
    return out.astype(input.dtype), save_mean, save_invstd, new_rm, new_rv


# `native_batch_norm` (what `nn.BatchNorm*d` emits) updates running_mean/var in place although its
# schema does not mark them mutable, and `_native_batch_norm_legit` returns fresh tensors besides the
# statistics it writes, so neither fits a pure lowering. On the `jax` device both run, at the autograd
# level, as ops that do: the functional variants lowered below, then `copy_` of the new statistics.
# (torch's own decomposition would return (C,)-shaped save_mean/invstd in eval mode off the CPU.)
def _batch_norm_autograd(input, weight, bias, running_mean, running_var, training, momentum, eps):
    """`native_batch_norm` / `_native_batch_norm_legit` on the `jax` device, recorded by torch autograd
    through ops with derivative formulas; returns (out, save_mean, save_invstd) shaped as on CPU."""
    if running_mean is None and running_var is None:
        return aten._native_batch_norm_legit.no_stats(input, weight, bias, training, momentum, eps)
    if not training:
        return aten._native_batch_norm_legit_no_training(input, weight, bias, running_mean, running_var, momentum, eps)
    # autograd saves the statistics it is given: hand it copies, the originals are written below
    out, mean, invstd, new_mean, new_var = aten._native_batch_norm_legit_functional(
        input, weight, bias, running_mean.clone(), running_var.clone(), True, momentum, eps
    )
    with torch.no_grad():
        running_mean.copy_(new_mean)
        running_var.copy_(new_var)
    return out, mean, invstd


kernel("native_batch_norm", _batch_norm_autograd, "AutogradPrivateUse1")
kernel("_native_batch_norm_legit", _batch_norm_autograd, "AutogradPrivateUse1")


@register(aten._native_batch_norm_legit.no_stats)
def _native_batch_norm_legit_no_stats(input, weight, bias, training, momentum, eps):
    if not training:
        raise RuntimeError("batch_norm in eval mode needs running_mean and running_var")
    return _batch_norm(input, weight, bias, None, None, True, momentum, eps)[:3]


@register(aten._native_batch_norm_legit_functional.default)
def _native_batch_norm_legit_functional(input, weight, bias, running_mean, running_var, training, momentum, eps):
    return _batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps)


@register(aten._native_batch_norm_legit_no_training.default)
def _native_batch_norm_legit_no_training(input, weight, bias, running_mean, running_var, momentum, eps):
    return _batch_norm(input, weight, bias, running_mean, running_var, False, momentum, eps)[:3]


@register(aten._batch_norm_with_update_functional.default)
def _batch_norm_with_update_functional(input, weight, bias, running_mean, running_var, momentum, eps):
    out, mean, invstd, rm, rv = _batch_norm(input, weight, bias, running_mean, running_var, True, momentum, eps)
    return out, mean, invstd, jnp.zeros((0,), jnp.uint8), rm, rv


@register(aten._batch_norm_no_update.default)
def _batch_norm_no_update(input, weight, bias, running_mean, running_var, momentum, eps):
    training = running_mean is None
    out, mean, invstd, _, _ = _batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps)
    return out, mean, invstd, jnp.zeros((0,), jnp.uint8)


def _batch_norm_grads(
    grad_out, input, weight, running_mean, running_var, save_mean, save_invstd, train, eps, output_mask
):
    def fwd(x, w):
        if train:
            return _batch_norm(x, w, None, None, None, True, 0.0, eps)[0]
        return _batch_norm(x, w, None, running_mean, running_var, False, 0.0, eps)[0]

    _one_dim(weight)  # torch's backward refuses the (1, C, 1, 1) weight its forward accepts
    w = weight if weight is not None else jnp.ones((input.shape[1],), input.dtype)
    gx, gw = _vjp(fwd, (input, w), grad_out)
    gb = jnp.sum(_opmath(grad_out), axis=(0,) + tuple(range(2, grad_out.ndim))).astype(input.dtype)
    return (
        gx if output_mask[0] else None,
        gw if output_mask[1] and weight is not None else None,
        gb if output_mask[2] else None,
    )


@register(aten.native_batch_norm_backward.default)
def native_batch_norm_backward(
    grad_out, input, weight, running_mean, running_var, save_mean, save_invstd, train, eps, output_mask
):
    return _batch_norm_grads(
        grad_out, input, weight, running_mean, running_var, save_mean, save_invstd, train, eps, output_mask
    )


@register(aten.batch_norm_backward.default)
def batch_norm_backward(
    grad_out, input, weight, running_mean, running_var, save_mean, save_var, update, eps, output_mask, reserve
):
    return _batch_norm_grads(
        grad_out, input, weight, running_mean, running_var, save_mean, save_var, update, eps, output_mask
    )


def _layer_norm(input, normalized_shape, weight, bias, eps):
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and tuple(t.shape) != tuple(normalized_shape):
            raise RuntimeError(
                f"Expected {name} to be of same shape as normalized_shape, but got {name} of shape "
                f"{list(t.shape)} and normalized_shape = {list(normalized_shape)}"
            )
    axis = input.ndim - len(normalized_shape)
    axes = tuple(range(axis, input.ndim))
    x = _opmath(input)
    # lax primitives with explicit broadcasts (jnp's jitted functions are dearer to trace)
    n = np.asarray(math.prod(x.shape[a] for a in axes), x.dtype)
    mean = lax.expand_dims(lax.div(lax.reduce_sum(x, axes), broadcast_to(n, x.shape[:axis])), axes)
    xc = lax.sub(x, broadcast_to(mean, x.shape))
    var = lax.div(lax.reduce_sum(lax.mul(xc, xc), axes), broadcast_to(n, x.shape[:axis]))
    rstd = lax.expand_dims(lax.rsqrt(binary(lax.add, operator.add, var, eps)), axes)
    out = lax.mul(xc, broadcast_to(rstd, x.shape))
    if weight is not None:
        out = binary(lax.mul, operator.mul, out, weight.astype(x.dtype))
    if bias is not None:
        out = binary(lax.add, operator.add, out, bias.astype(x.dtype))
    return out.astype(input.dtype), mean, rstd


@register(aten.native_layer_norm.default)
def native_layer_norm(input, normalized_shape, weight, bias, eps):
    """(out, mean, rstd); mean and rstd keep the normalized dims as size 1, like torch."""
    return _layer_norm(input, normalized_shape, weight, bias, eps)


@register(aten.native_layer_norm_backward.default)
def native_layer_norm_backward(grad_out, input, normalized_shape, mean, rstd, weight, bias, output_mask):
    w = weight if weight is not None else jnp.ones(tuple(normalized_shape), input.dtype)
    b = bias if bias is not None else jnp.zeros(tuple(normalized_shape), input.dtype)
    gx, gw, gb = _vjp(lambda x, w_, b_: _layer_norm_given(x, w_, b_, normalized_shape, rstd), (input, w, b), grad_out)
    return (
        gx if output_mask[0] else None,
        gw if output_mask[1] and weight is not None else None,
        gb if output_mask[2] and bias is not None else None,
    )


def _layer_norm_given(x, w, b, normalized_shape, rstd):
    """Layer norm recomputed from `x` (statistics re-derived so the VJP includes their gradients)."""
    axes = tuple(range(x.ndim - len(normalized_shape), x.ndim))
    xf = _opmath(x)
    mu = jnp.mean(xf, axis=axes, keepdims=True)
    # rstd was computed as rsqrt(var + eps); recover eps so the recomputation matches it exactly.
    var = jnp.mean(jnp.square(xf - mu), axis=axes, keepdims=True)
    eps = lax.stop_gradient(jnp.reciprocal(jnp.square(rstd.astype(xf.dtype))) - var)
    out = (xf - mu) * lax.rsqrt(var + eps) * w.astype(xf.dtype) + b.astype(xf.dtype)
    return out.astype(x.dtype)


def _group_norm(input, weight, bias, N, C, HxW, group, eps):
    x = _opmath(input).reshape(N, group, -1)
    mean = jnp.mean(x, axis=-1, keepdims=True)
    xc = x - mean
    rstd = lax.rsqrt(jnp.mean(jnp.square(xc), axis=-1, keepdims=True) + eps)
    out = (xc * rstd).reshape(input.shape)
    if weight is not None:
        out = out * _bcast_channel(weight.astype(out.dtype), input.ndim)
    if bias is not None:
        out = out + _bcast_channel(bias.astype(out.dtype), input.ndim)
    return out.astype(input.dtype), mean.reshape(N, group), rstd.reshape(N, group)


@register(aten.native_group_norm.default)
def native_group_norm(input, weight, bias, N, C, HxW, group, eps):
    return _group_norm(input, weight, bias, N, C, HxW, group, eps)


@register(aten.native_group_norm_backward.default)
def native_group_norm_backward(grad_out, input, mean, rstd, weight, N, C, HxW, group, output_mask):
    xf = _opmath(input).reshape(N, group, -1)
    var = jnp.mean(jnp.square(xf - jnp.mean(xf, axis=-1, keepdims=True)), axis=-1)
    eps = jnp.reciprocal(jnp.square(rstd.astype(xf.dtype))) - var  # per group; recovers torch's eps
    w = weight if weight is not None else jnp.ones((C,), input.dtype)
    b = jnp.zeros((C,), input.dtype)

    def fwd(x, w_, b_):
        xx = _opmath(x).reshape(N, group, -1)
        mu = jnp.mean(xx, axis=-1, keepdims=True)
        v = jnp.mean(jnp.square(xx - mu), axis=-1, keepdims=True)
        out = ((xx - mu) * lax.rsqrt(v + lax.stop_gradient(eps)[..., None])).reshape(x.shape)
        return (out * _bcast_channel(w_, x.ndim) + _bcast_channel(b_, x.ndim)).astype(x.dtype)

    gx, gw, gb = _vjp(fwd, (input, w, b), grad_out)
    return (
        gx if output_mask[0] else None,
        gw if output_mask[1] and weight is not None else None,
        gb if output_mask[2] else None,
    )


def _rms_norm(input, normalized_shape, weight, eps):
    axes = tuple(range(input.ndim - len(normalized_shape), input.ndim))
    x = _opmath(input)
    if eps is None:
        eps = float(jnp.finfo(input.dtype).eps)
    rstd = lax.rsqrt(jnp.mean(jnp.square(x), axis=axes, keepdims=True) + eps)
    out = x * rstd
    if weight is not None:
        out = out * weight.astype(x.dtype)
    return out.astype(input.dtype), rstd


@register(aten.rms_norm.default)
def rms_norm(input, normalized_shape, weight=None, eps=None):
    return _rms_norm(input, normalized_shape, weight, eps)[0]


keep_whole(aten.rms_norm.default)


@register(aten._fused_rms_norm.default)
def _fused_rms_norm(input, normalized_shape, weight, eps):
    return _rms_norm(input, normalized_shape, weight, eps)


# ---- softmax ----------------------------------------------------------------------------------
def _softmax_dtype(x, half_to_float):
    return jnp.float32 if half_to_float and x.dtype in (jnp.bfloat16, jnp.float16) else x.dtype


@register(aten._softmax.default)
def _softmax(self, dim, half_to_float):
    """Softmax in float32 for half inputs; `jax.nn.softmax` fuses and has a stable VJP."""
    out = jax.nn.softmax(_opmath(self), axis=dim) if self.ndim else jnp.ones_like(_opmath(self))
    return out.astype(_softmax_dtype(self, half_to_float))


@register(aten._log_softmax.default)
def _log_softmax(self, dim, half_to_float):
    out = jax.nn.log_softmax(_opmath(self), axis=dim) if self.ndim else jnp.zeros_like(_opmath(self))
    return out.astype(_softmax_dtype(self, half_to_float))


@register(aten._safe_softmax.default)
def _safe_softmax(self, dim, dtype=None):
    x = _opmath(self if dtype is None else self.astype(dtype))
    if x.ndim == 0:
        return jnp.ones_like(x).astype(dtype or self.dtype)
    masked = jnp.all(x == -jnp.inf, axis=dim, keepdims=True)
    # fully masked rows softmax zeros instead of -inf (whose softmax is NaN), so no NaN
    # reaches the gradient through the discarded branch of the `where`
    out = jax.nn.softmax(jnp.where(masked, 0, x), axis=dim)
    return jnp.where(masked, 0, out).astype(dtype or self.dtype)


@register(aten._softmax_backward_data.default)
def _softmax_backward_data(grad_output, output, dim, input_dtype):
    g, y = _opmath(grad_output), _opmath(output)
    if y.ndim == 0:
        return jnp.zeros_like(g).astype(input_dtype)
    return (y * (g - jnp.sum(g * y, axis=dim, keepdims=True))).astype(input_dtype)


@register(aten._log_softmax_backward_data.default)
def _log_softmax_backward_data(grad_output, output, dim, input_dtype):
    g, y = _opmath(grad_output), _opmath(output)
    if y.ndim == 0:
        return jnp.zeros_like(g).astype(input_dtype)
    return (g - jnp.exp(y) * jnp.sum(g, axis=dim, keepdims=True)).astype(input_dtype)


# ---- activations ------------------------------------------------------------------------------
def _act(fn):
    """Wrap an activation: compute in float32 for half inputs and cast back."""

    def wrapped(self, *args, **kwargs):
        return fn(_opmath(self), *args, **kwargs).astype(self.dtype)

    wrapped.__name__ = fn.__name__
    wrapped.__doc__ = fn.__doc__
    return wrapped


def _act_backward(fn):
    """The backward of an activation `fn(x, *args)` as a VJP (grad_output, self, *args)."""

    def wrapped(grad_output, self, *args):
        g = _vjp(lambda x: fn(x, *args), (_opmath(self),), _opmath(grad_output))[0]
        return g.astype(grad_output.dtype)

    return wrapped


def _gelu(x, approximate="none"):
    return jax.nn.gelu(x, approximate=approximate == "tanh")


def _silu(x):
    return x * jax.nn.sigmoid(x)


def _mish(x):
    return x * jnp.tanh(jax.nn.softplus(x))


def _hardswish(x):
    return x * jnp.clip(x + 3, 0, 6) / 6


def _hardsigmoid(x):
    return jnp.clip(x + 3, 0, 6) / 6


def _softplus(x, beta=1, threshold=20):
    bx = x * beta
    return jnp.where(bx > threshold, x, jnp.log1p(jnp.exp(bx)) / beta)


def _elu(x, alpha=1, scale=1, input_scale=1):
    return jnp.where(x > 0, x * scale, alpha * scale * jnp.expm1(x * input_scale))


register(aten.gelu.default)(_act(_gelu))
register(aten.silu.default)(_act(_silu))
register(aten.mish.default)(_act(_mish))
register(aten.hardswish.default)(torch_derivative(lambda t, out, self: hardswish_backward(t, self))(_act(_hardswish)))
register(aten.hardsigmoid.default)(
    torch_derivative(lambda t, out, self: hardsigmoid_backward(t, self))(_act(_hardsigmoid))
)
register(aten.softplus.default)(_act(_softplus))
register(aten.elu.default)(_act(_elu))


@register(aten.gelu_backward.default)
def gelu_backward(grad_output, self, approximate="none"):
    return _act_backward(_gelu)(grad_output, self, approximate)


register(aten.silu_backward.default)(_act_backward(_silu))


# backward ops in terms of the forward's OUTPUT y, as torch's CPU kernels compute them (one
# lowering instead of the three ops of torch's decompositions)
@register(aten.tanh_backward.default)
def tanh_backward(grad_output, output):
    y = _opmath(output)
    return (_opmath(grad_output) * jnp.conj(1 - y * y)).astype(grad_output.dtype)


@register(aten.sigmoid_backward.default)
def sigmoid_backward(grad_output, output):
    # the CPU kernel's order; bfloat16 computes in float32, float16 in float16
    up = (lambda v: v) if output.dtype == jnp.float16 else _opmath
    y = jnp.conj(up(output))
    return (up(grad_output) * (1 - y) * y).astype(grad_output.dtype)


register(aten.mish_backward.default)(_act_backward(_mish))
register(aten.softplus_backward.default)(_act_backward(_softplus))


@register(aten.hardswish_backward.default)
def hardswish_backward(grad_output, self):
    # torch's CPU kernel: 0 up to -3 included, x / 3 + 1/2 inside, 1 from 3 included
    g = jnp.where(self <= -3, 0, jnp.where(self < 3, self / 3 + 0.5, 1))
    return (grad_output * g).astype(grad_output.dtype)


@register(aten.hardsigmoid_backward.default)
def hardsigmoid_backward(grad_output, self):
    return jnp.where((self > -3) & (self < 3), grad_output / 6, 0).astype(grad_output.dtype)


@register(aten.elu_backward.default)
def elu_backward(grad_output, alpha, scale, input_scale, is_result, self_or_result):
    y = self_or_result
    if is_result:
        neg = grad_output * input_scale * (y + alpha * scale)
    else:
        neg = grad_output * input_scale * alpha * scale * jnp.exp(y * input_scale)
    return jnp.where(y > 0, grad_output * scale, neg).astype(grad_output.dtype)


@register(aten.celu.default)
def celu(self, alpha=1.0):
    x = _opmath(self)
    return jnp.where(x > 0, x, alpha * jnp.expm1(x / alpha)).astype(self.dtype)


@register(aten.selu.default)
def selu(self):
    return _elu(_opmath(self), 1.6732632423543772848170429916717, 1.0507009873554804934193349852946).astype(self.dtype)


@register(aten.relu.default)
@torch_derivative(lambda t, out, self: threshold_backward(t, out, 0))
def relu(self):
    return jnp.maximum(self, jnp.zeros((), self.dtype)) if self.dtype != jnp.bool_ else self


@register(aten.leaky_relu.default)
def leaky_relu(self, negative_slope=0.01):
    return jnp.where(self > 0, self, self * negative_slope).astype(self.dtype)


@register(aten.rrelu_with_noise_functional.default, random=True)
def rrelu_with_noise_functional(self, noise, lower=0.125, upper=1.0 / 3.0, training=False, generator=None, *, key):
    """(out, noise): in training each x <= 0 is scaled by a slope drawn from U(lower, upper), which
    `noise` records (1 elsewhere); in eval the slope is (lower + upper) / 2 and noise is unchanged."""
    if not training:
        return jnp.where(self > 0, self, self * ((lower + upper) / 2)).astype(self.dtype), noise
    slope = jax.random.uniform(key, self.shape, _opmath(self).dtype, lower, upper)
    new_noise = jnp.where(self <= 0, slope, 1).astype(noise.dtype)
    return (self * new_noise).astype(self.dtype), new_noise


# `rrelu_with_noise` writes `noise` yet returns a fresh tensor, which a pure lowering cannot express:
# on the `jax` device it runs, at the autograd level, as its functional variant plus `copy_`.
def _rrelu_with_noise_autograd(self, noise, lower=0.125, upper=1.0 / 3.0, training=False, generator=None):
    if not training:
        return aten.leaky_relu(self, (lower + upper) / 2)
    with torch.no_grad():  # (the functional op's derivative reads the old noise; x * slope's does not)
        _, new_noise = aten.rrelu_with_noise_functional(self, noise, lower, upper, True, generator)
        noise.copy_(new_noise)
    return self * new_noise


def _rrelu_with_noise_inplace_autograd(self, noise, lower=0.125, upper=1.0 / 3.0, training=False, generator=None):
    return self.copy_(_rrelu_with_noise_autograd(self, noise, lower, upper, training, generator))


kernel("rrelu_with_noise", _rrelu_with_noise_autograd, "AutogradPrivateUse1")
kernel("rrelu_with_noise_", _rrelu_with_noise_inplace_autograd, "AutogradPrivateUse1")


@register(aten.leaky_relu_backward.default)
def leaky_relu_backward(grad_output, self, negative_slope, self_is_result):
    return jnp.where(self > 0, grad_output, grad_output * negative_slope).astype(grad_output.dtype)


@register(aten.hardtanh.default)
@torch_derivative(lambda t, out, self, min_val=-1, max_val=1: hardtanh_backward(t, self, min_val, max_val))
def hardtanh(self, min_val=-1, max_val=1):
    return jnp.clip(self, min_val, max_val).astype(self.dtype)


@register(aten.hardtanh_backward.default)
def hardtanh_backward(grad_output, self, min_val, max_val):
    return jnp.where((self <= min_val) | (self >= max_val), 0, grad_output).astype(grad_output.dtype)


@register(aten.hardshrink_backward.default, aten.softshrink_backward.default)
def shrink_backward(grad_out, self, lambd):
    """`grad_out` outside `[-lambd, lambd]`, 0 inside it, bounds included (both shrinks' backward)."""
    return jnp.where((self >= -lambd) & (self <= lambd), jnp.zeros((), grad_out.dtype), grad_out)


@register(aten.threshold.default)
def threshold(self, threshold, value):
    return jnp.where(self <= threshold, value, self).astype(self.dtype)


@register(aten.threshold_backward.default)
def threshold_backward(grad_output, self, threshold):
    """ReLU's backward (`threshold_backward(g, out, 0)`)."""
    return jnp.where(self <= threshold, jnp.zeros((), grad_output.dtype), grad_output)


@register(aten.glu.default)
def glu(self, dim=-1):
    a, b = jnp.split(self, 2, axis=dim)
    return (a * jax.nn.sigmoid(b)).astype(self.dtype)


@register(aten.glu_backward.default)
def glu_backward(grad_output, self, dim):
    return _vjp(lambda x: glu(x, dim), (self,), grad_output)[0]


@register(aten._prelu_kernel.default)
def _prelu_kernel(self, weight):
    return jnp.where(self > 0, self, weight * self).astype(result_type(self, weight))


@register(aten._prelu_kernel_backward.default)
def _prelu_kernel_backward(grad_output, self, weight):
    gx = jnp.where(self > 0, grad_output, weight * grad_output)
    gw = jnp.where(self > 0, 0, self * grad_output)
    return gx.astype(self.dtype), gw.astype(weight.dtype)


@register(aten.log_sigmoid_forward.default)
def log_sigmoid_forward(self):
    return jax.nn.log_sigmoid(_opmath(self)).astype(self.dtype), jnp.zeros((0,), self.dtype)


@register(aten.log_sigmoid_backward.default)
def log_sigmoid_backward(grad_output, self, buffer):
    return (grad_output * jax.nn.sigmoid(-_opmath(self))).astype(grad_output.dtype)


# ---- embedding --------------------------------------------------------------------------------
@register(aten.embedding.default)
def embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    """Row lookup; the padding row gets no gradient, as in torch."""
    if _CHECKS[0]:
        check_index(indices, weight.shape[0], IndexError, "index out of range in self", negative=False)
    # out of range (negative included, as torch): the fill value (NaN), like index_select (ops/indexing.py)
    out = jnp.take(weight, jnp.where(indices < 0, weight.shape[0], indices), axis=0, mode="fill")
    if padding_idx is not None and padding_idx >= 0:
        out = jnp.where((indices == padding_idx)[..., None], lax.stop_gradient(out), out)
    return out


@register(aten.embedding_dense_backward.default)
def embedding_dense_backward(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq):
    idx = indices.reshape(-1)
    g = grad_output.reshape(idx.shape[0], -1)
    if scale_grad_by_freq:
        counts = jnp.zeros((num_weights,), g.dtype).at[idx].add(1)
        g = g / counts[idx][:, None]
    if padding_idx is not None and padding_idx >= 0:
        g = jnp.where((idx == padding_idx)[:, None], 0, g)
    return jnp.zeros((num_weights, g.shape[1]), g.dtype).at[idx].add(g)


def _bags(indices, offsets, include_last_offset):
    """(bag of each index (n,), number of bags): bag b holds indices[offsets[b]:offsets[b+1]]; with
    include_last_offset the last offset is dropped and the last bag runs to the end, as in torch."""
    n_bags = offsets.shape[0] - 1 if include_last_offset else offsets.shape[0]
    starts = offsets[:n_bags].astype(jnp.int32)
    bag = jnp.searchsorted(starts, jnp.arange(indices.shape[0], dtype=jnp.int32), side="right") - 1
    return bag.astype(jnp.int32), n_bags


def _embedding_bag(weight, indices, offsets, mode, per_sample_weights, include_last_offset, padding_idx, forward_only):
    """(output, offset2bag, bag_size, max_indices), shaped as torch's CPU kernel returns them."""
    idx = indices.astype(jnp.int32)
    bag, n_bags = _bags(indices, offsets, include_last_offset)
    keep = idx != padding_idx if padding_idx is not None and padding_idx >= 0 else jnp.ones(idx.shape, bool)
    rows = jnp.take(weight, idx, axis=0)  # (n, D)
    count = jax.ops.segment_sum(keep.astype(jnp.int32), bag, n_bags)
    ints = canonical_int()
    if mode == 0:  # sum
        fast = padding_idx is None or padding_idx < 0  # torch's fast path computes no offset2bag
        w = keep.astype(weight.dtype) if per_sample_weights is None else jnp.where(keep, per_sample_weights, 0)
        out = jax.ops.segment_sum(rows * w[:, None].astype(rows.dtype), bag, n_bags)
        size = jnp.zeros((offsets.shape[0] if forward_only else n_bags,), ints)
        offset2bag = jnp.zeros((0,), jnp.int32) if fast else bag
        return out, offset2bag.astype(ints), size, size
    if mode == 1:  # mean
        total = jax.ops.segment_sum(jnp.where(keep[:, None], rows, 0), bag, n_bags)
        out = total / jnp.maximum(count, 1)[:, None].astype(total.dtype)
        return out, bag.astype(ints), count.astype(ints), count.astype(ints)
    # max: the first index holding each feature's maximum (torch's strict `>` scan)
    masked = jnp.where(keep[:, None], rows, -jnp.inf)
    best = jax.ops.segment_max(masked, bag, n_bags)  # (B, D)
    n = idx.shape[0]
    first = jnp.where(keep[:, None] & (masked == best[bag]), jnp.arange(n)[:, None], n)
    pos = jax.ops.segment_min(first, bag, n_bags)  # (B, D)
    empty = (count == 0)[:, None]
    pos = jnp.where(empty, 0, pos)
    out = jnp.where(empty, 0, jnp.take_along_axis(rows, pos, axis=0)) if n else jnp.zeros(best.shape, rows.dtype)
    max_indices = jnp.where(empty, 0, idx[pos] if n else 0)
    return out, bag.astype(ints), count.astype(ints), max_indices.astype(ints)


@register(aten._embedding_bag_forward_only.default)
def _embedding_bag_forward_only(
    weight,
    indices,
    offsets,
    scale_grad_by_freq=False,
    mode=0,
    sparse=False,
    per_sample_weights=None,
    include_last_offset=False,
    padding_idx=-1,
):
    """`F.embedding_bag` without torch autograd: per-bag sum / mean / max of embedding rows.

    Bags are static in number (offsets' length); indices map to bags with a sorted search, and
    the reductions are segment sums / maxes, so it traces under `jax.jit`.
    """
    return _embedding_bag(weight, indices, offsets, mode, per_sample_weights, include_last_offset, padding_idx, True)


@register(aten._embedding_bag.default)
def _embedding_bag_lowering(
    weight,
    indices,
    offsets,
    scale_grad_by_freq=False,
    mode=0,
    sparse=False,
    per_sample_weights=None,
    include_last_offset=False,
    padding_idx=-1,
):
    return _embedding_bag(weight, indices, offsets, mode, per_sample_weights, include_last_offset, padding_idx, False)


@register(aten._embedding_bag_dense_backward.default)
def _embedding_bag_dense_backward(
    grad,
    indices,
    offset2bag,
    bag_size,
    maximum_indices,
    num_weights,
    scale_grad_by_freq,
    mode,
    per_sample_weights,
    padding_idx=-1,
):
    """Gradient for the weight: each bag's gradient scattered to the rows that made it."""
    idx = indices.astype(jnp.int32)
    keep = idx != padding_idx if padding_idx is not None and padding_idx >= 0 else jnp.ones(idx.shape, bool)
    if mode == 2:
        rows = maximum_indices.astype(jnp.int32)  # (B, D)
        g = jnp.where((bag_size > 0)[:, None], grad, 0)
        cols = jnp.broadcast_to(jnp.arange(grad.shape[1]), rows.shape)
        return jnp.zeros((num_weights, grad.shape[1]), grad.dtype).at[rows, cols].add(g)
    bag = offset2bag.astype(jnp.int32)
    g = grad[bag]
    if mode == 1:
        g = g / jnp.maximum(bag_size[bag], 1)[:, None].astype(g.dtype)
    elif per_sample_weights is not None:
        g = g * per_sample_weights[:, None].astype(g.dtype)
    if scale_grad_by_freq:
        counts = jnp.zeros((num_weights,), g.dtype).at[idx].add(1)
        g = g / counts[idx][:, None]
    g = jnp.where(keep[:, None], g, 0)
    return jnp.zeros((num_weights, grad.shape[1]), grad.dtype).at[idx].add(g)


@register(aten._embedding_bag_backward.default)
def _embedding_bag_backward(
    grad,
    indices,
    offsets,
    offset2bag,
    bag_size,
    maximum_indices,
    num_weights,
    scale_grad_by_freq,
    mode,
    sparse,
    per_sample_weights,
    padding_idx=-1,
):
    if offset2bag.shape[0] != indices.shape[0]:  # torch's sum fast path returns no offset2bag
        offset2bag = _bags(indices, offsets[: grad.shape[0]], False)[0]
    return _embedding_bag_dense_backward(
        grad,
        indices,
        offset2bag,
        bag_size,
        maximum_indices,
        num_weights,
        scale_grad_by_freq,
        mode,
        per_sample_weights,
        padding_idx,
    )


@register(aten._embedding_bag_per_sample_weights_backward.default)
def _embedding_bag_per_sample_weights_backward(grad, weight, indices, offsets, offset2bag, mode, padding_idx=-1):
    """Gradient for per_sample_weights (sum mode): <grad of its bag, its embedding row>."""
    idx = indices.astype(jnp.int32)
    bag = offset2bag.astype(jnp.int32)
    out = jnp.sum(grad[bag] * jnp.take(weight, idx, axis=0).astype(grad.dtype), axis=1)
    if padding_idx is not None and padding_idx >= 0:
        out = jnp.where(idx == padding_idx, 0, out)
    return out


@register(aten.one_hot.default)
def one_hot(self, num_classes=-1):
    if _CHECKS[0] and self.size:
        check(self >= 0, self, RuntimeError, "Class values must be non-negative.")
        if num_classes != -1:
            check(self < num_classes, self, RuntimeError, "Class values must be smaller than num_classes.")
    if num_classes == -1:
        num_classes = int(jnp.max(self)) + 1 if self.size else 0  # data-dependent: eager only
    return (self[..., None] == jnp.arange(num_classes, dtype=self.dtype)).astype(canonical_int())


keep_whole(aten.one_hot.default)  # else torch decomposes it (and skips its checks on this backend)


# ---- pixel shuffle, fold / unfold -------------------------------------------------------------
@register(aten.pixel_shuffle.default)
def pixel_shuffle(self, upscale_factor):
    r = upscale_factor
    *b, c, h, w = self.shape
    x = self.reshape(tuple(b) + (c // (r * r), r, r, h, w))
    n = len(b)
    x = jnp.transpose(x, tuple(range(n)) + (n, n + 3, n + 1, n + 4, n + 2))
    return x.reshape(tuple(b) + (c // (r * r), h * r, w * r))


@register(aten.pixel_unshuffle.default)
def pixel_unshuffle(self, downscale_factor):
    r = downscale_factor
    *b, c, h, w = self.shape
    n = len(b)
    x = self.reshape(tuple(b) + (c, h // r, r, w // r, r))
    x = jnp.transpose(x, tuple(range(n)) + (n, n + 2, n + 4, n + 1, n + 3))
    return x.reshape(tuple(b) + (c * r * r, h // r, w // r))


@register(aten.im2col.default)
def im2col(self, kernel_size, dilation, padding, stride):
    """`F.unfold`: (N, C*kh*kw, L) patches, C-major like torch."""
    batched = self.ndim == 4
    x = self if batched else self[None]
    if x.shape[0] == 0:  # XLA's patch extraction needs a batch; the result is empty anyway
        shape = im2col(jnp.zeros((1,) + x.shape[1:], x.dtype), kernel_size, dilation, padding, stride).shape
        return jnp.zeros((0,) + shape[1:] if batched else shape[1:], self.dtype)
    p = _tup(padding, 2)
    patches = lax.conv_general_dilated_patches(
        x,
        _tup(kernel_size, 2),
        _tup(stride, 2),
        [(q, q) for q in p],
        rhs_dilation=_tup(dilation, 2),
        dimension_numbers=("NCHW", "OIHW", "NCHW"),
        precision=lax.Precision.HIGHEST,
    )
    out = patches.reshape(patches.shape[0], patches.shape[1], -1).astype(self.dtype)
    return out if batched else out[0]


@register(aten.col2im.default)
def col2im(self, output_size, kernel_size, dilation, padding, stride):
    """`F.fold`: the transpose of `im2col` (overlapping patches add up)."""
    batched = self.ndim == 3
    cols = self if batched else self[None]
    kh, kw = _tup(kernel_size, 2)
    c = cols.shape[1] // (kh * kw)
    x = jnp.zeros((cols.shape[0], c) + tuple(output_size), self.dtype)
    out = _vjp(lambda a: im2col(a, kernel_size, dilation, padding, stride), (x,), cols)[0]
    return out if batched else out[0]


# ---- dropout ----------------------------------------------------------------------------------
@register(aten.native_dropout.default, random=True)
def native_dropout(input, p, train, *, key):
    """(output, mask): keeps each element with probability 1 - p and scales it by 1 / (1 - p)."""
    if train is not None and not train:
        return input, jnp.ones(input.shape, jnp.bool_)
    if p >= 1:
        return jnp.zeros_like(input), jnp.zeros(input.shape, jnp.bool_)
    mask = jax.random.bernoulli(key, 1.0 - p, input.shape)
    return jnp.where(mask, input / (1.0 - p), 0).astype(input.dtype), mask


@register(aten.native_dropout_backward.default)
def native_dropout_backward(grad_output, mask, scale):
    return (grad_output * mask * scale).astype(grad_output.dtype)


# ---- unpooling, bilinear ----------------------------------------------------------------------
@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _scatter_rows(values, indices, width):
    rows = values.shape[0]
    return jnp.zeros((rows, width), values.dtype).at[jnp.arange(rows)[:, None], indices].set(values)


def _scatter_rows_fwd(values, indices, width):
    return _scatter_rows(values, indices, width), indices


def _scatter_rows_bwd(width, indices, g):  # torch's backward: every input reads its index's gradient
    return jnp.take_along_axis(g, indices, axis=1), None


_scatter_rows.defvjp(_scatter_rows_fwd, _scatter_rows_bwd)


def _max_unpool(self, indices, output_size):
    n = len(output_size)
    lead = self.shape[: self.ndim - n]
    rows = math.prod(lead)
    out = _scatter_rows(self.reshape(rows, -1), indices.reshape(rows, -1).astype(jnp.int32), math.prod(output_size))
    return out.reshape(tuple(lead) + tuple(output_size))


@register(aten.max_unpool2d.default)
def max_unpool2d(self, indices, output_size):
    """Scatter each value to the flat spatial position its index names (zeros elsewhere)."""
    return _max_unpool(self, indices, tuple(output_size))


@register(aten.max_unpool3d.default)
def max_unpool3d(self, indices, output_size, stride, padding):
    return _max_unpool(self, indices, tuple(output_size))


@register(aten._trilinear.default)
@opmath
def _trilinear(i1, i2, i3, expand1, expand2, expand3, sumdim, unroll_dim=1):
    """`F.bilinear`'s kernel: broadcast the three inputs at the given dims, multiply, sum `sumdim`."""

    def expand(a, dims):
        for d in sorted(dims):
            a = jnp.expand_dims(a, d)
        return a

    prod = expand(i1, expand1) * expand(i2, expand2) * expand(i3, expand3)
    return jnp.sum(prod, axis=tuple(sumdim)) if sumdim else prod
