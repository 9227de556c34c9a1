"""Sorting lowerings: sort/argsort, topk, searchsorted/bucketize, unique.

Torch's ordering: NaN sorts as the largest value (last ascending, first descending),
and jaxtorch's sorts are always stable, so ties keep their original order. Where torch's
CPU kernels are not stable, their tie order is the C++ standard library's: `sort(stable=False)`
over more than 16 elements (outside its radix path for 1-d int64) is `std::sort`, and `topk`
is `std::nth_element`/`std::partial_sort`; that order is not reproduced here (it also differs
between libstdc++ and libc++ builds). `kthvalue` is torch's own quickselect, which
`reductions.kthvalue` does reproduce. Values are
gathered from the input at the sorted indices, so gradients flow to those indices.
`unique`-style ops have data-dependent output shapes: they run eagerly and raise
`DataDependentError` under `jax.jit`.

Example:
    ```python
    import jax.numpy as jnp, torch, jaxtorch
    values, idx = jaxtorch.call_torch(lambda x: torch.topk(x, 2), jnp.array([1., 3., 2.]))
    # values = [3., 2.], idx = [1, 2]
    ```
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from ..bridge.core._dtypes import canonical_int
from ..bridge.core._registry import register
from ._semantics import canon_dim, is_array, result_type

aten = torch.ops.aten


def stable_argsort(x, axis: int, descending: bool = False):
    """Indices that sort `x` along `axis` stably, NaN largest (torch's order), as int64."""
    return jnp.argsort(x, axis=axis, stable=True, descending=descending).astype(canonical_int())


def _along(a, dim: int, fn):
    """Apply `fn(x, axis)` along torch dim `dim`; 0-dim tensors are treated as shape (1,)."""
    if a.ndim == 0:
        canon_dim(dim, 0)
        return tuple(o.reshape(()) for o in fn(a.reshape(1), 0))
    return fn(a, canon_dim(dim, a.ndim))


@register(aten.sort.default, aten.sort.stable)
def sort(a, dim=-1, descending=False, *, stable=None):
    """`torch.sort` -> (values, indices), stable, NaN largest."""

    def fn(x, axis):
        idx = stable_argsort(x, axis, descending)
        return jnp.take_along_axis(x, idx, axis=axis), idx

    return _along(a, dim, fn)


@register(aten.argsort.default, aten.argsort.stable)
def argsort(a, dim=-1, descending=False, *, stable=None):
    """`torch.argsort` (stable)."""
    return sort(a, dim, descending)[1]


@register(aten.topk.default)
def topk(a, k, dim=-1, largest=True, sorted=True):
    """`torch.topk` -> (values, indices) of the `k` largest (or smallest), in sorted order."""

    def fn(x, axis):
        if not 0 <= k <= x.shape[axis]:
            raise RuntimeError("selected index k out of range")
        idx = jax.lax.slice_in_dim(stable_argsort(x, axis, descending=largest), 0, k, axis=axis)
        return jnp.take_along_axis(x, idx, axis=axis), idx

    return _along(a, dim, fn)


def _search(seq, values, side: str, out_int32: bool):
    """torch's searchsorted: 1-D `seq` for any `values`, or matching leading dims."""
    dt = result_type(seq, values)
    seq, values = seq.astype(dt), jnp.asarray(values, dt)
    if seq.ndim <= 1:
        out = jnp.searchsorted(seq.reshape(-1), values, side=side)
    else:
        if seq.shape[:-1] != values.shape[:-1]:
            raise RuntimeError(
                "torch.searchsorted(): boundaries tensor should be 1 dimension or the first N-1 dimensions of "
                f"boundaries tensor and input value tensor must match, but we got boundaries tensor "
                f"{list(seq.shape)} and input value tensor {list(values.shape)}"
            )
        rows = jax.vmap(lambda s, v: jnp.searchsorted(s, v, side=side))
        out = rows(seq.reshape(-1, seq.shape[-1]), values.reshape(-1, values.shape[-1])).reshape(values.shape)
    return out.astype(jnp.int32 if out_int32 else canonical_int())


def _side(right: bool, side) -> str:
    if side is not None:
        if right and side == "left":
            raise RuntimeError(
                "torch.searchsorted(): side and right can't be set to opposites, got side of left while right was True"
            )
        return side
    return "right" if right else "left"


@register(aten.searchsorted.Tensor, aten.searchsorted.Scalar)
def searchsorted(sorted_sequence, values, *, out_int32=False, right=False, side=None, sorter=None):
    """`torch.searchsorted` (with `right`/`side` and an optional `sorter`)."""
    if sorter is not None:
        sorted_sequence = jnp.take_along_axis(sorted_sequence, sorter.astype(jnp.int32), axis=-1)
    return _search(sorted_sequence, values, _side(right, side), out_int32)


@register(aten.bucketize.Tensor, aten.bucketize.Scalar)
def bucketize(values, boundaries, *, out_int32=False, right=False):
    """`torch.bucketize`: index of the bucket of each value; `right` makes buckets closed on the left."""
    if boundaries.ndim != 1:
        raise RuntimeError(f"boundaries tensor must be 1 dimension, but got dim({boundaries.ndim})")
    return _search(
        boundaries, values if is_array(values) else jnp.asarray(values), "right" if right else "left", out_int32
    )


# ---- unique: eager only -------------------------------------------------------------------
def _empty_long():
    return jnp.zeros((0,), canonical_int())


def _unique_flat(a, return_inverse: bool, return_counts: bool):
    flat = a.reshape(-1)
    out, inverse, counts = jnp.unique(flat, return_inverse=True, return_counts=True, equal_nan=False)
    inverse = inverse.reshape(a.shape).astype(canonical_int())
    return (
        out,
        inverse if return_inverse else _empty_long(),
        counts.astype(canonical_int()) if return_counts else _empty_long(),
    )


@register(aten._unique2.default, data_dependent=True)
def unique2(a, sorted=True, return_inverse=False, return_counts=False):
    """`torch.unique` without `dim` -> (values, inverse, counts); unrequested outputs are empty (eager only)."""
    return _unique_flat(a, return_inverse, return_counts)


@register(aten._unique.default, data_dependent=True)
def unique(a, sorted=True, return_inverse=False):
    out, inverse, _ = _unique_flat(a, return_inverse, False)
    return out, inverse


@register(aten.unique_dim.default, data_dependent=True)
def unique_dim(a, dim, sorted=True, return_inverse=False, return_counts=False):
    """`torch.unique(x, dim=d)` -> (unique slices, inverse, counts) (eager only)."""
    d = canon_dim(dim, a.ndim)
    out, inverse, counts = jnp.unique(a, axis=d, return_inverse=True, return_counts=True)
    return (
        out,
        inverse.reshape(-1).astype(canonical_int()),
        counts.astype(canonical_int()) if return_counts else jnp.zeros((0,), canonical_int()),
    )


@register(aten.unique_consecutive.default, data_dependent=True)
def unique_consecutive(a, return_inverse=False, return_counts=False, dim=None):
    """`torch.unique_consecutive` -> (values, inverse, counts) (eager only)."""
    if dim is None:
        x, axis = a.reshape(-1), 0
    else:
        x, axis = a, canon_dim(dim, a.ndim)
    n = x.shape[axis]
    if n == 0:
        return x, jnp.zeros(a.shape if dim is None else (0,), canonical_int()), _empty_long()
    first = jax.lax.slice_in_dim(x, 0, n - 1, axis=axis)
    second = jax.lax.slice_in_dim(x, 1, n, axis=axis)
    changed = first != second
    if x.ndim > 1:
        changed = jnp.any(changed, axis=tuple(ax for ax in range(x.ndim) if ax != axis))
    starts = np.concatenate([[True], np.asarray(changed)])
    out = jnp.take(x, np.nonzero(starts)[0], axis=axis)
    inverse = jnp.asarray(np.cumsum(starts) - 1, canonical_int())
    if dim is None:
        inverse = inverse.reshape(a.shape)
    bounds = np.append(np.nonzero(starts)[0], n)
    counts = jnp.asarray(np.diff(bounds), canonical_int())
    return (out, inverse if return_inverse else _empty_long(), counts if return_counts else _empty_long())
