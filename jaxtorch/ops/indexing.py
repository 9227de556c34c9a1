"""Indexing lowerings: advanced indexing, index_put, gather/scatter, masked ops, where, take/put.

Index semantics follow torch:
- negative indices wrap (`x[-1]`, `gather` with `-1` ...);
- advanced indices broadcast together and their result dims go where NumPy puts them
  (in place when the indexed dims are adjacent, first otherwise);
- a boolean mask index selects by its nonzero positions, so `x[mask]` has a data-dependent
  shape: it works eagerly and raises `DataDependentError` under `jax.jit`. Writes through a
  mask (`x[mask] = v`, `index_put`, `masked_scatter`) keep the shape and stay jit-friendly.

Out-of-range indices are not checked by default (an XLA gather cannot raise). Reads (`x[i]`,
`index_select`, `gather`, `take_along_dim`, `take`, `embedding`) give a *fill value* where the
index is out of range: NaN for floating and complex dtypes, the dtype's minimum for signed
integers, its maximum for unsigned ones, True for bool (JAX's `mode="fill"` values), so the
mistake shows up (a NaN loss) instead of a plausible wrong row. Out of range means outside
what torch accepts: `[-n, n)` for `x[i]` and `take`, `[0, n)` for `index_select`, `gather`,
`take_along_dim` and `embedding` (torch raises on a negative index there). Writes
(`index_put`, `scatter`, `put`, `index_add`, ...) drop them. Torch raises instead; so does
jaxtorch in checked mode (`jaxtorch.checks()`, see `bridge/core/_checks.py`).

Example:
    ```python
    out = jaxtorch.call_torch(lambda x, i: x[:, i], jnp.ones((3, 4)), jnp.array([0, 2]))
    ```
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import torch

from ..bridge.core._checks import ON as _CHECKS
from ..bridge.core._checks import check_index
from ..bridge.core._dtypes import canonical_int, check_int_value
from ..bridge.core._registry import register
from ._semantics import canon_dim, category, is_array, result_type

aten = torch.ops.aten


# ---- helpers --------------------------------------------------------------------------------
def _is_mask(ix) -> bool:
    return ix is not None and ix.dtype in (np.bool_, np.uint8)


_OUT_OF_BOUNDS = "index {value} is out of bounds for dimension %d with size %d"


def _check_indices(a, indices: Sequence) -> None:
    """Checked mode: torch's `IndexError` for an out-of-range advanced index (torch names the
    index's position among the given indices as its dimension)."""
    if not _CHECKS[0]:
        return
    dim, given = 0, 0
    for ix in indices:
        if ix is not None and not _is_mask(ix):
            check_index(ix, a.shape[dim], IndexError, _OUT_OF_BOUNDS % (given, a.shape[dim]))
        dim += 1 if ix is None or not _is_mask(ix) else ix.ndim
        given += ix is not None


def _flat_message(n: int) -> str:
    """`take`/`put`'s out-of-range message (torch's)."""
    return "out of range: tried to access index {value} on a tensor of " + str(n) + " elements."


def _check_along(a, dim: int, index, error: type[Exception] = RuntimeError) -> None:
    """Checked mode: torch's error for an index out of range along `dim` (gather/scatter)."""
    if _CHECKS[0]:
        check_index(index, a.shape[dim], error, _OUT_OF_BOUNDS % (dim, a.shape[dim]), negative=False)


def _check_select(a, dim: int, index) -> None:
    """Checked mode: `index_select`/`embedding`'s `IndexError: index out of range in self`."""
    if _CHECKS[0]:
        check_index(index, a.shape[dim], IndexError, "index out of range in self", negative=False)


def _no_negative(index, n: int):
    """`index` with its negative entries made out of range (`n`): the ops whose torch kernel
    raises on a negative index read the fill value there, not a wrapped row."""
    return jnp.where(index < 0, n, index)


