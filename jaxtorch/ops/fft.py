"""FFT lowerings: the three ATen FFT primitives and the frequency factories.

`torch.fft.*` functions are composite: padding/trimming to `n`/`s` and the choice of
normalization happen in ATen, which then calls one of three primitives, lowered here:

- `_fft_c2c(x, dim, normalization, forward)`: complex to complex;
- `_fft_r2c(x, dim, normalization, onesided)`: real to complex (half spectrum if onesided);
- `_fft_c2r(x, dim, normalization, last_dim_size)`: half spectrum to real.

`normalization` is ATen's `fft_norm_mode`: 0 = none, 1 = 1/sqrt(n), 2 = 1/n, where n is
the product of the signal sizes over `dim`, applied whatever the direction.

Example:
    ```python
    call_torch(torch.fft.rfft, jnp.arange(4.))   # [6.+0.j, -2.+2.j, -2.+0.j]
    ```
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import torch

from ..bridge.core._dtypes import default_float
from ..bridge.core._registry import register
from ._semantics import canon_dim

aten = torch.ops.aten


def _complex_of(dtype) -> np.dtype:
    return np.dtype(np.complex128) if np.dtype(dtype) in (np.float64, np.complex128) else np.dtype(np.complex64)


def _normalize(y, n: int, normalization: int):
    if normalization == 1:
        return y * (1 / math.sqrt(n))
    if normalization == 2:
        return y * (1 / n)
    return y


def _dims(dim, ndim):
    return tuple(canon_dim(d, ndim) for d in dim)


@register(aten._fft_c2c.default)
def fft_c2c(x, dim, normalization, forward):
    """Unnormalized complex FFT over `dim` (inverse if not `forward`), then ATen's scaling."""
    axes = _dims(dim, x.ndim)
    if not axes:
        return x
    x = x.astype(_complex_of(x.dtype))
    # norm="backward" leaves the forward transform unscaled; norm="forward" the inverse one.
    y = jnp.fft.fftn(x, axes=axes) if forward else jnp.fft.ifftn(x, axes=axes, norm="forward")
    return _normalize(y, math.prod(x.shape[a] for a in axes), normalization)


@register(aten._fft_r2c.default)
def fft_r2c(x, dim, normalization, onesided):
    """Real-input FFT over `dim`; `onesided` keeps the half spectrum of the last dim."""
    axes = _dims(dim, x.ndim)
    n = math.prod(x.shape[a] for a in axes)
    if onesided:
        y = jnp.fft.rfftn(x, axes=axes)
    else:
        y = jnp.fft.fftn(x.astype(_complex_of(x.dtype)), axes=axes)
    return _normalize(y.astype(_complex_of(x.dtype)), n, normalization)


@register(aten._fft_c2r.default)
def fft_c2r(x, dim, normalization, last_dim_size):
    """Inverse of a half spectrum over `dim`; the last dim's output length is `last_dim_size`."""
    axes = _dims(dim, x.ndim)
    sizes = [x.shape[a] for a in axes[:-1]] + [int(last_dim_size)]
    y = jnp.fft.irfftn(x, s=sizes, axes=axes, norm="forward")
    return _normalize(y, math.prod(sizes), normalization)


@register(aten.fft_fftfreq.default)
def fft_fftfreq(n, d=1.0, *, dtype=None, layout=None, device=None, pin_memory=None):
    """Sample frequencies `[0, 1, ..., -1] / (d * n)`."""
    return jnp.fft.fftfreq(n, d).astype(dtype or default_float())


@register(aten.fft_rfftfreq.default)
def fft_rfftfreq(n, d=1.0, *, dtype=None, layout=None, device=None, pin_memory=None):
    """Non-negative sample frequencies `[0, 1, ..., n // 2] / (d * n)`."""
    return jnp.fft.rfftfreq(n, d).astype(dtype or default_float())
