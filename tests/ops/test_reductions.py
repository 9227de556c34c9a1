"""Reduction and sorting lowerings (`jaxtorch/ops/reductions.py`, `sorting.py`) against eager CPU torch.

Covers what the OpInfo samples leave out: empty dims, keepdim, negative dims, result dtypes,
NaN handling, ties, torch's error paths, `out=` and in-place variants through the
interpreter, gradients that must match torch's tie rules, and data-dependent ops under jit.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxtorch
from jaxtorch import DataDependentError

from . import _compare

NAN = float("nan")


_jax = _compare.to_jax
_run = _compare.run


def _check(ref, got, tol=1e-5):
    _compare.compare(ref, got, tol)


def check(fn, *tensors, jit=True):
    """`fn` on CPU torch == `fn` through jaxtorch, eagerly and (unless jit=False) under jax.jit."""
    _compare.check(fn, *tensors, jit=jit, tol=1e-5)


def check_raises(fn, *tensors):
    """jaxtorch raises the same exception type as torch."""
    with pytest.raises(Exception) as ref:
        fn(*tensors)
    with pytest.raises(ref.type):
        _run(fn, *tensors)


def check_grad(fn, t: torch.Tensor, tol=1e-5):
    """jax.grad of sum(fn(x) * cot) equals torch.autograd's, for the first float output of `fn`."""
    x = t.clone().requires_grad_(True)
    out = fn(x)
    out = out[0] if isinstance(out, tuple) else out
    cot = torch.randn(out.shape)
    (ref,) = torch.autograd.grad((out * cot).sum(), x, allow_unused=True)
    ref = torch.zeros_like(t) if ref is None else ref

    def loss(a):
        o = jaxtorch.call_torch(fn, a)
        o = o[0] if isinstance(o, (tuple, list)) else o
        return jnp.sum(o * _jax(cot))

    np.testing.assert_allclose(np.asarray(jax.grad(loss)(_jax(t))), ref.numpy(), rtol=tol, atol=tol)


X = torch.randn(3, 4, 5)
XI = torch.randint(-5, 6, (3, 4, 5))
XB = torch.randint(0, 2, (3, 4, 5)).bool()
EMPTY = torch.zeros(0, 3)


# ---- sums, products, means: dims, keepdim, dtypes -----------------------------------------
@pytest.mark.parametrize("dim", [None, 0, -1, (0, 2), [-1, -3], []])
@pytest.mark.parametrize("keepdim", [False, True])
@pytest.mark.parametrize("op", [torch.sum, torch.nansum, torch.mean])
def test_sum_like_dims(op, dim, keepdim):
    if dim is None:
        check(lambda x: op(x), X)
    else:
        check(lambda x: op(x, dim, keepdim=keepdim), X)


@pytest.mark.parametrize("t", [XI, XB, XI.to(torch.int32), XI.abs().to(torch.uint8)], ids=["i64", "bool", "i32", "u8"])
def test_integer_sums_accumulate_in_int64(t):
    check(lambda x: torch.sum(x), t)
    check(lambda x: torch.sum(x, 1), t)
    check(lambda x: torch.prod(x, 2), t)
    check(lambda x: torch.cumsum(x, 0), t)
    check(lambda x: torch.nansum(x), t)
    if t.dtype == torch.bool:
        check_raises(lambda x: torch.trace(x[0]), t)
    else:
        check(lambda x: torch.trace(x[0]), t)


def test_sum_dtype_argument():
    check(lambda x: torch.sum(x, dtype=torch.int32), XI)
    check(lambda x: torch.sum(x, 1, dtype=torch.float32), XI)
    check(lambda x: torch.mean(x, 1, dtype=torch.float32), XI)
    check(lambda x: torch.prod(x, dtype=torch.float32), XB)
    check(lambda x: torch.cumprod(x, 1, dtype=torch.float32), XI)


