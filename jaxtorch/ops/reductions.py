"""Reduction lowerings: sums, means, extrema, statistics, norms, cumulative ops, order statistics,
histograms, segment reductions and `hash_tensor`.

Torch's reduction semantics, kept here rather than in each op:

- `dim=None` or `dim=[]` reduces every dim; negative dims count from the end; a 0-dim
  tensor accepts dim 0 / -1 (see `_axes`).
- integer and bool sums/products accumulate in `int64` (`canonical_int()`); `mean`,
  `var`, `std` and norms refuse integer inputs the way torch does.
- extrema propagate NaN; reducing an empty dim with no identity raises `IndexError`.
- gradients follow torch: `amax`/`max()` share the gradient evenly among ties, while
  ops returning indices (`max.dim`, `median.dim`, `kthvalue`, `mode`, `cummax`) route it
  to the returned index, which is why they gather values from the input at that index.

Example:
    ```python
    import jax.numpy as jnp, torch, jaxtorch
    values, idx = jaxtorch.call_torch(lambda x: torch.max(x, dim=1), jnp.ones((2, 3)))
    ```
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import torch

from ..bridge.core._dtypes import canonical_int, default_float, to_torch_dtype
from ..bridge.core._registry import register
from ._accumulate import opmath
from ._semantics import canon_dim, canon_dims, category, result_type, to_real
from .sorting import stable_argsort

aten = torch.ops.aten
_BOOL, _INT, _FLOAT, _COMPLEX = 0, 1, 2, 3


# ---- shared helpers -----------------------------------------------------------------------
def _axes(a, dim) -> tuple[int, ...]:
    """Torch's reduction dims (`None`/`[]` = all, negative, 0-dim tensors) as JAX axes."""
    if a.ndim == 0:
        if dim is not None:
            for d in [dim] if isinstance(dim, int) else dim:
                canon_dim(d, 0)
        return ()
    return canon_dims(dim, a.ndim)


def _keep(out, a, axes, keepdim: bool):
    """`out` reduced over `axes` without keepdims -> torch's shape for `keepdim`."""
    return jnp.expand_dims(out, axes) if keepdim and axes else out


def _check_nonempty(name: str, a, axes, all_dims: bool = False) -> None:
    if a.size == 0 and all_dims:
        raise RuntimeError(
            f"{name}(): Expected reduction dim to be specified for input.numel() == 0. "
            "Specify the reduction dim with the 'dim' argument."
        )
    if a.size == 0:
        for ax in axes or range(a.ndim):
            if a.shape[ax] == 0:
                raise IndexError(f"{name}(): Expected reduction dim {ax} to have non-zero size.")


def _torch_name(dtype) -> str:
    return str(to_torch_dtype(dtype)).replace("torch.", "")


def _scalar_type_name(dtype) -> str:
    """ATen's name of a dtype in "not implemented for 'Long'" errors (an int32 array is named as
    the `long` it holds without x64: JAX's default integer)."""
    tdtype = to_torch_dtype(dtype)
    if tdtype == torch.int32 and np.dtype(dtype) == canonical_int():
        tdtype = torch.int64
    return torch.empty(0, dtype=tdtype).type()[len("torch.") : -len("Tensor")]


def _require_float(name: str, a, dtype=None) -> None:
    if category(dtype if dtype is not None else a.dtype) < _FLOAT:
        raise RuntimeError(
            f"{name}(): could not infer output dtype. Input dtype must be either a floating point or complex "
            f"dtype. Got: {_torch_name(a.dtype).capitalize()}"
        )


def _sum_dtype(a, dtype):
    """The accumulation dtype of sum/prod/cumsum: `dtype`, else int64 for bool/int inputs."""
    if dtype is not None:
        return np.dtype(dtype)
    return canonical_int() if category(a.dtype) < _FLOAT else a.dtype


def _along(a, dim: int, fn):
    """Apply `fn(x, axis)` along torch dim `dim`; 0-dim tensors are treated as shape (1,)."""
    if a.ndim == 0:
        canon_dim(dim, 0)
        out = fn(a.reshape(1), 0)
        return jax.tree_util.tree_map(lambda o: o.reshape(()), out)
    return fn(a, canon_dim(dim, a.ndim))


def _take(a, idx, axis: int, keepdim: bool):
    """Values of `a` at indices `idx` (keepdims shape) along `axis`: the gradient goes to `idx`."""
    out = jnp.take_along_axis(a, idx, axis=axis)
    return out if keepdim else jnp.squeeze(out, axis)


def _index(i):
    return i.astype(canonical_int())


# ---- sums, products, means ---------------------------------------------------------------
@register(aten.sum.default, aten.sum.dim_IntList)
@opmath
def sum_(a, dim=None, keepdim=False, *, dtype=None):
    """`torch.sum`; bool/int accumulate in int64. `sum_(jnp.ones(3, bool))` -> `3` (int64)."""
    return jnp.sum(a, axis=_axes(a, dim), keepdims=keepdim, dtype=_sum_dtype(a, dtype))


@register(aten.nansum.default)
@opmath
def nansum(a, dim=None, keepdim=False, *, dtype=None):
    """`torch.nansum`: NaNs count as zero."""
    if category(a.dtype) >= _FLOAT:
        a = jnp.where(jnp.isnan(a), jnp.zeros((), a.dtype), a)
    return sum_(a, dim, keepdim, dtype=dtype)


@register(aten.prod.default)
@opmath
def prod(a, *, dtype=None):
    """`torch.prod` of all elements; bool/int accumulate in int64."""
    return jnp.prod(a, dtype=_sum_dtype(a, dtype))


@register(aten.prod.dim_int)
@opmath
def prod_dim(a, dim, keepdim=False, *, dtype=None):
    return jnp.prod(a, axis=_axes(a, dim), keepdims=keepdim, dtype=_sum_dtype(a, dtype))


@register(aten.mean.default, aten.mean.dim)
@opmath
def mean(a, dim=None, keepdim=False, *, dtype=None):
    """`torch.mean`; integer inputs need an explicit float `dtype`, as in torch."""
    _require_float("mean", a, dtype)
    a = a.astype(dtype) if dtype is not None else a
    return jnp.mean(a, axis=_axes(a, dim), keepdims=keepdim)