def _index_tuple(indices: Sequence) -> tuple:
    """torch's `Tensor?[]` indices -> a NumPy-style index tuple (masks become their nonzeros)."""
    out: list = []
    for ix in indices:
        if ix is None:
            out.append(slice(None))
        elif _is_mask(ix):
            out.extend(jnp.nonzero(ix.astype(np.bool_)))  # data-dependent: raises under jit
        else:
            out.append(ix)
    return tuple(out)


def _at(ndim: int, dim: int, idx) -> tuple:
    return (slice(None),) * dim + (idx,) + (slice(None),) * (ndim - dim - 1)


def _along(index, dim: int) -> tuple:
    """Index tuple for `gather`/`scatter`: `index` along `dim`, positions elsewhere."""
    grids = []
    for d, n in enumerate(index.shape):
        if d == dim:
            grids.append(index)
        else:
            shape = [1] * index.ndim
            shape[d] = n
            grids.append(np.arange(n).reshape(shape))
    return tuple(grids)


def _fill_value(value, dtype):
    return jnp.asarray(value).astype(dtype)


def _identity(reduce: str, dtype):
    if reduce in ("sum", "mean", "add"):
        return 0
    if reduce in ("prod", "multiply"):
        return 1
    if category(dtype) >= 2:
        return -jnp.inf if reduce == "amax" else jnp.inf
    if dtype == np.bool_:
        return reduce == "amin"
    info = jnp.iinfo(dtype)
    return info.min if reduce == "amax" else info.max


def _reduce_into(a, idx: tuple, src, reduce: str, include_self: bool = True):
    """`a` with `src` combined into the positions `idx` (duplicates reduced) by `reduce`.

    Booleans sum as logical or and multiply as logical and, like torch."""
    if a.dtype == np.bool_:
        out = _reduce_into(a.astype(jnp.int32), idx, src.astype(jnp.int32), reduce, include_self)
        return out != 0
    src = src.astype(a.dtype)
    base = a
    if not include_self:
        touched = jnp.zeros(a.shape, bool).at[idx].set(True)
        base = jnp.where(touched, _fill_value(_identity(reduce, a.dtype), a.dtype), a)
    ref = base.at[idx]
    if reduce in ("sum", "add"):
        return ref.add(src)
    if reduce in ("prod", "multiply"):
        return ref.multiply(src)
    if reduce == "amax":
        return ref.max(src)
    if reduce == "amin":
        return ref.min(src)
    if reduce == "mean":
        total = ref.add(src)
        count = jnp.zeros(a.shape, jnp.int32).at[idx].add(1) + (1 if include_self else 0)
        safe = jnp.maximum(count, 1).astype(a.dtype)
        mean = total / safe if category(a.dtype) >= 2 else jnp.floor_divide(total, safe)
        return jnp.where(count > 0, mean.astype(a.dtype), a)
    raise RuntimeError(f"reduce argument must be one of sum, prod, mean, amax, amin; got {reduce!r}")


def _with_1d(fn):
    """Run a dim-wise op on a 0-dim tensor as if it were 1-dim (torch allows dim 0 / -1)."""

    def wrapper(a, dim, *args, **kwargs):
        if a.ndim == 0:
            return fn(a.reshape(1), 0, *args, **kwargs).reshape(())
        return fn(a, canon_dim(dim, a.ndim), *args, **kwargs)

    wrapper.__doc__, wrapper.__name__ = fn.__doc__, fn.__name__
    return wrapper


def _1d(x):
    return x.reshape(-1) if x.ndim == 0 else x


# ---- advanced indexing -----------------------------------------------------------------------
@register(
    aten.index.Tensor, aten.index.Tensor_hacked_twin, aten._unsafe_index.Tensor, aten._unsafe_index.Tensor_hacked_twin
)
def index(a, indices):
    """`x[i, :, j]` with tensor indices (what `aten.index` gets; `None` marks a full slice)."""
    _check_indices(a, indices)
    return a.at[_index_tuple(indices)].get(mode="fill")


def _single_mask(indices) -> int | None:
    """Position of the only non-None index when it is a boolean mask, else None."""
    live = [i for i, ix in enumerate(indices) if ix is not None]
    if len(live) == 1 and _is_mask(indices[live[0]]):
        return live[0]
    return None