def test_empty_reductions_give_identities():
    check(lambda x: torch.sum(x, 0), EMPTY)
    check(lambda x: torch.prod(x, 0), EMPTY)
    check(lambda x: torch.mean(x, 0), EMPTY)
    check(lambda x: torch.all(x, 0), EMPTY)
    check(lambda x: torch.any(x, 0), EMPTY)
    check(lambda x: torch.logsumexp(x, 0), EMPTY)
    check(lambda x: torch.amax(x, 1), EMPTY)
    check(lambda x: torch.count_nonzero(x), EMPTY)
    check(lambda x: torch.cumsum(x, 0), EMPTY)
    check(lambda x: torch.median(x), EMPTY)


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: torch.amax(x, 0),
        lambda x: torch.amin(x),
        lambda x: torch.max(x),
        lambda x: torch.min(x),
        lambda x: torch.max(x, 0),
        lambda x: torch.argmax(x, 0),
        lambda x: torch.argmin(x),
        lambda x: torch.aminmax(x),
        lambda x: torch.kthvalue(x, 1, 0),
    ],
    ids=["amax", "amin", "max", "min", "max.dim", "argmax", "argmin", "aminmax", "kthvalue"],
)
def test_empty_extrema_raise_like_torch(fn):
    check_raises(fn, EMPTY)


def test_integer_mean_var_norm_raise_like_torch():
    check_raises(torch.mean, XI)
    check_raises(torch.var, XI)
    check_raises(torch.std, XI)
    check_raises(lambda x: torch.linalg.vector_norm(x), XI)
    check_raises(lambda x: torch.nanmean(x), XI)
    check_raises(lambda x: torch.trace(x), XI)  # 3-d


def test_zero_dim_tensor_accepts_dim_0_and_minus_1():
    s = torch.tensor(2.5)
    check(lambda x: torch.sum(x, 0), s)
    check(lambda x: torch.max(x, -1), s)
    check(lambda x: torch.argmax(x, 0, keepdim=True), s)
    check(lambda x: torch.cumsum(x, 0), s)
    check(lambda x: torch.sort(x), s)
    check_raises(lambda x: torch.sum(x, 1), s)


def test_bad_dim_raises_index_error():
    check_raises(lambda x: torch.sum(x, 3), X)
    check_raises(lambda x: torch.max(x, -4), X)


# ---- extrema, NaN, ties -------------------------------------------------------------------
XN = torch.tensor([[1.0, NAN, 3.0, 3.0], [2.0, 5.0, 5.0, -1.0], [NAN, 0.0, NAN, 7.0]])


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: torch.amax(x, 1),
        lambda x: torch.amin(x, 0, keepdim=True),
        lambda x: torch.max(x),
        lambda x: torch.max(x, 1),
        lambda x: torch.min(x, 0, keepdim=True),
        lambda x: torch.argmax(x, 1),
        lambda x: torch.argmin(x),
        lambda x: torch.argmax(x, keepdim=True),
        lambda x: torch.aminmax(x, dim=1),
        lambda x: torch.cummax(x, 1),
        lambda x: torch.cummin(x, 0),
        lambda x: torch.sort(x, 1),
        lambda x: torch.sort(x, 1, descending=True),
        lambda x: torch.median(x, 1),
        lambda x: torch.nanmedian(x, 1),
        lambda x: torch.median(x),
        lambda x: torch.nanmedian(x),
        lambda x: torch.nansum(x, 1),
        lambda x: torch.nanmean(x, 0),
        lambda x: torch.topk(x[1:], 2, 1),
    ],
)
def test_nan_handling_matches_torch(fn):
    check(fn, XN)


def test_ties_pick_torch_indices():
    t = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0], [2.0, 2.0, 2.0, 2.0, 2.0]])
    check(lambda x: torch.max(x, 1), t)  # first maximum
    check(lambda x: torch.argmin(x, 1), t)
    check(lambda x: torch.cummax(x, 1), t)  # last index among equal maxima
    check(lambda x: torch.cummin(x, 1), t)
    check(lambda x: torch.mode(x, 1), t)
    check(lambda x: torch.sort(x, dim=1, stable=True), t)
    check(lambda x: torch.sort(x, dim=1, descending=True, stable=True), t)
    check(lambda x: torch.argsort(x, dim=1, stable=True), t)


