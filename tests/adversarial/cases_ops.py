"""Op edge cases against eager CPU torch (issue 30): empty and 0-d tensors, negative dims, type promotion with
Python scalars and 0-d tensors, integer wrap and division, shifts by the width, NaN ordering, ties, float16
overflow, complex ops, `out=` resizing and refusals, in-place writes into expanded and overlapping memory,
index_put/scatter_reduce, data-dependent ops under jit, out-of-range reads (docs/api/errors.md), `*_copy` ops."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

import jaxtorch

from .harness import case, clear_error, close, equal


def _jax(x):
    return x.to("jax") if isinstance(x, torch.Tensor) else x


def _same(fn: Callable, *args, approx: bool = False) -> None:
    """`fn` on CPU tensors and on their `jax` copies: the same values and dtypes (each result)."""
    want = fn(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
    with jaxtorch.default_env():
        got = fn(*[_jax(a) for a in args])
    wants, gots = (want, got) if isinstance(want, (tuple, list)) else ((want,), (got,))
    assert len(wants) == len(gots)
    for w, g in zip(wants, gots):
        if approx:
            assert g.dtype == w.dtype, (g.dtype, w.dtype)
            close(g, w)
        else:
            equal(g, w)


def _both_raise(fn: Callable, *args, error: type[BaseException] = RuntimeError) -> None:
    """torch refuses `fn`; so does jaxtorch, with the same error type (a clear message)."""
    with pytest.raises(error) as cpu:
        fn(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
    with jaxtorch.default_env(), pytest.raises(error) as got:
        fn(*[_jax(a) for a in args])
    words = [w for w in str(cpu.value).split() if len(w) > 4][:3]
    clear_error(got.value, *words)


# ---- empty and 0-d tensors, negative dims ---------------------------------------------------------
@case("ops/empty/sum_prod_of_empty")
def _empty_sum():
    _same(lambda x: (x.sum(), x.prod(), x.sum(0)), torch.ones(0, 3))


@case("ops/empty/amax_of_empty_refused")
def _empty_amax():
    _both_raise(lambda x: x.amax(0), torch.ones(0, 3), error=IndexError)


@case("ops/empty/cat_with_legacy_empty")
def _empty_cat():
    _same(lambda a, b: torch.cat([a, b]), torch.ones(0), torch.arange(6.0).reshape(2, 3))


@case("ops/zero_dim/index_by_0d_tensor")
def _zero_dim_index():
    _same(lambda x, i: (x[i], x[i, i]), torch.arange(9.0).reshape(3, 3), torch.tensor(2))


@case("ops/zero_dim/softmax_and_cumsum_on_0d")
def _zero_dim_softmax():
    _same(lambda x: (x.softmax(-1), x.cumsum(0), x.flip(0)), torch.tensor(1.5))


@case("ops/neg_dim/dim_out_of_range")
def _neg_dim():
    _both_raise(lambda x: x.sum(-3), torch.ones(2, 3), error=IndexError)


@case("ops/neg_dim/transpose_and_unsqueeze_negative")
def _neg_dims():
    _same(lambda x: (x.transpose(-1, -3).contiguous(), x.unsqueeze(-1).shape == (2, 3, 4, 1)), torch.randn(2, 3, 4))


# ---- type promotion ------------------------------------------------------------------------------------
@case("ops/promote/int_tensor_with_float_scalar")
def _promote_scalar():
    _same(lambda x: (x + 1.5, x * 2, x / 2, x // 2), torch.arange(5, dtype=torch.int32))


@case("ops/promote/uint8_with_0d_int64_stays_uint8")
def _promote_0d():
    _same(lambda x, s: (x + s, x * s), torch.tensor([250, 3], dtype=torch.uint8), torch.tensor(10))


@case("ops/promote/bool_arithmetic")
def _promote_bool():
    _same(
        lambda a, b: (a + b, a * b, a.sum(), a & b, ~a),
        torch.tensor([True, False, True]),
        torch.tensor([True, True, False]),
    )


@case("ops/promote/where_with_python_scalars")
def _where_scalar():
    _same(
        lambda c, x: (torch.where(c, x, 0.5), torch.where(c, 1, 0), torch.where(c, x, 2)),
        torch.tensor([True, False]),
        torch.tensor([3, 4]),
    )


# ---- integer wrap, division, shifts --------------------------------------------------------------------
@case("ops/wrap/uint8_int8_overflow")
def _wrap():
    _same(
        lambda u, i: (u - 5, u * 100, i * 3, -i, i.abs()),
        torch.tensor([3, 200], dtype=torch.uint8),
        torch.tensor([100, -128], dtype=torch.int8),
    )


@case("ops/int_div/rounding_modes_negative")
def _rounding():
    a, b = torch.tensor([-7, 7, -8]), torch.tensor([2, -2, 3])
    _same(
        lambda a, b: (a // b, torch.div(a, b, rounding_mode="trunc"), torch.div(a, b, rounding_mode="floor"), a / b),
        a,
        b,
    )


@case("ops/int_div/remainder_fmod_signs")
def _remainder():
    _same(
        lambda a: (torch.remainder(a, 3), torch.fmod(a, 3), torch.remainder(a, -3), a % 3), torch.tensor([-7, 7, -3, 0])
    )


@case("ops/int_div/integer_division_by_zero_refused_under_checks")
def _div_zero():
    def fn(a, b):  # torch: RuntimeError("ZeroDivisionError"); jaxtorch in checked mode (XLA cannot raise)
        with jaxtorch.checks():
            return (a // b, torch.remainder(a, b))

    _both_raise(fn, torch.tensor([5, 1]), torch.tensor([0, 1]))


@case("ops/shift/by_width_or_more")
def _shift():
    x = torch.tensor([1, -8, 3], dtype=torch.int32)
    _same(lambda x: (x << 32, x >> 33, x << 31, x >> 40), x)


@case("ops/shift/uint8_shift_wraps")
def _shift_u8():
    _same(lambda x: (x << 4, x >> 9, x << 8), torch.tensor([255, 17, 1], dtype=torch.uint8))


# ---- NaN ordering, ties --------------------------------------------------------------------------------
_NAN = torch.tensor([3.0, float("nan"), -1.0, float("nan"), 5.0])


@case("ops/nan/sort_places_nan_last_and_first_descending")
def _nan_sort():
    _same(lambda x: (*torch.sort(x), *torch.sort(x, descending=True), x.argsort(stable=True)), _NAN)


@case("ops/nan/topk_counts_nan_as_largest")
def _nan_topk():
    _same(lambda x: (*x.topk(3), *x.topk(2, largest=False)), _NAN)


@case("ops/nan/max_min_argmax_propagate_nan")
def _nan_max():
    _same(lambda x: (x.max(), x.min(), x.argmax(), x.argmin(), *x.max(0), torch.maximum(x, x.flip(0))), _NAN)


@case("ops/nan/unique_keeps_each_nan")
def _nan_unique():
    _same(lambda x: torch.unique(x, sorted=True), _NAN)


@case("ops/ties/argmax_argmin_first_index")
def _ties():
    x = torch.tensor([[1, 5, 5, 0, 0], [2, 2, 2, 2, 2]])
    _same(lambda x: (x.argmax(1), x.argmin(1), *x.max(1), *x.min(1), x.float().argmax()), x)


@case("ops/ties/mode_and_median_pick_like_torch")
def _median():
    x = torch.tensor([[3.0, 1.0, 2.0, 4.0], [1.0, 1.0, 2.0, 2.0]])
    _same(lambda x: (*x.median(1), x.median()), x)


# ---- float16, complex ------------------------------------------------------------------------------------
@case("ops/half/float16_overflow_to_inf")
def _half_inf():
    _same(
        lambda x: (x * 2, x + x, (x * 2).isinf(), x.to(torch.float16) - 70000),
        torch.tensor([60000.0, -60000.0, 1.0], dtype=torch.float16),
    )


@case("ops/half/float16_sum_accumulates_wider")
def _half_sum():
    _same(lambda x: (x.sum(), x.mean(), x.cumsum(0)[-1]), torch.ones(4096, dtype=torch.float16))


@case("ops/complex/abs_angle_conj_mul")
def _complex():
    z = torch.tensor([1 + 2j, -3 - 1j, 0j], dtype=torch.complex64)
    _same(lambda z: (z.abs(), z.angle(), z.conj() * z, z.real, torch.view_as_real(z), z.sum()), z, approx=True)


# ---- out=, in-place -------------------------------------------------------------------------------------------
@case("ops/out/wrong_shape_empty_is_resized")
def _out_resize():
    def fn(a, b):
        out = torch.empty(0, device=a.device)
        r = torch.add(a, b, out=out)
        return out, r

    _same(fn, torch.ones(2, 3), torch.arange(3.0))


@case("ops/out/float_result_into_int_out_refused")
def _out_dtype():
    _both_raise(lambda a: torch.add(a, 0.5, out=torch.empty(3, dtype=torch.int64, device=a.device)), torch.ones(3))


@case("ops/inplace/into_expanded_tensor_refused")
def _inplace_expanded():
    _both_raise(lambda x: x.expand(3, 4).add_(1), torch.zeros(1, 4))


@case("ops/inplace/into_transposed_view_writes_base")
def _inplace_transposed():
    def fn(x):
        x.t().add_(torch.arange(3.0, device=x.device))
        return x

    _same(fn, torch.zeros(3, 2))


@case("ops/inplace/overlapping_copy_refused")
def _inplace_overlap():
    def fn(x):
        e = x[:1].expand(3)
        e.copy_(torch.tensor([1.0, 2.0, 3.0], device=x.device))
        return x

    _both_raise(fn, torch.zeros(3))


# ---- index_put, scatter_reduce --------------------------------------------------------------------------------------
@case("ops/index_put/duplicates_accumulate")
def _index_put():
    _same(
        lambda x, i, v: x.index_put((i,), v, accumulate=True),
        torch.zeros(4),
        torch.tensor([1, 1, 3, 1]),
        torch.tensor([1.0, 2.0, 3.0, 4.0]),
    )


@case("ops/index_put/bool_mask_and_negative_index")
def _index_put_mask():
    def fn(x):
        x[x > 2] = -1.0
        x[-1] += 10
        return x

    _same(fn, torch.arange(6.0).reshape(3, 2))


@case("ops/scatter_reduce/all_modes_include_self_both_ways")
def _scatter_reduce():
    x, i, s = torch.arange(4.0) + 1, torch.tensor([0, 0, 2, 2, 2]), torch.tensor([5.0, -1.0, 2.0, 3.0, 0.5])
    for mode in ("sum", "prod", "mean", "amax", "amin"):
        for include_self in (True, False):
            _same(lambda x, i, s: x.scatter_reduce(0, i, s, mode, include_self=include_self), x, i, s)


@case("ops/scatter_reduce/integer_mean_floors")
def _scatter_mean_int():
    _same(
        lambda x, i, s: x.scatter_reduce(0, i, s, "mean"),
        torch.tensor([1, 2, 3]),
        torch.tensor([0, 0, 1]),
        torch.tensor([4, 6, -4]),
    )


# ---- data-dependent ops under jit, clamp, rounding, pow ------------------------------------------------------------
@case("ops/jit/nonzero_and_unique_under_jit_clear_error")
def _jit_nonzero():
    for fn in (lambda x: x.nonzero(), lambda x: torch.unique(x), lambda x: x[x > 0]):
        with pytest.raises(Exception) as err:
            jaxtorch.jit(fn)(torch.tensor([1.0, -1.0, 2.0], device="jax"))
        clear_error(err.value, "data", "shape depends", "nonzero_static", "jit")


@case("ops/clamp/min_greater_than_max_gives_max")
def _clamp():
    _same(
        lambda x: (
            x.clamp(2, 1),
            x.clamp(min=torch.tensor(3.0, device=x.device), max=torch.tensor(0.0, device=x.device)),
        ),
        torch.arange(5.0),
    )


@case("ops/round/half_to_even_and_decimals")
def _round():
    _same(
        lambda x: (x.round(), torch.round(x, decimals=1), x.floor(), x.trunc()),
        torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 0.25]),
    )


@case("ops/pow/integer_negative_exponent_refused")
def _pow():
    _both_raise(lambda x: x.pow(-1), torch.tensor([2, 3]))


@case("ops/reduce/int_sum_and_cumsum_upcast")
def _int_upcast():
    _same(lambda x: (x.sum(), x.cumsum(0), x.prod(), x.bool().sum()), torch.tensor([100, 100, 3], dtype=torch.int8))


@case("ops/reduce/mean_of_int_refused")
def _mean_int():
    _both_raise(lambda x: x.mean(), torch.tensor([1, 2]))


# ---- out-of-range reads (docs/api/errors.md), *_copy ops --------------------------------------------------------
@case("ops/index_oob/reads_fill_nan_not_a_clamped_row")
def _oob():
    w = torch.arange(12.0).reshape(4, 3)
    with jaxtorch.default_env():
        wj, i = w.to("jax"), torch.tensor([1, 4], device="jax")
        for got in (wj[i], wj.index_select(0, i), F.embedding(i, wj), wj.gather(0, i[:, None].expand(2, 3))):
            got = got.cpu()
            equal(got[0], w[1])
            assert got[1].isnan().all(), got


@case("ops/copy_ops/view_copies_are_copies")
def _copies():
    def fn(x):
        c = torch.select_copy(x, 0, 1)
        c.mul_(10)
        return x, c, torch.slice_copy(x, 1, 0, 2), *torch.split_copy(x, 1, 0), torch.t_copy(x), torch.detach_copy(x)

    _same(fn, torch.arange(6.0).reshape(2, 3))


@case("ops/as_strided/of_a_transposed_view_reads_storage")
def _as_strided_view():
    _same(lambda x: torch.as_strided(x.t(), (2, 2), (1, 2), 1).clone(), torch.arange(12.0).reshape(4, 3))


@case("ops/as_strided/of_a_contiguous_tensor")
def _as_strided():
    _same(
        lambda x: (torch.as_strided(x, (3, 2), (1, 3), 2), torch.as_strided_copy(x, (2, 2), (4, 1))), torch.arange(12.0)
    )


@case("ops/out/list_out_of_split_copy")
def _split_copy_out():
    def fn(x):
        outs = [torch.empty(2, 3, device=x.device), torch.empty(1, 3, device=x.device)]
        torch.split_copy(x, 2, 0, out=outs)
        return outs

    _same(fn, torch.arange(9.0).reshape(3, 3))