@register(aten.nanmean.default)
@opmath
def nanmean(a, dim=None, keepdim=False, *, dtype=None):
    """`torch.nanmean`: the mean of the non-NaN elements."""
    if category(a.dtype) < _FLOAT:
        raise RuntimeError(
            f"nanmean(): expected input to have floating point or complex dtype but got "
            f"{_torch_name(a.dtype).capitalize()}"
        )
    a = a.astype(dtype) if dtype is not None else a
    axes = _axes(a, dim)
    count = jnp.sum(~jnp.isnan(a), axis=axes, keepdims=keepdim)
    return nansum(a, dim, keepdim) / count.astype(to_real(a.dtype))


# ---- extrema ------------------------------------------------------------------------------
@register(aten.amax.default)
def amax(a, dim=(), keepdim=False):
    """`torch.amax`: NaN-propagating; the gradient is shared evenly among tied maxima."""
    axes = _axes(a, dim)
    _check_nonempty("amax", a, axes, all_dims=not dim)
    return jnp.max(a, axis=axes, keepdims=keepdim)


@register(aten.amin.default)
def amin(a, dim=(), keepdim=False):
    axes = _axes(a, dim)
    _check_nonempty("amin", a, axes, all_dims=not dim)
    return jnp.min(a, axis=axes, keepdims=keepdim)


@register(aten.max.default)
def max_(a):
    """`torch.max(x)` over all elements (the gradient is shared among ties)."""
    if a.size == 0:
        raise RuntimeError(
            "max(): Expected reduction dim to be specified for input.numel() == 0. "
            "Specify the reduction dim with the 'dim' argument."
        )
    return jnp.max(a)


@register(aten.min.default)
def min_(a):
    if a.size == 0:
        raise RuntimeError(
            "min(): Expected reduction dim to be specified for input.numel() == 0. "
            "Specify the reduction dim with the 'dim' argument."
        )
    return jnp.min(a)


def _extreme_dim(name: str, arg, a, dim: int, keepdim: bool):
    def fn(x, axis):
        _check_nonempty(name, x, (axis,))
        idx = arg(x, axis=axis, keepdims=True)
        return _take(x, idx, axis, keepdim), _index(idx if keepdim else jnp.squeeze(idx, axis))

    return _along(a, dim, fn)


@register(aten.max.dim)
def max_dim(a, dim, keepdim=False):
    """`torch.max(x, dim)` -> (values, indices): first index of the maximum (NaN counts as largest)."""
    return _extreme_dim("max", jnp.argmax, a, dim, keepdim)


@register(aten.min.dim)
def min_dim(a, dim, keepdim=False):
    return _extreme_dim("min", jnp.argmin, a, dim, keepdim)


@register(aten.aminmax.default)
def aminmax(a, *, dim=None, keepdim=False):
    """`torch.aminmax` -> (min, max)."""
    axes = _axes(a, dim)
    if a.size == 0 and any(a.shape[ax] == 0 for ax in (axes or range(a.ndim))):
        raise RuntimeError(
            "aminmax(): cannot compute aminmax over an empty dimension as the operation has no identity."
        )
    if dim is None and keepdim:
        return jnp.min(a).reshape((1,) * a.ndim), jnp.max(a).reshape((1,) * a.ndim)
    return jnp.min(a, axis=axes, keepdims=keepdim), jnp.max(a, axis=axes, keepdims=keepdim)


def _arg_extreme(name: str, arg, a, dim, keepdim: bool):
    if dim is None:
        if a.size == 0:
            raise IndexError(f"{name}(): Expected reduction dim to be specified for input.numel() == 0.")
        out = arg(a.reshape(-1))
        return _index(out.reshape((1,) * a.ndim) if keepdim else out)

    def fn(x, axis):
        _check_nonempty(name, x, (axis,))
        return _index(arg(x, axis=axis, keepdims=keepdim))

    return _along(a, dim, fn)


@register(aten.argmax.default)
def argmax(a, dim=None, keepdim=False):
    """`torch.argmax`: the first index of the maximum (of the first NaN, if any)."""
    return _arg_extreme("argmax", jnp.argmax, a, dim, keepdim)


@register(aten.argmin.default)
def argmin(a, dim=None, keepdim=False):
    return _arg_extreme("argmin", jnp.argmin, a, dim, keepdim)


# ---- logical reductions and counts --------------------------------------------------------
def _logical_out(out, a):
    return out.astype(np.uint8) if a.dtype == np.uint8 else out


def _logical_axes(a, dim):
    """Like `_axes`, except that an empty dim list reduces nothing (torch's `all.dims`/`any.dims`)."""
    return () if isinstance(dim, (list, tuple)) and not dim else _axes(a, dim)


@register(aten.all.default, aten.all.dim, aten.all.dims)
def all_(a, dim=None, keepdim=False):
    """`torch.all`: bool result (uint8 for uint8 inputs); True over empty dims."""
    return _logical_out(jnp.all(a != 0, axis=_logical_axes(a, dim), keepdims=keepdim), a)


@register(aten.any.default, aten.any.dim, aten.any.dims)
def any_(a, dim=None, keepdim=False):
    return _logical_out(jnp.any(a != 0, axis=_logical_axes(a, dim), keepdims=keepdim), a)


@register(aten._is_any_true.default)
def _is_any_true(a):
    """`aten._is_any_true` (a bool tensor): what anomaly mode's NaN check calls on each gradient."""
    return jnp.any(a)


@register(aten._is_all_true.default)
def _is_all_true(a):
    """`aten._is_all_true` (a bool tensor): `torch._assert`-style checks on a tensor."""
    return jnp.all(a)


@register(aten.count_nonzero.default, aten.count_nonzero.dim_IntList)
def count_nonzero(a, dim=None):
    """`torch.count_nonzero` -> int64."""
    return jnp.sum(a != 0, axis=_axes(a, dim), dtype=canonical_int())