def _mask_put(a, k: int, mask, values, accumulate: bool):
    """`a[:, ..., mask] = values` (k leading full slices) without data-dependent shapes."""
    mask = mask.astype(bool)
    m = mask.ndim
    rest = a.shape[k + m :]
    mask_b = mask.reshape((1,) * k + mask.shape + (1,) * len(rest))
    values = values.astype(a.dtype)
    nnz_axis = values.ndim - len(rest) - 1  # where the nnz dim of `values` would be
    if nnz_axis >= 0 and values.shape[nnz_axis] != 1 and values.ndim >= len(rest) + 1:
        # one value (row) per selected position: gather the i-th for the i-th True (cumsum trick)
        pos = jnp.maximum(jnp.cumsum(mask.reshape(-1)) - 1, 0)
        vals = jnp.broadcast_to(values, a.shape[:k] + values.shape[nnz_axis:]) if k else values
        vals = jnp.take(vals, pos, axis=k).reshape(a.shape)
    else:  # one value (row) for every selected position, broadcast over the leading slices
        vals = jnp.squeeze(values, nnz_axis) if nnz_axis >= 0 else values
        if vals.ndim > len(rest):
            lead = vals.shape[: vals.ndim - len(rest)]
            vals = vals.reshape(lead + (1,) * m + rest)
    if accumulate:
        return jnp.where(mask_b, (a + vals) if a.dtype != np.bool_ else (a | vals), a)
    return jnp.where(mask_b, vals, a)


@register(
    aten.index_put.default,
    aten.index_put.hacked_twin,
    aten._unsafe_index_put.default,
    aten._unsafe_index_put.hacked_twin,
    aten._index_put_impl.default,
)
def index_put(a, indices, values, accumulate=False, unsafe=False):
    """`x[idx] = v` / `x.index_put_((i, j), v, accumulate=True)` (duplicates accumulate).

    A single boolean mask (`x[mask] = v`) is lowered with `jnp.where`, so it works under jit."""
    k = _single_mask(indices)
    if k is not None:
        return _mask_put(a, k, indices[k], values, accumulate)
    _check_indices(a, indices)
    idx = _index_tuple(indices)
    if accumulate:
        return _reduce_into(a, idx, values, "sum")
    return a.at[idx].set(values.astype(a.dtype))


@register(aten._unsafe_masked_index.default)
def unsafe_masked_index(a, mask, indices, fill):
    """`a[indices]` where `mask` holds, `fill` elsewhere (indices under a False mask may be invalid)."""
    got = a[_index_tuple(indices)]
    return jnp.where(mask, got, _fill_value(fill, a.dtype))


@register(aten._unsafe_masked_index_put_accumulate.default)
def unsafe_masked_index_put_accumulate(a, mask, indices, values):
    """`a[indices] += values` where `mask` holds."""
    values = jnp.where(mask, values.astype(a.dtype), jnp.zeros((), a.dtype))
    return _reduce_into(a, _index_tuple(indices), values, "sum")


@register(aten.index_select.default)
@_with_1d
def index_select(a, dim, index):
    """`x.index_select(1, idx)`."""
    _check_select(a, dim, index)
    return (
        jnp.take(a, _no_negative(_1d(index), a.shape[dim]), axis=dim, mode="fill")
        if a.size
        else jnp.zeros(a.shape[:dim] + (_1d(index).shape[0],) + a.shape[dim + 1 :], a.dtype)
    )


@register(aten.take.default)
def take(a, index):
    """`torch.take(x, idx)`: index the flattened tensor; the result has `idx`'s shape."""
    if _CHECKS[0]:
        check_index(
            index,
            a.size,
            IndexError,
            _flat_message(a.size),
        )
    return a.reshape(-1).at[index].get(mode="fill")


@register(aten.put.default)
def put(a, index, source, accumulate=False):
    """`x.put(idx, src, accumulate)` on the flattened tensor."""
    flat, idx, src = a.reshape(-1), index.reshape(-1), source.reshape(-1)
    if _CHECKS[0]:
        check_index(idx, a.size, IndexError, _flat_message(a.size))
    out = _reduce_into(flat, (idx,), src, "sum") if accumulate else flat.at[idx].set(src.astype(a.dtype))
    return out.reshape(a.shape)