def test_cummax_on_int_and_bool():
    check(lambda x: torch.cummax(x, 2), XI)
    check(lambda x: torch.cummin(x, -1), XB)


def test_mode_picks_smallest_most_frequent_value():
    check(lambda x: torch.mode(x), torch.tensor([2.0, 1.0, 2.0, 1.0, 3.0]))
    check(lambda x: torch.mode(x, 0, keepdim=True), torch.randint(0, 3, (7, 4)))


def test_median_is_the_lower_median():
    check(lambda x: torch.median(x), torch.tensor([4.0, 1.0, 3.0, 2.0]))
    check(lambda x: torch.median(x, -1, keepdim=True), torch.randn(3, 6))
    check(lambda x: torch.nanmedian(x, 0), torch.tensor([[NAN, 1.0], [NAN, NAN], [NAN, 2.0]]))


def test_kthvalue_and_topk():
    t = torch.randn(4, 7)
    check(lambda x: torch.kthvalue(x, 3, 1), t)
    check(lambda x: torch.kthvalue(x, 2, 0, keepdim=True), t)
    check(lambda x: torch.topk(x, 3), t)
    check(lambda x: torch.topk(x, 2, 0, largest=False), t)
    check_raises(lambda x: torch.kthvalue(x, 8, 1), t)
    check_raises(lambda x: torch.topk(x, 8), t)


# ---- statistics and norms -----------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"dim": 1},
        {"dim": (0, 2), "keepdim": True},
        {"correction": 0},
        {"dim": -1, "correction": 2},
        {"unbiased": False},
    ],
)
@pytest.mark.parametrize("op", [torch.var, torch.std, torch.var_mean, torch.std_mean])
def test_var_std(op, kwargs):
    check(lambda x: op(x, **kwargs), X)


def test_var_with_too_few_elements_is_nan_or_inf():
    with pytest.warns(UserWarning):
        check(lambda x: torch.var(x, 0), torch.tensor([[1.0, 2.0]]))
    with pytest.warns(UserWarning):
        check(lambda x: torch.var(x, correction=3), torch.tensor([1.0, 2.0]))


@pytest.mark.parametrize("ord", [2, 1, 0, 3, 0.5, math.inf, -math.inf, -1])
def test_vector_norm_values_and_grads(ord):
    t = torch.tensor([[0.0, -2.0, 3.0], [1.0, -3.0, 0.5]])
    check(lambda x: torch.linalg.vector_norm(x, ord), t)
    check(lambda x: torch.linalg.vector_norm(x, ord, dim=1, keepdim=True), t)
    if ord not in (0.5, -1, -math.inf):  # torch's gradient at the zero entry is inf/nan there
        check_grad(lambda x: torch.linalg.vector_norm(x, ord, dim=1), t)


def test_norm_gradient_is_zero_at_zero():
    z = torch.zeros(2, 3)
    check_grad(lambda x: torch.linalg.vector_norm(x), z)
    check_grad(lambda x: torch.norm(x, dim=1), z)
    check_grad(lambda x: torch.std(x, 1), z)
    check_grad(lambda x: torch.dist(x, torch.zeros(3)), z)


def test_norm_variants():
    check(lambda x: torch.norm(x), X)
    check(lambda x: torch.norm(x, p="fro", dim=(0, 1)), X)
    check(lambda x: torch.norm(x, p=1, dim=2, keepdim=True), X)
    check(lambda x: torch.dist(x, torch.ones(5), 3), X)
    check(lambda x: torch.renorm(x, 2, 0, 1.0), X)
    check(lambda x: torch.logsumexp(x, (0, 2)), X)
    check(lambda x: torch.logsumexp(x, 1), XI)  # int -> float
    check(lambda x: torch.logsumexp(x, 0), torch.full((3, 2), -math.inf))