# ---- variance and standard deviation ------------------------------------------------------
def _correction(correction=None, unbiased=None) -> float:
    if correction is not None:
        return correction
    return 1 if unbiased is None or unbiased else 0


def _safe_sqrt(v):
    """sqrt whose gradient at 0 is 0, as torch's `std` backward masks it."""
    zero = v == 0
    return jnp.where(zero, 0, jnp.sqrt(jnp.where(zero, 1, v)))


@opmath
def _var_mean(a, dim, correction, keepdim: bool):
    if category(a.dtype) < _FLOAT:
        raise RuntimeError("std and var only support floating point and complex dtypes")
    axes = _axes(a, dim)
    n = math.prod(a.shape[ax] for ax in axes)
    m = jnp.mean(a, axis=axes, keepdims=True)
    d = a - m
    sq = (d.real * d.real + d.imag * d.imag) if category(a.dtype) == _COMPLEX else d * d
    denom = jnp.asarray(max(0, n - correction), sq.dtype)
    var = jnp.sum(sq, axis=axes, keepdims=keepdim) / denom
    return var, (m if keepdim else jnp.squeeze(m, axes))


def _var_args(dim_or_unbiased, unbiased, correction):
    """Normalize the `var.default(unbiased)` / `var.dim` / `var.correction` overload arguments."""
    if isinstance(dim_or_unbiased, bool):
        return None, _correction(correction, dim_or_unbiased)
    return dim_or_unbiased, _correction(correction, unbiased)


@register(aten.var.default, aten.var.dim, aten.var.correction)
def var(a, dim=None, unbiased=None, keepdim=False, *, correction=None):
    """`torch.var` with `correction` (default 1): sum((x - mean)^2) / max(0, N - correction)."""
    dim, c = _var_args(dim, unbiased, correction)
    return _var_mean(a, dim, c, keepdim)[0]


@register(aten.std.default, aten.std.dim, aten.std.correction)
def std(a, dim=None, unbiased=None, keepdim=False, *, correction=None):
    dim, c = _var_args(dim, unbiased, correction)
    return _safe_sqrt(_var_mean(a, dim, c, keepdim)[0])


@register(aten.var_mean.default, aten.var_mean.dim, aten.var_mean.correction)
def var_mean(a, dim=None, unbiased=None, keepdim=False, *, correction=None):
    """`torch.var_mean` -> (var, mean)."""
    dim, c = _var_args(dim, unbiased, correction)
    return _var_mean(a, dim, c, keepdim)


@register(aten.std_mean.default, aten.std_mean.dim, aten.std_mean.correction)
def std_mean(a, dim=None, unbiased=None, keepdim=False, *, correction=None):
    dim, c = _var_args(dim, unbiased, correction)
    v, m = _var_mean(a, dim, c, keepdim)
    return _safe_sqrt(v), m


# ---- logsumexp and norms ------------------------------------------------------------------
@register(aten.logsumexp.default)
@opmath
def logsumexp(a, dim=(), keepdim=False):
    """`torch.logsumexp`; integer inputs are computed in the default float dtype."""
    if category(a.dtype) < _FLOAT:
        a = a.astype(default_float())
    axes = _axes(a, dim)
    if a.size == 0:
        return jnp.full(jnp.sum(a, axis=axes, keepdims=keepdim).shape, -jnp.inf, a.dtype)
    return jax.nn.logsumexp(a, axis=axes, keepdims=keepdim)


def _norm_value(x, p: float, axes, keepdim: bool):
    a = jnp.abs(x)
    if p == 0:
        return jnp.sum(a != 0, axis=axes, keepdims=keepdim).astype(a.dtype)
    if p == math.inf:
        return jnp.max(a, axis=axes, keepdims=keepdim, initial=0 if a.size == 0 else None)
    if p == -math.inf:
        return jnp.min(a, axis=axes, keepdims=keepdim)
    if p == 1:
        return jnp.sum(a, axis=axes, keepdims=keepdim)
    if p == 2:
        return jnp.sqrt(jnp.sum(a * a, axis=axes, keepdims=keepdim))
    return jnp.sum(a**p, axis=axes, keepdims=keepdim) ** (1.0 / p)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2, 3))
def _vector_norm(x, p: float, axes: tuple, keepdim: bool):
    """The p-norm of real `x` over `axes`, with torch's gradient (0 where the norm is 0)."""
    return _norm_value(x, p, axes, keepdim)


@_vector_norm.defjvp
def _vector_norm_jvp(p, axes, keepdim, primals, tangents):
    (x,), (t,) = primals, tangents
    n = _norm_value(x, p, axes, True)
    a, sgn = jnp.abs(x), jnp.sign(x)
    zero = n == 0
    if p == 0:
        scale = jnp.zeros_like(x)
    elif p == 1:
        scale = sgn
    elif p == 2:
        scale = jnp.where(zero, 0, x / jnp.where(zero, 1, n))
    elif math.isinf(p):
        mask = (a == n) | jnp.isnan(a)
        scale = sgn * mask / jnp.sum(mask, axis=axes, keepdims=True)
    elif p < 1:
        scale = sgn * jnp.where(x == 0, 0, a ** (p - 1)) * n ** (1 - p)
    elif p < 2:
        scale = sgn * a ** (p - 1) * jnp.where(zero, 0, 1 / jnp.where(zero, 1, n ** (p - 1)))
    else:
        scale = x * a ** (p - 2) * jnp.where(zero, 0, 1 / jnp.where(zero, 1, n ** (p - 1)))
    out = n if keepdim else jnp.squeeze(n, axes)
    return out, jnp.sum(scale * t, axis=axes, keepdims=keepdim)