# ---- gather / scatter -------------------------------------------------------------------------
@register(aten.gather.default)
@_with_1d
def gather(a, dim, index, sparse_grad=False):
    """`x.gather(dim, idx)`: `out[i][j] = x[idx[i][j]][j]` for dim 0."""
    _check_along(a, dim, index)
    return a.at[_along(_no_negative(_1d(index), a.shape[dim]), dim)].get(mode="fill").reshape(index.shape)


def _scatter(a, dim, index, src, reduce=None, include_self=True):
    if a.ndim == 0:
        return _scatter(a.reshape(1), 0, _1d(index), _1d(src) if is_array(src) else src, reduce, include_self).reshape(
            ()
        )
    dim = canon_dim(dim, a.ndim)
    if index.size == 0:
        return a
    _check_along(a, dim, index)
    if is_array(src) and src.ndim > 0:
        src = _1d(src)[tuple(slice(0, n) for n in index.shape)]
    else:  # a scalar `value` (traced as a 0-d array by the eager cache)
        src = jnp.full(index.shape, src, a.dtype)
    idx = _along(index, dim)
    if reduce is None:
        return a.at[idx].set(src.astype(a.dtype))
    return _reduce_into(a, idx, src, reduce, include_self)


@register(aten.scatter.src, aten.scatter.value)
def scatter(a, dim, index, src):
    """`x.scatter(dim, idx, src)` (or a scalar `value`): `out[idx[i][j]][j] = src[i][j]` for dim 0."""
    return _scatter(a, dim, index, src)


@register(aten.scatter.reduce, aten.scatter.value_reduce)
def scatter_reduce_legacy(a, dim, index, src, reduce):
    """`x.scatter(dim, idx, src, reduce="add" | "multiply")`."""
    return _scatter(a, dim, index, src, reduce)


@register(aten.scatter_add.default)
def scatter_add(a, dim, index, src):
    """`x.scatter_add(dim, idx, src)`: duplicates accumulate."""
    return _scatter(a, dim, index, src, "sum")


@register(aten.scatter_reduce.two)
def scatter_reduce(a, dim, index, src, reduce, include_self=True):
    """`x.scatter_reduce(dim, idx, src, "sum" | "prod" | "mean" | "amax" | "amin", include_self=...)`."""
    return _scatter(a, dim, index, src, reduce, include_self)


# ---- dim-wise index ops -----------------------------------------------------------------------
@register(aten.index_add.default)
@_with_1d
def index_add(a, dim, index, source, alpha=1):
    """`x.index_add(dim, idx, src, alpha=a)`: duplicates accumulate."""
    _check_select(a, dim, index)
    src = source.reshape(a.shape[:dim] + (-1,) + a.shape[dim + 1 :]) if source.ndim == 0 else source
    if alpha != 1:
        src = src * alpha
    return _reduce_into(a, _at(a.ndim, dim, _1d(index)), src, "sum")


@register(aten.index_copy.default)
@_with_1d
def index_copy(a, dim, index, source):
    """`x.index_copy(dim, idx, src)`."""
    if _CHECKS[0]:
        n = a.shape[dim]
        check_index(index, n, IndexError, "index_copy_(): " + _OUT_OF_BOUNDS % (dim, n), negative=False)
    src = source.reshape(a.shape[:dim] + (-1,) + a.shape[dim + 1 :]) if source.ndim == 0 else source
    return a.at[_at(a.ndim, dim, _1d(index))].set(src.astype(a.dtype))


@register(aten.index_fill.int_Scalar, aten.index_fill.int_Tensor)
@_with_1d
def index_fill(a, dim, index, value):
    """`x.index_fill(dim, idx, v)`."""
    if _CHECKS[0]:
        check_index(index, a.shape[dim], IndexError, _OUT_OF_BOUNDS % (dim, a.shape[dim]))
    return a.at[_at(a.ndim, dim, _1d(index))].set(_fill_value(value, a.dtype))