# ---- gradients with torch's tie rules -----------------------------------------------------
TIES = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, -1.0, 2.0]])


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: torch.amax(x, 1),  # shared evenly among ties
        lambda x: torch.max(x),
        lambda x: torch.max(x, 1),  # to the returned index
        lambda x: torch.min(x, 1, keepdim=True),
        lambda x: torch.cummax(x, 1),
        lambda x: torch.sort(x, dim=1, stable=True),
        lambda x: torch.mode(x, 1),
        lambda x: torch.median(x),
        lambda x: torch.linalg.vector_norm(x, math.inf, dim=1),
        lambda x: torch.prod(torch.tensor([[0.0, 2.0, 3.0, 0.0], [0.0, 1.0, 2.0, 4.0]]) * x, 1),
        lambda x: torch.cumprod(torch.tensor([1.0, 0.0, 2.0, 3.0]) * x, 1),
        lambda x: torch.logcumsumexp(x, 1),
        lambda x: torch.var(x, 1),
        lambda x: torch.renorm(x, 2, 0, 2.0),
    ],
)
def test_gradients_match_torch(fn):
    check_grad(fn, TIES)


# ---- logical reductions, cumulative ops, histograms ---------------------------------------
def test_all_any_count_nonzero():
    for t in (X, XI, XB):
        check(lambda x: torch.all(x, 1), t)
        check(lambda x: torch.any(x, (0, 2), keepdim=True), t)
        check(lambda x: torch.count_nonzero(x, (0, 1)), t)
    check(lambda x: torch.all(x), XI.to(torch.uint8))  # uint8 in, uint8 out
    check(lambda x: torch.all(x, dim=[]), XI)  # an empty dim list reduces nothing
    check(lambda x: torch.any(x, dim=[]), XI.abs().to(torch.uint8))


def test_cumulative_ops():
    check(lambda x: torch.cumsum(x, -1), X)
    check(lambda x: torch.cumprod(x, 1), X)
    check(lambda x: torch.logcumsumexp(x, 0), X)
    check(lambda x: torch.logcumsumexp(x, 0), torch.tensor([-math.inf, 0.0, -math.inf, 1.0]))


def test_histc():
    check(lambda x: torch.histc(x, bins=7), X)
    check(lambda x: torch.histc(x, bins=4, min=-1, max=1), X)
    check(lambda x: torch.histc(x, bins=3), torch.full((4,), 2.0))


def test_histogram():
    t = torch.randn(50)
    w = torch.rand(50)
    check(lambda x: torch.histogram(x, bins=6), t)
    check(lambda x: torch.histogram(x, bins=4, range=(-1.0, 1.0), density=True), t)
    check(lambda x, y: torch.histogram(x, bins=5, weight=y), t, w)
    check(lambda x: torch.histogram(x, bins=torch.tensor([-2.0, -0.5, 0.0, 3.0])), t)
    check(lambda x: torch.histogram(x, bins=2), torch.tensor([2.0, 2.0]))  # equal values: +-0.5
    check(lambda x: torch.histogram(x, bins=3), torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0]))  # values on edges


def test_bincount_is_eager_only():
    t = torch.tensor([1, 3, 3, 0, 5])
    w = torch.tensor([0.5, 1.0, 2.0, 1.0, 3.0])
    check(lambda x: torch.bincount(x), t, jit=False)
    check(lambda x: torch.bincount(x, minlength=9), t, jit=False)
    check(lambda x, y: torch.bincount(x, y), t, w, jit=False)
    with pytest.raises(DataDependentError):
        _run(lambda x: torch.bincount(x), t, jit=True)


# ---- sorting ------------------------------------------------------------------------------
def test_sort_nan_is_largest():
    t = torch.tensor([3.0, NAN, -1.0, NAN, 2.0])
    check(lambda x: torch.sort(x), t)
    check(lambda x: torch.sort(x, descending=True), t)
    check(lambda x: torch.argsort(x), t)
    check(lambda x: torch.msort(x), torch.randn(5, 3))