@opmath
def vector_norm(x, ord=2, dim=None, keepdim=False, *, dtype=None):
    """torch's `linalg.vector_norm` on a JAX array (real result; float/complex inputs only)."""
    if category(x.dtype) < _FLOAT:
        raise RuntimeError(
            f"linalg.vector_norm: Expected a floating point or complex tensor as input. "
            f"Got {_torch_name(x.dtype).capitalize()}"
        )
    if dtype is not None:
        x = x.astype(dtype)
    axes = _axes(x, dim)
    p = float(ord)
    if p < 0 and x.size == 0:
        raise RuntimeError(
            f"linalg.vector_norm cannot compute the {ord} norm on an empty tensor because the "
            "operation does not have an identity"
        )
    if category(x.dtype) == _COMPLEX:
        x = jnp.abs(x)
    return _vector_norm(x, p, axes, keepdim)


@register(aten.linalg_vector_norm.default)
def linalg_vector_norm(a, ord=2, dim=None, keepdim=False, *, dtype=None):
    """`torch.linalg.vector_norm`; the gradient is torch's (0 at a zero norm, shared among inf-norm ties)."""
    return vector_norm(a, ord, dim, keepdim, dtype=dtype)


@register(aten.norm.Scalar, aten.norm.ScalarOpt_dim, aten.norm.ScalarOpt_dtype, aten.norm.ScalarOpt_dim_dtype)
def norm(a, p=2, dim=None, keepdim=False, *, dtype=None):
    """`aten.norm` (`torch.norm` with a numeric `p`)."""
    return vector_norm(a, 2 if p is None else p, dim, keepdim, dtype=dtype)


@register(aten.frobenius_norm.dim)
def frobenius_norm(a, dim, keepdim=False):
    return vector_norm(a, 2, dim, keepdim)


@register(aten.dist.default)
@opmath
def dist(a, b, p=2):
    """`torch.dist`: the p-norm of `a - b` (broadcast, promoted)."""
    dt = result_type(a, b)
    return vector_norm(a.astype(dt) - b.astype(dt), p)


@register(aten.renorm.default)
@opmath
def renorm(a, p, dim, maxnorm):
    """`torch.renorm`: rescale each slice along `dim` whose p-norm exceeds `maxnorm`."""
    d = canon_dim(dim, a.ndim)
    axes = tuple(ax for ax in range(a.ndim) if ax != d)
    n = vector_norm(a, p, axes if axes else None, True) if axes else vector_norm(a, p, None, False)
    factor = jnp.where(n > maxnorm, maxnorm / (n + 1e-7), 1.0).astype(a.dtype)
    return a * factor


@register(aten.trace.default)
@opmath
def trace(a):
    """`torch.trace` of a matrix; bool/int accumulate in int64."""
    if a.ndim != 2:
        raise RuntimeError(f"trace: expected a matrix, but got tensor with dim {a.ndim}")
    if a.dtype == np.bool_:
        raise NotImplementedError("\"trace\" not implemented for 'Bool'")
    return jnp.trace(a, dtype=_sum_dtype(a, None))


# ---- cumulative ops -----------------------------------------------------------------------
@register(aten.cumsum.default)
@opmath
def cumsum(a, dim, *, dtype=None):
    """`torch.cumsum`; bool/int accumulate in int64."""
    dt = _sum_dtype(a, dtype)
    return _along(a.astype(dt), dim, lambda x, axis: jnp.cumsum(x, axis=axis))


@register(aten.cumprod.default)
@opmath
def cumprod(a, dim, *, dtype=None):
    dt = _sum_dtype(a, dtype)
    return _along(a.astype(dt), dim, lambda x, axis: jnp.cumprod(x, axis=axis))


@register(aten.logcumsumexp.default)
@opmath
def logcumsumexp(a, dim):
    """`torch.logcumsumexp` (a stable cumulative log-sum-exp)."""
    if category(a.dtype) < _FLOAT:
        a = a.astype(default_float())

    def fn(x, axis):
        if x.shape[axis] == 0:
            return x
        return jax.lax.cumlogsumexp(x, axis=axis)

    return _along(a, dim, fn)


def _cum_extreme(a, dim, better):
    """(values, indices) of a running extremum: NaN wins, and ties go to the later index (as torch)."""
    floating = category(a.dtype) >= _FLOAT

    def combine(left, right):
        (lv, li), (rv, ri) = left, right
        take_right = better(rv, lv) | (rv == lv)
        if floating:
            take_right = jnp.isnan(rv) | (~jnp.isnan(lv) & take_right)
        return jnp.where(take_right, rv, lv), jnp.where(take_right, ri, li)

    def fn(x, axis):
        if x.shape[axis] == 0:
            return x, jnp.zeros(x.shape, canonical_int())
        shape = [1] * x.ndim
        shape[axis] = x.shape[axis]
        pos = jnp.broadcast_to(jnp.arange(x.shape[axis], dtype=canonical_int()).reshape(shape), x.shape)
        _, idx = jax.lax.associative_scan(combine, (jax.lax.stop_gradient(x), pos), axis=axis)
        return jnp.take_along_axis(x, idx, axis=axis), idx

    return _along(a, dim, fn)


@register(aten.cummax.default)
def cummax(a, dim):
    """`torch.cummax` -> (values, indices); among equal maxima the last index, as torch."""
    return _cum_extreme(a, dim, lambda r, l: r > l)


@register(aten.cummin.default)
def cummin(a, dim):
    return _cum_extreme(a, dim, lambda r, l: r < l)


# ---- order statistics (built on a stable sort, NaN last) ----------------------------------
def _nan_count(x, axis):
    if category(x.dtype) < _FLOAT:
        return jnp.zeros(x.shape[:axis] + (1,) + x.shape[axis + 1 :], canonical_int())
    return jnp.sum(jnp.isnan(x), axis=axis, keepdims=True, dtype=canonical_int())