@register(aten.index_reduce.default)
@_with_1d
def index_reduce(a, dim, index, source, reduce, include_self=True):
    """`x.index_reduce(dim, idx, src, "prod" | "mean" | "amax" | "amin", include_self=...)`."""
    _check_select(a, dim, index)
    src = source.reshape(a.shape[:dim] + (-1,) + a.shape[dim + 1 :]) if source.ndim == 0 else source
    return _reduce_into(a, _at(a.ndim, dim, _1d(index)), src, reduce, include_self)


# ---- masks --------------------------------------------------------------------------------------
@register(aten.masked_fill.Scalar, aten.masked_fill.Tensor)
def masked_fill(a, mask, value):
    """`x.masked_fill(mask, v)`."""
    check_int_value(value, a.dtype, "masked_fill's value")  # int64 beyond 32 bits: Int64Error, not wrapped
    return jnp.where(mask.astype(bool), _fill_value(value, a.dtype), a)


@register(aten.masked_scatter.default)
def masked_scatter(a, mask, source):
    """`x.masked_scatter(mask, src)`: the i-th True position takes `src.flatten()[i]`.

    Static shapes (a cumsum picks each position's source element), so it works under jit."""
    shape = jnp.broadcast_shapes(a.shape, mask.shape)
    a, mask = jnp.broadcast_to(a, shape), jnp.broadcast_to(mask.astype(bool), shape)
    pos = jnp.maximum(jnp.cumsum(mask.reshape(-1)) - 1, 0)
    flat = source.reshape(-1).astype(a.dtype)
    vals = flat[jnp.minimum(pos, max(flat.shape[0] - 1, 0))] if flat.shape[0] else jnp.zeros_like(pos, a.dtype)
    return jnp.where(mask, vals.reshape(shape), a)


# Not flagged `data_dependent`: the length depends only on the mask (or input) values, so these
# run whenever those are concrete (under `jax.grad`, or built from constants inside `jax.jit`);
# a traced mask makes `jnp.nonzero` raise, which the interpreter reports as `DataDependentError`.
@register(aten.masked_select.default)
def masked_select(a, mask):
    """`x.masked_select(mask)`: 1-d, its length the number of True elements."""
    shape = jnp.broadcast_shapes(a.shape, mask.shape)
    return jnp.broadcast_to(a, shape)[jnp.nonzero(jnp.broadcast_to(mask.astype(bool), shape))]


@register(aten.nonzero.default)
def nonzero(a):
    """`x.nonzero()`: an (n, ndim) tensor of indices; n depends on the values."""
    return jnp.argwhere(a).astype(canonical_int())


@register(aten.nonzero_static.default)
def nonzero_static(a, size, fill_value=-1):
    """`torch.nonzero_static(x, size=n)`: the first n nonzero indices, padded with `fill_value`."""
    if a.ndim == 0:
        out = jnp.argwhere(a.reshape(1), size=size, fill_value=fill_value)[:, :0]
    else:
        out = jnp.argwhere(a, size=size, fill_value=fill_value)
    return out.astype(canonical_int())


@register(aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar)
def where(condition, a, b):
    """`torch.where(cond, x, y)`: x and y promote like an elementwise op."""
    dtype = result_type(a, b)
    a = a.astype(dtype) if is_array(a) else jnp.asarray(a, dtype)
    b = b.astype(dtype) if is_array(b) else jnp.asarray(b, dtype)
    return jnp.where(condition.astype(bool), a, b)


@register(aten.masked_scatter_backward.default)
def masked_scatter_backward(grad_output, mask, sizes):
    """The gradient of `masked_scatter` w.r.t. its source: the i-th True position's gradient
    goes to source element i; the rest of the source gets zeros."""
    target = jnp.zeros(grad_output.shape, grad_output.dtype)
    _, vjp = jax.vjp(lambda s: masked_scatter(target, mask, s), jnp.zeros(tuple(sizes), grad_output.dtype))
    return vjp(grad_output)[0]
