"""Shape lowerings: views, reshapes, permutes, concatenation and splitting, flips, padding.

Ops whose ATen schema returns an alias of their first argument (`view`, `transpose`,
`select`, `slice`, `expand`, `unbind`, `split`, `diagonal`, `unfold`, `as_strided`, ...)
become aliasing views in the interpreter, so their lowerings here are pure index maps of
that argument: they only move, drop or repeat elements, never compute new values. That is
what lets a write to a view (`x[:, 1:3] += 1`) scatter back into its base.

The `*_scatter` ops (`slice_scatter`, `select_scatter`, `diagonal_scatter`,
`as_strided_scatter`) are the functional inverses: the base with the viewed elements
replaced, computed by applying the view to an iota of element positions.

Example:
    ```python
    y = jaxtorch.call_torch(lambda x: x.transpose(0, 1)[1:].flip(0), jnp.ones((3, 4)))
    ```
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax
from jax.extend.core import concrete_or_error

from .._compat import DispatchKey, OpOverload, all_op_names, decomposition_table, has_kernel_for_dispatch_key
from ..bridge.core._dtypes import to_torch_dtype
from ..bridge.core._registry import keep_whole, lookup, register
from ._semantics import canon_dim

aten = torch.ops.aten


# ---- helpers --------------------------------------------------------------------------------
def _index_at(ndim: int, dim: int, idx) -> tuple:
    """The tuple index that applies `idx` along `dim` of an `ndim`-dim array."""
    return (slice(None),) * dim + (idx,) + (slice(None),) * (ndim - dim - 1)


def _clamp_slice(size: int, start, end, step: int) -> tuple[int, int, int]:
    """torch's slice bounds: None -> ends, negatives wrap once, then clamp to [0, size]."""
    if step <= 0:
        raise ValueError("slice step must be positive")
    start = 0 if start is None else start
    end = size if end is None else end
    if start < 0:
        start += size
    if end < 0:
        end += size
    start = min(max(start, 0), size)
    end = min(max(end, start), size)
    return start, end, step


def scatter_through(a, view_fn: Callable, src):
    """`a` with the elements that the index map `view_fn` selects replaced by `src`.

    Example: `scatter_through(a, lambda x: x[1], src)` is `a.at[1].set(src)`.
    """
    iota = jnp.arange(a.size, dtype=jnp.int32).reshape(a.shape)
    idx = view_fn(iota)
    src = jnp.broadcast_to(jnp.asarray(src).astype(a.dtype), idx.shape)
    return a.reshape(-1).at[idx.reshape(-1)].set(src.reshape(-1)).reshape(a.shape)


def _promote_all(tensors: Sequence) -> list:
    # unlike elementwise ops, `cat`/`stack` promote 0-dim and n-dim tensors alike.
    dtypes = [t.dtype for t in tensors]
    dtype = dtypes[0]
    for d in dtypes[1:]:
        dtype = jnp.promote_types(dtype, d)
    return [t.astype(dtype) if t.dtype != dtype else t for t in tensors]


# ---- reshapes -----------------------------------------------------------------------------
@register(aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten._reshape_alias.default)
def view(a, size, stride=None):
    """`x.view(2, -1)`: a reshape; `-1` infers one size."""
    return jnp.reshape(a, tuple(size))