def test_searchsorted_and_bucketize():
    seq = torch.tensor([1.0, 2.0, 2.0, 4.0])
    v = torch.tensor([[0.0, 2.0, 3.0], [4.0, 5.0, 2.0]])
    check(lambda s, x: torch.searchsorted(s, x), seq, v)
    check(lambda s, x: torch.searchsorted(s, x, right=True), seq, v)
    check(lambda s, x: torch.searchsorted(s, x, side="right", out_int32=True), seq, v)
    check(lambda s, x: torch.searchsorted(s, 2.0), seq, v)
    perm = torch.tensor([3, 0, 2, 1])
    check(lambda s, x: torch.searchsorted(s[perm], x, sorter=perm), seq, v)
    rows = torch.sort(torch.randn(2, 5), 1).values
    check(lambda s, x: torch.searchsorted(s, x), rows, torch.randn(2, 3))
    check(lambda s, x: torch.bucketize(x, s), seq, v)
    check(lambda s, x: torch.bucketize(x, s, right=True), seq, v)


def test_unique_family_eager_and_data_dependent_under_jit():
    t = torch.tensor([[3, 1, 3], [2, 1, 1]])
    check(lambda x: torch.unique(x), t, jit=False)
    check(lambda x: torch.unique(x, return_inverse=True, return_counts=True), t, jit=False)
    check(lambda x: torch.unique(x, dim=1, return_inverse=True, return_counts=True), t, jit=False)
    check(lambda x: torch.unique_consecutive(x, return_inverse=True, return_counts=True), t, jit=False)
    check(
        lambda x: torch.unique_consecutive(x, dim=0, return_counts=True),
        torch.tensor([[1, 2], [1, 2], [0, 1]]),
        jit=False,
    )
    with pytest.raises(DataDependentError):
        _run(lambda x: torch.unique(x), t, jit=True)


def test_return_types_come_back_as_named_tuples_in_torch_code():
    def fn(x):
        r = torch.max(x, 1)
        s = torch.sort(x, 1)
        return r.values, r.indices, s.values, s.indices

    check(fn, X)


# ---- out= and in-place through the interpreter --------------------------------------------
def test_out_and_inplace_variants():
    def out_variants(x):
        s = x.new_empty(4)
        torch.sum(x, (0, 2), out=s)
        v, i = x.new_empty(3, 5), x.new_empty(3, 5, dtype=torch.long)
        torch.max(x, 1, out=(v, i))
        c = x.new_empty(3, 4, 5)
        torch.cumsum(x, 2, out=c)
        sv, si = x.new_empty(3, 4, 5), x.new_empty(3, 4, 5, dtype=torch.long)
        torch.sort(x, 0, out=(sv, si))
        y = x.clone()
        y.cumsum_(1)
        return s, v, i, c, sv, si, y

    check(out_variants, X)


def test_sum_prod_cumsum_out_compute_in_the_out_dtype():
    """`torch.sum(float_x, 0, out=int_t)` sums the values cast to the out tensor's dtype, as torch
    does (1.5 + 2.5 into int64 is 3; jaxtorch summed then truncated: 4, silently)."""

    def run(device):
        x = torch.tensor([1.5, 2.5], device=device)
        i64 = lambda *s: torch.zeros(*s, dtype=torch.int64, device=device)
        got = [
            torch.sum(x, 0, out=i64(())),
            torch.prod(x, 0, out=i64(())),
            torch.cumsum(x, 0, out=i64(2)),
            torch.cumprod(x, 0, out=i64(2)),
            torch.sum(torch.tensor([0.5, 0.5], device=device), 0, out=torch.zeros((), dtype=torch.bool, device=device)),
            torch.sum(torch.tensor([1, 2], device=device), 0, out=torch.zeros((), device=device)),
        ]
        return [(t.dtype, t.cpu().tolist()) for t in got]

    with jaxtorch.default_env():
        assert run("jax") == run("cpu")