def _median_dim(a, dim, keepdim, ignore_nan: bool):
    def fn(x, axis):
        n = x.shape[axis]
        if n == 0:
            raise IndexError(f"median(): Expected reduction dim {axis} to have non-zero size.")
        order = stable_argsort(x, axis)
        nans = _nan_count(x, axis)
        if ignore_nan:
            k = jnp.maximum((n - nans - 1) // 2, 0)
            pos = jnp.take_along_axis(order, k, axis=axis)
        else:
            k = jnp.full_like(nans, (n - 1) // 2)
            pos = jnp.take_along_axis(order, k, axis=axis)
            if category(x.dtype) >= _FLOAT:  # any NaN: the first NaN is the median
                first_nan = jnp.argmax(jnp.isnan(x), axis=axis, keepdims=True).astype(pos.dtype)
                pos = jnp.where(nans > 0, first_nan, pos)
        return _take(x, pos, axis, keepdim), _index(pos if keepdim else jnp.squeeze(pos, axis))

    return _along(a, dim, fn)


def _median_all(a, ignore_nan: bool):
    if a.size == 0:
        return jnp.full((), jnp.nan, a.dtype)
    flat = a.reshape(-1)
    s = jnp.sort(flat)
    nans = jnp.sum(jnp.isnan(flat)) if category(a.dtype) >= _FLOAT else 0
    if ignore_nan:
        k = jnp.maximum((flat.size - nans - 1) // 2, 0)
    else:
        k = jnp.where(nans > 0, flat.size - 1, (flat.size - 1) // 2)
    value = s[k]
    # torch shares the gradient of median() evenly among the elements equal to it
    mask = (flat == value) | (jnp.isnan(flat) & jnp.isnan(value))
    w = jax.lax.stop_gradient(mask / jnp.maximum(jnp.sum(mask), 1))
    return jnp.where(jnp.isnan(value), value, jnp.sum(jnp.where(mask, flat, 0) * w.astype(a.dtype)))


@register(aten.median.default)
def median(a):
    """`torch.median(x)`: the lower median; NaN if any element is NaN."""
    if category(a.dtype) < _FLOAT:
        return jnp.sort(a.reshape(-1))[(a.size - 1) // 2]
    return _median_all(a, False)


@register(aten.nanmedian.default)
def nanmedian(a):
    if category(a.dtype) < _FLOAT:
        return median(a)
    return _median_all(a, True)


@register(aten.median.dim)
def median_dim(a, dim, keepdim=False):
    """`torch.median(x, dim)` -> (values, indices), the lower median."""
    return _median_dim(a, dim, keepdim, False)


@register(aten.nanmedian.dim)
def nanmedian_dim(a, dim, keepdim=False):
    return _median_dim(a, dim, keepdim, True)


# torch's CPU kthvalue runs its own quickselect (Sedgewick's median-of-three partition), so among
# equal values the index it returns is whichever that partitioning leaves at position k. The same
# algorithm here, with each Hoare partition done as vector ops: the left pointer's stops (values
# not below the pivot) pair up in order with the right pointer's stops (values not above it) and
# swap until the pointers cross, so a row takes O(log n) expected loop steps of O(n) work.
def _gt_or_nan(x, y):
    """torch's quickselect order: NaN above everything, else `>`."""
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return (jnp.isnan(x) & ~jnp.isnan(y)) | (x > y)
    return x > y


def _swap(a, idx, p, q, cond=True):
    """Swap positions `p` and `q` of values `a` and indices `idx` where `cond`."""
    ap, aq, ip, iq = a[p], a[q], idx[p], idx[q]
    a = a.at[p].set(jnp.where(cond, aq, ap)).at[q].set(jnp.where(cond, ap, aq))
    idx = idx.at[p].set(jnp.where(cond, iq, ip)).at[q].set(jnp.where(cond, ip, iq))
    return a, idx


def _quickselect_step(state, k: int):
    """One partition of torch's `quick_select_template` on the window [lo, hi] of a row."""
    a, idx, lo, hi = state
    n = a.shape[0]
    a, idx = _swap(a, idx, (lo + hi) >> 1, lo + 1)  # median of three: a[lo+1] <= a[lo] <= a[hi]
    a, idx = _swap(a, idx, lo + 1, hi, _gt_or_nan(a[lo + 1], a[hi]))
    a, idx = _swap(a, idx, lo, hi, _gt_or_nan(a[lo], a[hi]))
    a, idx = _swap(a, idx, lo + 1, lo, _gt_or_nan(a[lo + 1], a[lo]))
    piv, pos = a[lo], jnp.arange(n)
    left = (pos >= lo + 2) & (pos <= hi) & ~_gt_or_nan(piv, a)  # where `i++` stops
    right = (pos >= lo + 1) & (pos <= hi - 1) & ~_gt_or_nan(a, piv)  # where `j--` stops
    left_at = jnp.full((n + 2,), n + 1).at[jnp.where(left, jnp.cumsum(left) - 1, n + 2)].set(pos, mode="drop")
    right_rank = jnp.cumsum(right[::-1])[::-1] - 1
    right_at = jnp.full((n + 2,), -1).at[jnp.where(right, right_rank, n + 2)].set(pos, mode="drop")
    m = jnp.sum(left_at <= right_at)  # the swaps made before the pointers cross
    done = jnp.arange(n + 2) < m
    src = pos.at[jnp.where(done, left_at, n)].set(right_at, mode="drop")
    src = src.at[jnp.where(done, right_at, n)].set(left_at, mode="drop")
    a, idx = a[src], idx[src]

    def at(arr, r, default):
        return jnp.where(r >= 0, arr[jnp.clip(r, 0, n + 1)], default)

    # where the pointers stop when they cross: at the next stop, or at the last swapped slot
    # (two back when the last swap was a no-op of a pivot-equal value with itself)
    back = jnp.where((m >= 1) & (at(left_at, m - 1, n + 1) == at(right_at, m - 1, -1)), 2, 1)
    i = jnp.minimum(left_at[m], at(right_at, m - back, n + 1))
    j = jnp.maximum(right_at[m], at(left_at, m - back, -1))
    a, idx = _swap(a, idx, lo, j)
    return a, idx, jnp.where(j <= k, i, lo), jnp.where(j >= k, j - 1, hi)


def torch_quickselect_index(row, k: int):
    """The index of `row`'s (k+1)-th smallest value that torch's CPU `kthvalue` returns (k 0-based)."""
    n = row.shape[0]
    state = (row, jnp.arange(n), jnp.asarray(0), jnp.asarray(n - 1))
    a, idx, lo, hi = jax.lax.while_loop(lambda s: s[3] > s[2] + 1, lambda s: _quickselect_step(s, k), state)
    nxt = jnp.minimum(lo + 1, n - 1)
    a, idx = _swap(a, idx, lo, nxt, (hi == lo + 1) & _gt_or_nan(a[lo], a[nxt]))
    return idx[k]


@register(aten.kthvalue.default)
def kthvalue(a, k, dim=-1, keepdim=False):
    """`torch.kthvalue` -> (values, indices) of the k-th smallest element (1-based), ties as torch's CPU."""

    def fn(x, axis):
        _check_nonempty("kthvalue", x, (axis,))
        if not 1 <= k <= x.shape[axis]:
            raise RuntimeError(f"kthvalue(): selected number k out of range for dimension {axis}")
        rows = jnp.moveaxis(x, axis, -1)
        flat = rows.reshape(-1, rows.shape[-1])
        pos = jax.vmap(lambda r: torch_quickselect_index(r, k - 1))(flat).reshape(rows.shape[:-1] + (1,))
        pos = jnp.moveaxis(pos, -1, axis)
        return _take(x, pos, axis, keepdim), _index(pos if keepdim else jnp.squeeze(pos, axis))

    return _along(a, dim, fn)


@register(aten.mode.default)
def mode(a, dim=-1, keepdim=False):
    """`torch.mode` -> (values, indices): the smallest most frequent value and its last index."""

    def fn(x, axis):
        n = x.shape[axis]
        if n == 0:
            raise IndexError(f"mode(): Expected reduction dim {axis} to have non-zero size.")
        order = stable_argsort(x, axis)
        s = jnp.take_along_axis(x, order, axis=axis)
        pos = jnp.arange(n).reshape([n if ax == axis else 1 for ax in range(x.ndim)])
        prev = jax.lax.slice_in_dim(s, 0, n - 1, axis=axis)
        nxt = jax.lax.slice_in_dim(s, 1, n, axis=axis)
        start = jnp.pad(prev != nxt, [(1, 0) if ax == axis else (0, 0) for ax in range(x.ndim)], constant_values=True)
        end = jnp.pad(prev != nxt, [(0, 1) if ax == axis else (0, 0) for ax in range(x.ndim)], constant_values=True)
        run_start = jax.lax.cummax(jnp.where(start, pos, 0), axis=axis)
        freq = jnp.where(end, pos - run_start + 1, 0)
        best = jnp.argmax(freq, axis=axis, keepdims=True)
        idx = jnp.take_along_axis(order, best, axis=axis)
        return _take(x, idx, axis, keepdim), _index(idx if keepdim else jnp.squeeze(idx, axis))

    return _along(a, dim, fn)


# ---- histograms ---------------------------------------------------------------------------
@register(aten.histc.default)
def histc(a, bins=100, min=0, max=0):
    """`torch.histc`: `bins` equal-width bins over [min, max] (the data's range when min == max)."""
    if category(a.dtype) < _FLOAT:
        raise RuntimeError(f"\"histogram_cpu\" not implemented for '{_scalar_type_name(a.dtype)}'")
    lo, hi = jnp.asarray(min, a.dtype), jnp.asarray(max, a.dtype)
    if min == max and a.size:
        lo, hi = jnp.min(a), jnp.max(a)
    same = lo == hi
    lo, hi = jnp.where(same, lo - 1, lo), jnp.where(same, hi + 1, hi)
    flat = a.reshape(-1)
    inside = (flat >= lo) & (flat <= hi)
    pos = jnp.floor((flat - lo) * bins / (hi - lo)).astype(jnp.int32)
    pos = jnp.clip(pos, 0, bins - 1)
    return jnp.zeros((bins,), a.dtype).at[pos].add(inside.astype(a.dtype))


def _linspace(lo, hi, n: int):
    """torch's linspace: filled from both ends, so the last edge is exactly `hi`."""
    i = jnp.arange(n)
    step = (hi - lo) / max(n - 1, 1)
    return jnp.where(i < n // 2, lo + step * i, hi - step * (n - 1 - i))


def _histogramdd(points, edges: list, weight, density: bool):
    """Histogram of the rows of `points` (M, D) over per-dim increasing `edges`; rightmost bins are closed.

    A point outside the edges (or NaN) in any dim is dropped, as torch's kernel does.
    """
    shape = tuple(e.shape[0] - 1 for e in edges)
    inside = jnp.ones(points.shape[:1], bool)
    flat_index = jnp.zeros(points.shape[:1], jnp.int32)
    for d, e in enumerate(edges):
        col = points[:, d]
        pos = jnp.clip(jnp.searchsorted(e, col, side="right") - 1, 0, shape[d] - 1)
        inside = inside & (col >= e[0]) & (col <= e[-1])
        flat_index = flat_index * shape[d] + pos
    dt = points.dtype
    w = inside.astype(dt) if weight is None else jnp.where(inside, weight.reshape(-1).astype(dt), 0)
    hist = jnp.zeros((math.prod(shape),), dt).at[flat_index].add(w).reshape(shape)
    if density:
        hist = hist / jnp.sum(hist)
        for d, e in enumerate(edges):
            hist = hist / jnp.diff(e).reshape([-1 if k == d else 1 for k in range(len(edges))])
    return hist


def _histogram(a, edges, weight, density: bool):
    return _histogramdd(a.reshape(-1, 1), [edges], weight, density), edges


@register(aten.histogram.bin_ct)
def histogram(a, bins=100, *, range=None, weight=None, density=False):
    """`torch.histogram` with a bin count -> (hist, bin_edges); the data's range unless `range` is given."""
    if range is not None:
        lo, hi = jnp.asarray(range[0], a.dtype), jnp.asarray(range[1], a.dtype)
    elif a.size == 0:
        lo, hi = jnp.zeros((), a.dtype), jnp.ones((), a.dtype)
    else:
        lo, hi = jnp.min(a), jnp.max(a)
    same = lo == hi
    lo, hi = jnp.where(same, lo - 0.5, lo), jnp.where(same, hi + 0.5, hi)
    return _histogram(a, _linspace(lo, hi, bins + 1).astype(a.dtype), weight, density)


@register(aten.histogram.bins_tensor)
def histogram_edges(a, bins, *, weight=None, density=False):
    """`torch.histogram` with explicit (increasing) bin edges -> (hist, bin_edges)."""
    return _histogram(a, bins.astype(a.dtype), weight, density)


def _points(a):
    """histogramdd's input (..., D) as (M, D) points."""
    if category(a.dtype) < _FLOAT:
        raise RuntimeError(f"\"histogramdd\" not implemented for '{_scalar_type_name(a.dtype)}'")
    return a.reshape(-1, a.shape[-1])


@register(aten._histogramdd_bin_edges.default)
def histogramdd_bin_edges(a, bins, *, range=None, weight=None, density=False):
    """`torch.histogramdd`'s edges for bin counts: per dim, `bins[d] + 1` edges over `range` or the data's range."""
    points = _points(a)
    if len(bins) != points.shape[1]:
        raise RuntimeError(
            f"torch.histogramdd: expected {points.shape[1]} sequences of bin edges for each of the "
            f"{points.shape[1]} dimensions of the input, but got {len(bins)}"
        )
    if range is not None:
        lo = jnp.asarray(range[0::2], points.dtype)
        hi = jnp.asarray(range[1::2], points.dtype)
    elif points.shape[0] == 0:
        lo, hi = jnp.zeros((points.shape[1],), points.dtype), jnp.ones((points.shape[1],), points.dtype)
    else:
        lo, hi = jnp.min(points, axis=0), jnp.max(points, axis=0)
    same = lo == hi
    lo, hi = jnp.where(same, lo - 0.5, lo), jnp.where(same, hi + 0.5, hi)
    return [_linspace(lo[d], hi[d], n + 1).astype(points.dtype) for d, n in enumerate(bins)]


@register(aten._histogramdd_from_bin_cts.default)
def histogramdd_from_bin_cts(a, bins, *, range=None, weight=None, density=False):
    """`torch.histogramdd`'s histogram for bin counts (edges as in `histogramdd_bin_edges`)."""
    edges = histogramdd_bin_edges(a, bins, range=range)
    return _histogramdd(_points(a), edges, weight, density)


@register(aten._histogramdd_from_bin_tensors.default)
def histogramdd_from_bin_tensors(a, bins, *, weight=None, density=False):
    """`torch.histogramdd`'s histogram for explicit per-dim bin edges."""
    points = _points(a)
    return _histogramdd(points, [b.astype(points.dtype) for b in bins], weight, density)


@register(aten.bincount.default, data_dependent=True)
def bincount(a, weights=None, minlength=0):
    """`torch.bincount` (eager only: its length is `max(a) + 1`). Int weights give float32, not float64."""
    if a.ndim != 1:
        raise RuntimeError("bincount only supports 1-d non-negative integral inputs.")
    if a.size and int(jnp.min(a)) < 0:
        raise RuntimeError("bincount only supports 1-d non-negative integral inputs.")
    length = max(int(jnp.max(a)) + 1 if a.size else 0, minlength)
    if weights is None:
        return jnp.zeros((length,), canonical_int()).at[a].add(1)
    wdt = weights.dtype if category(weights.dtype) >= _FLOAT else default_float()
    return jnp.zeros((length,), wdt).at[a].add(weights.astype(wdt))


# ---- whole-tensor comparisons returning a Python bool (values decide: eager only) ----------
@register(aten.equal.default, data_dependent=True)
def equal(a, b):
    """`torch.equal`: same shape and same values (a Python bool)."""
    return a.shape == b.shape and bool(jnp.array_equal(a, b))


@register(aten.allclose.default, data_dependent=True)
def allclose(a, b, rtol=1e-05, atol=1e-08, equal_nan=False):
    """`torch.allclose` (a Python bool)."""
    return bool(jnp.allclose(a, b, rtol=rtol, atol=atol, equal_nan=equal_nan))


# ---- segment reductions -------------------------------------------------------------------
def _segment_ids(lengths, n: int):
    """Segment id of each of `n` positions for contiguous segments of `lengths` (`len(lengths)` past the end)."""
    ends = jnp.cumsum(lengths)
    return jnp.searchsorted(ends, jnp.arange(n), side="right")


def _segment_prod(x, ids, lengths):
    """Per-segment product of the rows of `x` (contiguous segments), by a segmented scan (differentiable)."""
    start = jnp.concatenate([jnp.ones((1,), bool), ids[1:] != ids[:-1]]) if x.shape[0] else jnp.zeros((0,), bool)
    start = start.reshape((-1,) + (1,) * (x.ndim - 1))

    def combine(left, right):
        (fl, vl), (fr, vr) = left, right
        return fl | fr, jnp.where(fr, vr, vl * vr)

    _, running = jax.lax.associative_scan(combine, (jnp.broadcast_to(start, x.shape), x))
    last = jnp.clip(jnp.cumsum(lengths) - 1, 0, max(x.shape[0] - 1, 0))
    picked = jnp.take(running, last, axis=0) if x.shape[0] else jnp.ones((lengths.shape[0],) + x.shape[1:], x.dtype)
    return jnp.where((lengths > 0).reshape((-1,) + (1,) * (x.ndim - 1)), picked, jnp.ones((), x.dtype))


def _segment_reduce_rows(x, lengths, reduce: str, initial):
    """One row of `segment_reduce`: `x` is (N, ...) grouped along axis 0 into `len(lengths)` segments."""
    s = lengths.shape[0]
    ids = _segment_ids(lengths, x.shape[0])
    per_row = (-1,) + (1,) * (x.ndim - 1)
    init = None if initial is None else jnp.asarray(initial, x.dtype)
    if reduce in ("sum", "mean"):
        out = jax.ops.segment_sum(x, ids, s, indices_are_sorted=True)
        if init is not None:
            out = init + out
        if reduce == "mean":
            n = lengths.reshape(per_row)
            empty = jnp.nan if init is None else init
            out = jnp.where(n > 0, out / jnp.maximum(n, 1).astype(x.dtype), empty)
        return out
    if reduce in ("max", "min"):
        seg = jax.ops.segment_max if reduce == "max" else jax.ops.segment_min
        out = seg(x, ids, s, indices_are_sorted=True)
        has_nan = jax.ops.segment_sum(jnp.isnan(x).astype(jnp.int32), ids, s, indices_are_sorted=True) > 0
        out = jnp.where(has_nan, jnp.nan, out)
        if init is not None:
            out = (jnp.maximum if reduce == "max" else jnp.minimum)(init, out)
        return out
    if reduce == "prod":
        out = _segment_prod(x, ids, lengths)
        return out if init is None else init * out
    raise RuntimeError(f"unsupported reduction given! {reduce}")


@register(aten.segment_reduce.default)
def segment_reduce(data, reduce, *, lengths=None, indices=None, offsets=None, axis=0, unsafe=False, initial=None):
    """`torch.segment_reduce`: reduce contiguous segments along `axis`, given `lengths` or `offsets`.

    `lengths` (or `offsets`, one longer) has shape `data.shape[:axis] + (segments,)`; the number of
    segments is static. Empty segments give `initial`, else the reduction's identity (NaN for mean).

    **Example:** `segment_reduce(x, "sum", lengths=torch.tensor([2, 0, 3]))` on 5 values -> 3 sums.
    """
    if category(data.dtype) < _FLOAT:
        raise RuntimeError(f"\"_segment_reduce_cpu\" not implemented for '{_scalar_type_name(data.dtype)}'")
    if indices is not None:
        raise RuntimeError("segment_reduce(): indices based reduction is not supported yet.")
    if lengths is None:
        if offsets is None:
            raise RuntimeError("segment_reduce(): Either lengths or offsets must be defined")
        lengths = jnp.diff(offsets, axis=-1)
    axis = canon_dim(axis, data.ndim)
    if lengths.ndim != axis + 1:
        raise RuntimeError(f"Expected axis to be the last dimension of lengths but got {axis}.")
    outer = data.shape[:axis]
    x = data.reshape((math.prod(outer),) + data.shape[axis:])
    ls = lengths.reshape((math.prod(outer), lengths.shape[-1]))
    out = jax.vmap(lambda xr, lr: _segment_reduce_rows(xr, lr, reduce, initial))(x, ls)
    return out.reshape(outer + out.shape[1:])


# ---- hash_tensor --------------------------------------------------------------------------
def _float64_words(x):
    """(high, low) uint32 words of float32 `x` widened to float64, built from its bits.

    Built by hand because XLA's CPU convert flushes float32 subnormals to zero, while torch
    widens them exactly: a subnormal's bits below its leading one (position `p`) become the
    float64 mantissa, shifted up by `52 - p`.
    """
    u32 = jnp.uint32
    b = jax.lax.bitcast_convert_type(x.astype(jnp.float32), u32)
    sign, exp, mant = b & u32(0x80000000), (b >> 23) & u32(0xFF), b & u32(0x7FFFFF)
    mant = jnp.where((exp == 255) & (mant != 0), mant | u32(0x400000), mant)  # widening quiets a NaN
    # normal, zero, inf, NaN: the exponent rebiased (127 -> 1023), the mantissa shifted up by 29
    wide_exp = jnp.where(exp == 255, u32(0x7FF), jnp.where(exp == 0, u32(0), exp + u32(896)))
    hi, lo = sign | (wide_exp << 20) | (mant >> 3), (mant & u32(7)) << 29
    # subnormal float32 -> normal float64
    p = u32(31) - jax.lax.clz(mant)
    frac = mant - jax.lax.shift_left(u32(1), p)
    sub_hi = jnp.where(
        p >= 20,
        jax.lax.shift_right_logical(frac, jnp.maximum(p, u32(20)) - u32(20)),
        jax.lax.shift_left(frac, u32(20) - jnp.minimum(p, u32(20))),
    )
    sub_hi = sign | ((p + u32(874)) << 20) | sub_hi
    sub_lo = jax.lax.shift_left(frac, u32(52) - p)  # a shift past 31 gives 0
    subnormal = (exp == 0) & (mant != 0)
    return jnp.where(subnormal, sub_hi, hi), jnp.where(subnormal, sub_lo, lo)


def _hash_words(a):
    """Each element as torch's 64-bit word (float64 / int64 bits); its low 32 bits when x64 is off."""
    floating = category(a.dtype) >= _FLOAT
    x64 = canonical_int() == np.dtype("int64")
    if floating and a.dtype == np.dtype("float64"):
        return jax.lax.bitcast_convert_type(a, jnp.uint64)
    if floating:
        hi, lo = _float64_words(a)
        return (hi.astype(jnp.uint64) << 32) | lo.astype(jnp.uint64) if x64 else lo
    if x64:
        return jax.lax.bitcast_convert_type(a.astype(jnp.int64), jnp.uint64)
    if a.dtype == np.dtype("uint32"):  # a narrowed uint64
        return a
    return jax.lax.bitcast_convert_type(a.astype(jnp.int32), jnp.uint32)


@register(aten.hash_tensor.default)
def hash_tensor(a, dim=(), *, keepdim=False, mode=0):
    """`torch.hash_tensor`: xor of the elements' 64-bit patterns (floats as float64, ints as int64).

    The result is `torch.uint64`. With JAX's x64 off it is held as uint32, like every 64-bit
    integer there, and holds the low 32 bits of torch's hash.

    **Example:** `torch.hash_tensor(torch.tensor([1, 3]))` -> `tensor(2, dtype=torch.uint64)`.
    """
    if mode != 0:
        raise RuntimeError(f"Unknown hash_tensor mode: {mode}")
    axes = _axes(a, dim)
    _check_nonempty("hash_tensor", a, axes, all_dims=not dim)
    words = _hash_words(a)
    out = jax.lax.reduce(words, jnp.zeros((), words.dtype), jax.lax.bitwise_xor, axes)
    return _keep(out, a, axes, keepdim)
