"""`segment_reduce`, `hash_tensor`, `histogramdd`, `tensor_split`/`narrow` with tensor arguments, and
`linalg.eigh`'s triangle, against eager CPU torch (eagerly, under `jax.jit`, and gradients).

Lowerings: `jaxtorch/ops/reductions.py` (segments, hash, histograms), `shape.py` (split, narrow),
`linalg.py` (eigh).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxtorch
from jaxtorch import DataDependentError
from tests._dtypes import enable_x64

from . import _compare

NAN = float("nan")


def check(fn, *tensors, jit=True, tol=1e-5):
    _compare.check(fn, *tensors, jit=jit, tol=tol)


def torch_grad(fn, x, *rest):
    """d sum(fn(x, *rest) * cot) / dx by torch autograd, and the same through jaxtorch under jax.grad."""
    out = fn(x, *rest)
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    xg = x.clone().requires_grad_()
    (ref,) = torch.autograd.grad((fn(xg, *rest) * cot).sum(), xg)
    jrest = [_compare.to_jax(r) if isinstance(r, torch.Tensor) else r for r in rest]

    def loss(xj):
        return jnp.sum(jaxtorch.call_torch(fn, xj, *jrest) * _compare.to_jax(cot))

    return ref, jax.grad(loss)(_compare.to_jax(x))


# ---- segment_reduce -------------------------------------------------------------------------
REDUCES = ["sum", "mean", "max", "min", "prod"]


def _segment_data():
    x = torch.randn(7, 3, generator=torch.Generator().manual_seed(0))
    x[4, 1] = NAN
    return x


@pytest.mark.parametrize("reduce", REDUCES)
@pytest.mark.parametrize("initial", [None, 0.5])
@pytest.mark.parametrize("kind", ["lengths", "offsets"])
def test_segment_reduce_axis0(reduce, initial, kind):
    lengths = torch.tensor([2, 0, 3, 1, 0, 1])
    idx = lengths if kind == "lengths" else torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    fn = lambda x, i: torch.segment_reduce(x, reduce, **{kind: i}, axis=0, initial=initial)
    check(fn, _segment_data(), idx)


@pytest.mark.parametrize("reduce", REDUCES)
@pytest.mark.parametrize("kind", ["lengths", "offsets"])
def test_segment_reduce_inner_axis_with_rows_of_lengths(reduce, kind):
    x = torch.randn(2, 6, 3, generator=torch.Generator().manual_seed(1))
    lengths = torch.tensor([[1, 0, 5], [3, 3, 0]])
    idx = lengths if kind == "lengths" else torch.cat([torch.zeros(2, 1, dtype=torch.long), lengths.cumsum(1)], 1)
    check(lambda x, i: torch.segment_reduce(x, reduce, **{kind: i}, axis=1), x, idx)


@pytest.mark.parametrize("reduce", REDUCES)
def test_segment_reduce_gradient_matches_torch(reduce):
    x = torch.randn(7, 2, generator=torch.Generator().manual_seed(2))
    x[3, 0] = 0.0  # prod's gradient at a zero: the product of the others
    lengths = torch.tensor([3, 0, 4])
    fn = lambda x, l: torch.segment_reduce(x, reduce, lengths=l, initial=None if reduce != "prod" else 1.5)
    ref, got = torch_grad(fn, x, lengths)
    _compare.compare(ref, got, 1e-5)


def test_segment_reduce_refuses_int_data_and_a_wrong_axis():
    with pytest.raises(RuntimeError, match="not implemented for 'Long'"):
        _compare.run(lambda x, l: torch.segment_reduce(x, "sum", lengths=l), torch.arange(3), torch.tensor([3]))
    with pytest.raises(RuntimeError, match="last dimension of lengths"):
        _compare.run(
            lambda x, l: torch.segment_reduce(x, "sum", lengths=l, axis=1), torch.ones(2, 3), torch.tensor([3])
        )


# ---- hash_tensor ----------------------------------------------------------------------------
def _float_specials():
    x = torch.randn(5, 7, generator=torch.Generator().manual_seed(4))
    x[0, :6] = torch.tensor([float("inf"), -float("inf"), NAN, 1e-40, -3e-45, -0.0])
    return x


HASH_CASES = [
    (_float_specials(), {}),
    (_float_specials(), {"dim": 1}),
    (_float_specials(), {"dim": [0], "keepdim": True}),
    (torch.randint(-(2**31), 2**31 - 1, (4, 6), generator=torch.Generator().manual_seed(5)), {"dim": 0}),
    (torch.rand(3, 4, generator=torch.Generator().manual_seed(6)) > 0.5, {}),
    (torch.tensor([-100, 7, 3, 127], dtype=torch.int8), {}),
    (torch.tensor([200, 7, 3], dtype=torch.uint8), {}),
    (torch.randn(6, 3, generator=torch.Generator().manual_seed(7)).half(), {"dim": 0}),
    (torch.randn(6, 3, generator=torch.Generator().manual_seed(8)).bfloat16(), {}),
    (torch.zeros(3, 0), {"dim": 0}),
]


def _hash(x, kw, jit: bool):
    """torch.hash_tensor through jaxtorch (`jaxtorch.to_jax` also takes bfloat16)."""
    call = lambda a: jaxtorch.call_torch(lambda t: torch.hash_tensor(t, **kw), a)
    return (jax.jit(call) if jit else call)(jaxtorch.to_jax(x))


def _hash_ints(t, mask: int) -> list[int]:
    return [int(v) & mask for v in np.asarray(t).reshape(-1).tolist()]


@pytest.mark.parametrize("case", range(len(HASH_CASES)))
@pytest.mark.parametrize("jit", [False, True])
def test_hash_tensor_holds_the_low_word_of_torchs_hash_without_x64(case, jit):
    x, kw = HASH_CASES[case]
    ref = torch.hash_tensor(x, **kw)
    got = _hash(x, kw, jit)
    assert got.shape == tuple(ref.shape) and got.dtype == np.uint32
    assert _hash_ints(got, 2**32 - 1) == _hash_ints(ref.numpy(), 2**32 - 1)


def test_hash_tensor_is_torchs_exact_uint64_with_x64():
    with enable_x64():
        for x, kw in HASH_CASES:
            ref = torch.hash_tensor(x, **kw)
            for jit in (False, True):
                got = _hash(x, kw, jit)
                assert got.dtype == np.uint64
                assert _hash_ints(got, 2**64 - 1) == _hash_ints(ref.numpy(), 2**64 - 1), (x.dtype, kw)


def test_hash_tensor_errors_like_torch():
    with pytest.raises(RuntimeError, match="Unknown hash_tensor mode: 1"):
        _compare.run(lambda t: torch.hash_tensor(t, mode=1), torch.ones(3))
    with pytest.raises(IndexError, match="non-zero size"):
        _compare.run(lambda t: torch.hash_tensor(t, 0), torch.ones(0, 3))


# ---- histogramdd ----------------------------------------------------------------------------
def _points():
    x = torch.randn(40, 3, generator=torch.Generator().manual_seed(9))
    x[:, 2] = 1.5  # a constant column: its range widens to [1, 2]
    x[7, 0] = NAN  # dropped
    return x


@pytest.mark.parametrize("bins", [[3, 4, 2], [1, 1, 5]])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("density", [False, True])
def test_histogramdd_bin_counts(bins, weighted, density):
    w = torch.rand(40, generator=torch.Generator().manual_seed(10)) if weighted else None
    x = _points()
    x[7, 0] = 0.0  # the data's range must be finite when it sets the edges

    def fn(x, *w):
        return tuple(torch.histogramdd(x, bins, weight=w[0] if w else None, density=density))

    check(lambda x, *w: [fn(x, *w)[0], *fn(x, *w)[1]], x, *([w] if weighted else []))


def test_histogramdd_range_edges_tensors_and_batched_points():
    x = _points().reshape(2, 20, 3)
    rng = [-1.0, 1.0, -2.0, 0.5, 1.0, 2.0]
    check(lambda x: [torch.histogramdd(x, [4, 3, 2], range=rng)[0], *torch.histogramdd(x, 2, range=rng)[1]], x)
    edges = [torch.tensor([-2.0, 0.0, 0.5, 3.0]), torch.tensor([-1.0, 1.0]), torch.tensor([3.0, -3.0])]
    check(lambda x, a, b, c: torch.histogramdd(x, [a, b, c], density=False)[0], x, *edges)


def test_histogramdd_of_no_points_uses_unit_ranges():
    check(lambda x: [torch.histogramdd(x, [2, 3])[0], *torch.histogramdd(x, [2, 3])[1]], torch.zeros(0, 2))


# ---- tensor_split / narrow with tensor arguments --------------------------------------------
@pytest.mark.parametrize(
    "idx,dim",
    [
        (torch.tensor([1, 3]), 1),
        (torch.tensor([-1, 2]), 0),
        (torch.tensor([4, 2]), 0),
        (torch.tensor(3), 1),
        (torch.tensor(4), 0),
        (torch.tensor([], dtype=torch.long), 1),
    ],
)
def test_tensor_split_by_a_tensor(idx, dim):
    x = torch.arange(20.0).reshape(5, 4)
    check(lambda x, i: [p * 1 for p in torch.tensor_split(x, i, dim)], x, idx, jit=False)


def test_tensor_split_by_a_traced_tensor_is_data_dependent_and_grads_flow():
    x, idx = torch.arange(20.0).reshape(5, 4), torch.tensor([1, 3])
    with pytest.raises(DataDependentError, match="tensor_split"):
        _compare.run(lambda x, i: torch.tensor_split(x, i, 1), x, idx, jit=True)
    ref, got = torch_grad(
        lambda x, i: torch.cat([p**2 * (k + 1) for k, p in enumerate(torch.tensor_split(x, i, 1))], 1), x, idx
    )
    _compare.compare(ref, got, 1e-5)


def test_tensor_split_errors_like_torch():
    x = torch.ones(4)
    with pytest.raises(RuntimeError, match="dtype of long"):
        _compare.run(lambda x, i: torch.tensor_split(x, i), x, torch.tensor([1.0]))
    with pytest.raises(RuntimeError, match="one-dimensional tensor, but got a tensor with 2 dims"):
        _compare.run(lambda x, i: torch.tensor_split(x, i), x, torch.tensor([[1]]))
    with pytest.raises(RuntimeError, match="number of sections must be larger than 0, got 0"):
        _compare.run(lambda x, i: torch.tensor_split(x, i), x, torch.tensor(0))


@pytest.mark.parametrize("dim,start", [(1, 2), (1, -3), (0, 0), (-1, 3)])
def test_narrow_with_a_tensor_start_traces(dim, start):
    x = torch.arange(30.0).reshape(5, 6)
    check(lambda x, s: torch.narrow(x, dim, s, 2) * 1, x, torch.tensor(start))


def test_narrow_with_a_tensor_start_is_a_view_under_jit():
    def fn(x, s):
        x = x.clone()
        torch.narrow(x, 1, s, 2).mul_(10)
        return x

    check(fn, torch.arange(12.0).reshape(3, 4), torch.tensor(1))


def test_torch_autograd_through_tensor_split_and_narrow_on_the_jax_device():
    def fn(x, idx, st):
        x = x.clone().requires_grad_()
        loss = sum((p**2 * (k + 1)).sum() for k, p in enumerate(torch.tensor_split(x, idx, dim=1)))
        loss = loss + (torch.narrow(x, 0, st, 2) * 3).sum()
        return torch.autograd.grad(loss, x)[0]

    check(fn, torch.arange(12.0).reshape(3, 4), torch.tensor([1, 3]), torch.tensor(-2), jit=False)


# ---- linalg.eigh: torch's triangle --------------------------------------------------------------
@pytest.mark.parametrize("uplo", ["L", "U"])
def test_eigh_reads_only_torchs_triangle(uplo):
    a = torch.randn(2, 5, 5, generator=torch.Generator().manual_seed(11))  # not symmetric: one triangle counts
    w, v = torch.linalg.eigh(a, UPLO=uplo)
    jw, jv = _compare.run(lambda x: torch.linalg.eigh(x, UPLO=uplo), a)
    np.testing.assert_allclose(np.asarray(jw), w.numpy(), rtol=1e-5, atol=1e-5)
    # eigenvectors agree up to sign (LAPACK implementations pick different signs; torch documents none)
    overlap = np.abs(np.sum(np.asarray(jv) * v.numpy(), axis=-2))
    np.testing.assert_allclose(overlap, np.ones_like(overlap), atol=1e-4)


# ---- kthvalue: torch's quickselect picks the index among ties -----------------------------------
@pytest.mark.parametrize("n", [1, 5, 33])
@pytest.mark.parametrize("data", ["ints", "floats_with_nan"])
def test_kthvalue_ties_pick_torchs_index(n, data):
    gen = torch.Generator().manual_seed(n)
    if data == "ints":
        x = torch.randint(-3, 4, (40, n), generator=gen)
    else:
        x = torch.randint(-2, 3, (40, n), generator=gen).float()
        x[torch.rand(40, n, generator=gen) < 0.2] = NAN
    for k in sorted({1, n, (n + 1) // 2, max(1, n - 1)}):
        check(lambda t: torch.kthvalue(t, k, dim=1), x)
    check(lambda t: torch.kthvalue(t, (n + 1) // 2, dim=0, keepdim=True), x.T.contiguous())


def test_kthvalue_gradient_goes_to_torchs_index():
    x = torch.randint(-2, 3, (6, 9), generator=torch.Generator().manual_seed(12)).float()
    ref, got = torch_grad(lambda t: torch.kthvalue(t, 4, dim=1)[0], x)
    _compare.compare(ref, got, 1e-6)