@register(aten.view.dtype)
def view_dtype(a, dtype):
    """`x.view(torch.int32)`: reinterpret the bits; the last dim scales with the element size."""
    dtype = np.dtype(dtype)
    if a.dtype == dtype:
        return a
    src = a.astype(np.uint8) if a.dtype == np.bool_ else a
    want = np.dtype(np.uint8) if dtype == np.bool_ else dtype
    ratio_num, ratio_den = src.dtype.itemsize, want.itemsize
    if ratio_num == ratio_den:
        out = lax.bitcast_convert_type(src, want)
    elif ratio_num > ratio_den:  # to a smaller type: last dim grows
        out = lax.bitcast_convert_type(src, want)
        out = out.reshape(src.shape[:-1] + (src.shape[-1] * (ratio_num // ratio_den),)) if src.ndim else out.reshape(-1)
    else:
        r = ratio_den // ratio_num
        if src.ndim == 0 or src.shape[-1] % r:
            raise RuntimeError(
                f"view(dtype): the last dim ({src.shape[-1] if src.ndim else 0}) must be a multiple of {r}"
            )
        out = lax.bitcast_convert_type(src.reshape(src.shape[:-1] + (src.shape[-1] // r, r)), want)
    return out.astype(np.bool_) if dtype == np.bool_ else out


@register(aten.expand.default)
def expand(a, size, implicit: bool = False):
    """`x.expand(4, -1)`: broadcast size-1 dims (and new leading dims); `-1` keeps a size."""
    size = list(size)
    lead = len(size) - a.ndim
    if lead < 0:
        raise RuntimeError(f"expand: the number of sizes ({len(size)}) must be >= the number of dims ({a.ndim})")
    shape = [s for s in size[:lead]] + [a.shape[i] if s == -1 else s for i, s in enumerate(size[lead:])]
    return jnp.broadcast_to(a, tuple(shape))


@register(aten.permute.default)
def permute(a, dims):
    """`x.permute(2, 0, 1)`."""
    return lax.transpose(a, tuple(canon_dim(d, a.ndim) for d in dims))


@register(aten.t.default)
def t(a):
    """`x.t()`: transpose a matrix; 0-d and 1-d tensors are returned as they are."""
    return lax.transpose(a, (1, 0)) if a.ndim == 2 else a


@register(aten.transpose.int)
def transpose(a, dim0, dim1):
    """`x.transpose(0, 1)`."""
    if a.ndim == 0:
        return a
    perm = list(range(a.ndim))
    i, j = canon_dim(dim0, a.ndim), canon_dim(dim1, a.ndim)
    perm[i], perm[j] = j, i
    return lax.transpose(a, tuple(perm))  # (not jnp.swapaxes: a jitted function, dearer to trace)


@register(aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims)
def squeeze(a, dim=None):
    """`x.squeeze()`, `x.squeeze(1)`, `x.squeeze((0, 2))`: drop size-1 dims (others stay)."""
    if a.ndim == 0:
        return a
    if dim is None:
        dims = [i for i, s in enumerate(a.shape) if s == 1]
    else:
        dims = [dim] if isinstance(dim, int) else list(dim)
        dims = [canon_dim(d, a.ndim) for d in dims]
        dims = [d for d in dims if a.shape[d] == 1]
    return jnp.squeeze(a, axis=tuple(sorted(set(dims)))) if dims else a


@register(aten.unsqueeze.default)
def unsqueeze(a, dim):
    """`x.unsqueeze(-1)`."""
    return jnp.expand_dims(a, canon_dim(dim, a.ndim + 1))


# ---- selecting parts --------------------------------------------------------------------------
@register(aten.select.int)
def select(a, dim, index):
    """`x.select(0, -1)` (what `x[-1]` runs): negative indices wrap."""
    dim = canon_dim(dim, a.ndim)
    size = a.shape[dim]
    if not -size <= index < size:
        raise IndexError(f"select(): index {index} out of range for tensor of size {a.shape} at dimension {dim}")
    return a[_index_at(a.ndim, dim, index % size)]


@register(aten.slice.Tensor)
def slice_(a, dim=0, start=None, end=None, step=1):
    """`x[:, 1:3]`: out-of-range bounds clamp to the dim, like torch."""
    dim = canon_dim(dim, a.ndim)
    start, end, step = _clamp_slice(a.shape[dim], start, end, step)
    return a[_index_at(a.ndim, dim, slice(start, end, step))]


def _split_sizes(size: int, split_size: int) -> list[int]:
    if split_size == 0:
        return [size]
    n = max(1, -(-size // split_size))
    return [min(split_size, size - i * split_size) for i in range(n)]


@register(aten.split_with_sizes.default, aten.split.sizes, aten.split.default)
def split_with_sizes(a, split_sizes, dim=0):
    """`x.split([2, 3], dim=1)`."""
    dim = canon_dim(dim, a.ndim)
    if sum(split_sizes) != a.shape[dim]:
        raise RuntimeError(f"split_with_sizes expects split_sizes to sum exactly to {a.shape[dim]}, got {split_sizes}")
    offsets = np.cumsum([0] + list(split_sizes))
    return [a[_index_at(a.ndim, dim, slice(int(offsets[i]), int(offsets[i + 1])))] for i in range(len(split_sizes))]


@register(aten.split.Tensor)
def split(a, split_size, dim=0):
    """`x.split(2, dim=0)`: equal chunks, the last one smaller."""
    dim = canon_dim(dim, a.ndim)
    return split_with_sizes(a, _split_sizes(a.shape[dim], split_size), dim)


@register(aten.unsafe_split.Tensor)
def unsafe_split(a, split_size, dim=0):
    return split(a, split_size, dim)


@register(aten.unsafe_split_with_sizes.default)
def unsafe_split_with_sizes(a, split_sizes, dim=0):
    return split_with_sizes(a, split_sizes, dim)


def _concrete_ints(t, what: str):
    """The values of a small integer tensor argument as Python ints (raises `ConcretizationTypeError` if traced)."""
    return np.asarray(concrete_or_error(None, t, f"{what} needs the values of its index tensor")).tolist()


def _tensor_split_bounds(size: int, indices_or_sections) -> list[tuple[int | None, int | None]]:
    """(start, end) slice bounds of `tensor_split` for a section count (int) or split indices (list)."""
    if isinstance(indices_or_sections, int):
        n = indices_or_sections
        if n <= 0:
            raise RuntimeError(f"number of sections must be larger than 0, got {n}")
        q, r = divmod(size, n)
        starts = [i * q + min(i, r) for i in range(n + 1)]
        return list(zip(starts[:-1], starts[1:]))
    cuts = [0] + list(indices_or_sections) + [None]
    return list(zip(cuts[:-1], cuts[1:]))


@register(aten.tensor_split.tensor_indices_or_sections)
def tensor_split_tensor(a, tensor_indices_or_sections, dim=0):
    """`torch.tensor_split(x, t)` with a tensor `t`: a section count (0-dim) or split indices (1-d).

    The pieces' sizes depend on `t`'s values, so `t` must be concrete (not traced by `jax.jit`).
    """
    t = tensor_indices_or_sections
    if not jnp.issubdtype(t.dtype, jnp.integer):
        raise RuntimeError(
            "tensor_split expected tensor_indices_or_sections to have dtype of long, but got "
            f"{str(to_torch_dtype(t.dtype)).replace('torch.', '').capitalize()}"
        )
    if t.ndim > 1:
        raise RuntimeError(
            "tensor_split expected tensor_indices_or_sections to be a zero-dimensional or "
            f"one-dimensional tensor, but got a tensor with {t.ndim} dims"
        )
    dim = canon_dim(dim, a.ndim)
    bounds = _tensor_split_bounds(a.shape[dim], _concrete_ints(t, "tensor_split"))
    return [slice_(a, dim, start, end) for start, end in bounds]


def _tensor_split_recorded(a, tensor_indices_or_sections, dim=0):
    """Under torch autograd: the index tensor's values, then torch's differentiable int overloads."""
    t = tensor_indices_or_sections
    if t.dim() == 0:
        return aten.tensor_split.sections(a, int(t.item()), dim)
    return aten.tensor_split.indices(a, [int(i) for i in t.tolist()], dim)


@register(aten.narrow.Tensor)
def narrow_tensor(a, dim, start, length):
    """`x.narrow(dim, start, length)` with a 0-dim tensor `start` (traceable: a dynamic slice).

    A negative `start` counts from the end. Torch raises when the window leaves the dim; here
    the window is clamped into it (`lax.dynamic_slice` semantics), since `start` may be traced.
    """
    dim = canon_dim(dim, a.ndim)
    size = a.shape[dim]
    if not 0 <= length <= size:
        raise RuntimeError(f"narrow(): length {length} does not fit dimension {dim} of size {size}.")
    start = jnp.asarray(start).reshape(())
    start = jnp.where(start < 0, start + size, start)
    return lax.dynamic_slice_in_dim(a, start, length, axis=dim)


# Both overloads above are CompositeImplicitAutograd: torch's C++ kernels would run first and
# read the index tensor on the host. Backend kernels for the `jax` device keep them whole, so
# they reach the lowerings; when torch autograd records, torch's differentiable path runs.
keep_whole(aten.tensor_split.tensor_indices_or_sections, _tensor_split_recorded)
keep_whole(aten.narrow.Tensor)


@register(aten.unbind.int)
def unbind(a, dim=0):
    """`x.unbind(1)`: a tuple of `select`s."""
    dim = canon_dim(dim, a.ndim)
    return [a[_index_at(a.ndim, dim, i)] for i in range(a.shape[dim])]


@register(aten.diagonal.default)
def diagonal(a, offset=0, dim1=0, dim2=1):
    """`x.diagonal(1, -2, -1)`: the diagonal becomes the last dim."""
    d1, d2 = canon_dim(dim1, a.ndim), canon_dim(dim2, a.ndim)
    if d1 == d2:
        raise RuntimeError("diagonal dimensions cannot be identical")
    n1, n2 = a.shape[d1], a.shape[d2]
    length = max(0, min(n1, n2 - offset) if offset >= 0 else min(n1 + offset, n2))
    rows = np.arange(length) + max(-offset, 0)
    cols = np.arange(length) + max(offset, 0)
    moved = jnp.moveaxis(a, (d1, d2), (-2, -1))
    return moved[..., rows, cols]


@register(aten.unfold.default)
def unfold(a, dimension, size, step):
    """`x.unfold(0, 3, 2)`: sliding windows of `size` every `step`, as a new last dim."""
    if a.ndim == 0:
        return a.reshape(1)
    dim = canon_dim(dimension, a.ndim)
    n = (a.shape[dim] - size) // step + 1
    idx = np.arange(n)[:, None] * step + np.arange(size)[None, :]
    taken = jnp.take(a, idx.reshape(-1), axis=dim).reshape(a.shape[:dim] + (n, size) + a.shape[dim + 1 :])
    return jnp.moveaxis(taken, dim + 1, -1)


def _strided_indices(size, stride, storage_offset) -> np.ndarray:
    idx = np.full(tuple(size), storage_offset or 0, dtype=np.int64)
    for d, (n, s) in enumerate(zip(size, stride)):
        shape = [1] * len(size)
        shape[d] = n
        idx = idx + (np.arange(n) * s).reshape(shape)
    return idx


@register(aten.as_strided.default)
def as_strided(a, size, stride, storage_offset=None):
    """`x.as_strided(size, stride, offset)` over `x`'s elements in row-major order (a gather)."""
    idx = _strided_indices(size, stride, storage_offset)
    if idx.size and (idx.max() >= max(a.size, 1) or idx.min() < 0):
        raise RuntimeError(
            f"as_strided: size {list(size)}, stride {list(stride)} and offset {storage_offset} "
            f"reach outside a tensor of {a.size} elements"
        )
    return a.reshape(-1)[idx] if idx.size else jnp.zeros(tuple(size), a.dtype)


@register(aten.view_as_real.default)
def view_as_real(a):
    """`torch.view_as_real(z)`: a trailing dim of (real, imag). Not writable through."""
    return jnp.stack([jnp.real(a), jnp.imag(a)], axis=-1)


@register(aten.view_as_complex.default)
def view_as_complex(a):
    """`torch.view_as_complex(x)`: the last dim (size 2) as (real, imag)."""
    if a.ndim == 0 or a.shape[-1] != 2:
        raise RuntimeError("view_as_complex: the last dimension must have size 2")
    return lax.complex(a[..., 0], a[..., 1])


# ---- scatters (functional inverses of the views) ------------------------------------------------
@register(aten.slice_scatter.default)
def slice_scatter(a, src, dim=0, start=None, end=None, step=1):
    """`torch.slice_scatter(x, src, 0, 1, 3)`: `x` with `x[1:3]` replaced by `src`."""
    return scatter_through(a, lambda v: slice_(v, dim, start, end, step), src)


@register(aten.select_scatter.default)
def select_scatter(a, src, dim, index):
    """`torch.select_scatter(x, src, 0, 1)`: `x` with `x[1]` replaced by `src`."""
    return scatter_through(a, lambda v: select(v, dim, index), src)


@register(aten.diagonal_scatter.default)
def diagonal_scatter(a, src, offset=0, dim1=0, dim2=1):
    """`torch.diagonal_scatter(x, src)`: `x` with its diagonal replaced by `src`."""
    return scatter_through(a, lambda v: diagonal(v, offset, dim1, dim2), src)


@register(aten.as_strided_scatter.default)
def as_strided_scatter(a, src, size, stride, storage_offset=None):
    """`torch.as_strided_scatter(x, src, size, stride)`."""
    return scatter_through(a, lambda v: as_strided(v, size, stride, storage_offset), src)


# ---- copies -------------------------------------------------------------------------------------
@register(aten.clone.default)
def clone(a, memory_format=None):
    """`x.clone()`: a fresh array (JAX arrays are immutable, so the copy is only logical)."""
    return jnp.array(a, copy=True)


@register(aten.alias_copy.default, aten.detach_copy.default)
def alias_copy(a):
    """`torch.alias_copy(x)`, `torch.detach_copy(x)`: a copy (autograd's detaching is torch's part)."""
    return jnp.array(a, copy=True)


def _view_copies() -> dict[OpOverload, OpOverload]:
    """Every functional `X_copy` overload torch tags `view_copy` -> the view overload `X` it copies
    (`select_copy.int` -> `select.int`); `.out` overloads are derived by the interpreter."""
    pairs = {}
    for name in all_op_names():
        base, _, overload = name.partition("::")[2].partition(".")
        if not name.startswith("aten::") or not base.endswith("_copy"):
            continue
        try:
            op = getattr(getattr(aten, base), overload or "default")
            view = getattr(getattr(aten, base[: -len("_copy")]), overload or "default")
        except (AttributeError, RuntimeError):
            continue
        storage = base in ("_reshape_alias_copy", "as_strided_copy")  # strides of the input's storage
        if torch.Tag.view_copy in op.tags and not op._schema.is_mutable and not storage:
            pairs[op] = view
    return pairs


def _copy_of(view: OpOverload) -> Callable:
    """The lowering of `X_copy`: `X`'s lowering, looked up at call time (arrays never alias, so the
    view's values are the copy's)."""

    def view_copy(*args, **kwargs):
        lowering = lookup(view)
        assert lowering is not None, f"{view}'s lowering was unregistered"
        return lowering(*args, **kwargs)

    view_copy.__name__ = view_copy.__qualname__ = f"{view._schema.name.split('::')[1]}_copy"
    return view_copy


def _decomposed(op: OpOverload) -> bool:
    """Whether torch decomposes `op` (`permute_copy`, `as_strided_copy`, `split_with_sizes_copy`, ...):
    those keep torch's decomposition, which routes the view through the interpreter's views (an
    `as_strided` of the input's storage, `out=` lists of tensors) and then copies."""
    key = DispatchKey.CompositeImplicitAutograd
    return op in decomposition_table or has_kernel_for_dispatch_key(op.name(), key)


for _copy_op, _view in _view_copies().items():  # views without a lowering (sparse, nested) stay out
    if lookup(_copy_op) is None and lookup(_view) is not None and not _decomposed(_copy_op):
        register(_copy_op)(_copy_of(_view))


@register(aten.copy.default)
def copy(a, src, non_blocking=False):
    """`aten.copy(a, src)`, the functional `a.copy_(src)` (functionalization and `torch.export` emit it):
    `src` cast to `a`'s dtype and broadcast to its shape."""
    return jnp.broadcast_to(jnp.asarray(src).astype(a.dtype), a.shape)


# ---- joining ------------------------------------------------------------------------------------
@register(aten.cat.default)
def cat(tensors, dim=0):
    """`torch.cat(ts, dim)`: dtypes promote; legacy 1-d empty tensors (shape `(0,)`) are skipped."""
    tensors = list(tensors)
    kept = [t for t in tensors if not (t.ndim == 1 and t.shape[0] == 0)]
    if not kept:
        return _promote_all(tensors)[0] if tensors else jnp.zeros((0,))
    dtype = _promote_all(tensors)[0].dtype
    kept = [t.astype(dtype) for t in kept]
    dim = canon_dim(dim, kept[0].ndim)
    return jnp.concatenate(kept, axis=dim)


@register(aten.stack.default)
def stack(tensors, dim=0):
    """`torch.stack(ts, dim)`."""
    tensors = _promote_all(list(tensors))
    return jnp.stack(tensors, axis=canon_dim(dim, tensors[0].ndim + 1))


@register(aten._chunk_cat.default)
def chunk_cat(tensors, dim, num_chunks):
    """`torch._chunk_cat`: chunk each tensor along `dim` (zero-padded to equal chunks), flatten the
    dims after `dim`, and concatenate chunk by chunk."""
    tensors = _promote_all(list(tensors))
    d = canon_dim(dim, tensors[0].ndim)
    parts = []
    for t in tensors:
        n = t.shape[d]
        chunk = -(-n // num_chunks)
        pad = chunk * num_chunks - n
        if pad:
            t = jnp.pad(t, [(0, 0)] * d + [(0, pad)] + [(0, 0)] * (t.ndim - d - 1))
        t = t.reshape(t.shape[:d] + (num_chunks, -1 if t.size else chunk * math.prod(t.shape[d + 1 :])))
        parts.append(t)
    return jnp.concatenate(parts, axis=d + 1)


@register(aten.block_diag.default)
def block_diag(tensors):
    """`torch.block_diag(a, b)`: 0-d tensors count as 1x1, 1-d as one row."""
    mats = [t.reshape(1, 1) if t.ndim == 0 else (t.reshape(1, -1) if t.ndim == 1 else t) for t in tensors]
    mats = _promote_all(mats)
    rows, cols = sum(m.shape[0] for m in mats), sum(m.shape[1] for m in mats)
    out = jnp.zeros((rows, cols), mats[0].dtype)
    r = c = 0
    for m in mats:
        out = out.at[r : r + m.shape[0], c : c + m.shape[1]].set(m)
        r, c = r + m.shape[0], c + m.shape[1]
    return out


# ---- reordering ---------------------------------------------------------------------------------
@register(aten.flip.default)
def flip(a, dims):
    """`x.flip((0, 1))`."""
    if a.ndim == 0:
        return a
    return jnp.flip(a, axis=tuple(canon_dim(d, a.ndim) for d in dims))


@register(aten.roll.default)
def roll(a, shifts, dims=()):
    """`x.roll(1, 0)`; with no dims, rolls the flattened tensor."""
    shifts, dims = list(shifts), list(dims)
    if not dims:
        return jnp.roll(a.reshape(-1), shifts[0]).reshape(a.shape)
    return jnp.roll(a, shifts, axis=tuple(canon_dim(d, a.ndim) for d in dims))


@register(aten.rot90.default)
def rot90(a, k=1, dims=(0, 1)):
    """`x.rot90(1, (0, 1))`: from the first dim towards the second."""
    d0, d1 = canon_dim(dims[0], a.ndim), canon_dim(dims[1], a.ndim)
    return jnp.rot90(a, k, axes=(d0, d1))


# ---- repeating ----------------------------------------------------------------------------------
@register(aten.repeat.default)
def repeat(a, repeats):
    """`x.repeat(2, 3)`: tile, with extra leading repeats adding dims."""
    repeats = tuple(repeats)
    if len(repeats) < a.ndim:  # jnp.tile would prepend ones: torch refuses
        raise RuntimeError("Number of dimensions of repeat dims can not be smaller than number of dimensions of tensor")
    a = a.reshape((1,) * (len(repeats) - a.ndim) + a.shape)
    return jnp.tile(a, repeats)


@register(aten.repeat_interleave.Tensor)
def repeat_interleave(repeats, output_size=None):
    """`torch.repeat_interleave(counts)`: index `i` repeated `counts[i]` times.

    Data-dependent unless `output_size` is given (then it works under `jax.jit`)."""
    idx = jnp.arange(repeats.shape[0], dtype=repeats.dtype)
    return jnp.repeat(idx, repeats, total_repeat_length=output_size)


# ---- padding ------------------------------------------------------------------------------------
def _pad_pairs(ndim: int, pad: Sequence[int]) -> list[tuple[int, int]]:
    """torch's flat pad list (last dim first) -> per-dim (lo, hi) pairs."""
    pairs = [(0, 0)] * ndim
    for i in range(len(pad) // 2):
        pairs[ndim - 1 - i] = (pad[2 * i], pad[2 * i + 1])
    return pairs


@register(aten.constant_pad_nd.default)
def constant_pad_nd(a, pad, value=0):
    """`F.pad(x, (1, 2), value=v)`: negative pads crop."""
    pairs = _pad_pairs(a.ndim, pad)
    return lax.pad(a, jnp.asarray(value).astype(a.dtype), [(lo, hi, 0) for lo, hi in pairs])


def _mode_pad(a, padding, mode: str):
    """Pad by gathering, per padded dim, the source index of each output position; negative
    pads crop (as torch's replicate padding allows)."""
    for d, (lo, hi) in enumerate(_pad_pairs(a.ndim, padding)):
        if lo == 0 and hi == 0:
            continue
        n = a.shape[d]
        i = np.arange(-lo, n + hi)
        if mode == "edge":
            i = np.clip(i, 0, n - 1)
        else:  # reflect, without repeating the edge
            if (lo >= n or hi >= n) and n > 0:
                raise RuntimeError(f"reflection padding ({lo}, {hi}) must be smaller than the input size {n}")
            i = np.abs(i)
            i = np.where(i > n - 1, 2 * (n - 1) - i, i)
        a = jnp.take(a, i, axis=d)
    return a


@register(aten.reflection_pad1d.default, aten.reflection_pad2d.default, aten.reflection_pad3d.default)
def reflection_pad(a, padding):
    """`F.pad(x, p, mode="reflect")`."""
    return _mode_pad(a, padding, "reflect")


@register(aten.replication_pad1d.default, aten.replication_pad2d.default, aten.replication_pad3d.default)
def replication_pad(a, padding):
    """`F.pad(x, p, mode="replicate")`; negative pads crop."""
    return _mode_pad(a, padding, "edge")


# ---- triangles and diagonals -----------------------------------------------------------------
@register(aten.tril.default)
def tril(a, diagonal=0):
    """`x.tril(k)`: over the last two dims."""
    return jnp.tril(a, diagonal)


@register(aten.triu.default)
def triu(a, diagonal=0):
    """`x.triu(k)`: over the last two dims."""
    return jnp.triu(a, diagonal)


@register(aten.diag_embed.default)
def diag_embed(a, offset=0, dim1=-2, dim2=-1):
    """`torch.diag_embed(x, offset, dim1, dim2)`: the last dim of `x` on diagonals of new dims."""
    nd = a.ndim + 1
    d1, d2 = canon_dim(dim1, nd), canon_dim(dim2, nd)
    n = a.shape[-1] + abs(offset)
    idx = np.arange(a.shape[-1])
    rows, cols = idx + max(-offset, 0), idx + max(offset, 0)
    out = jnp.zeros(a.shape[:-1] + (n, n), a.dtype).at[..., rows, cols].set(a)
    return jnp.moveaxis(out, (-2, -1), (d1, d2))


def _pad_backward(mode: str):
    def backward(grad_output, a, padding):
        _, vjp = jax.vjp(lambda x: _mode_pad(x, padding, mode), a)
        return vjp(grad_output.astype(a.dtype))[0]

    backward.__doc__ = f"The gradient of {mode} padding w.r.t. its input (what `loss.backward()` runs)."
    return backward


register(
    aten.reflection_pad1d_backward.default,
    aten.reflection_pad2d_backward.default,
    aten.reflection_pad3d_backward.default,
)(_pad_backward("reflect"))
register(
    aten.replication_pad1d_backward.default,
    aten.replication_pad2d_backward.default,
    aten.replication_pad3d_backward.default,
)(_pad_backward("edge"))


@register(aten.unfold_backward.default)
def unfold_backward(grad_in, input_sizes, dim, size, step):
    """The gradient of `unfold` w.r.t. its input: overlapping windows add up."""
    _, vjp = jax.vjp(lambda x: unfold(x, dim, size, step), jnp.zeros(tuple(input_sizes), grad_in.dtype))
    return vjp(grad_in)[0]
