"""Shape and indexing lowerings (`jaxtorch/ops/shape.py`, `jaxtorch/ops/indexing.py`) against eager
PyTorch on the CPU: view/alias semantics, `__setitem__` forms, `index_put` accumulation, and torch's
index rules (negative indices, clamped slices, advanced-index placement), eagerly and under `jax.jit`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import jaxtorch
from jaxtorch import DataDependentError


def _j(t: torch.Tensor):
    return jnp.asarray(t.numpy())


def _assert_same(ref, got):
    if isinstance(ref, (tuple, list)):
        assert len(ref) == len(got)
        for r, g in zip(ref, got):
            _assert_same(r, g)
        return
    g = np.asarray(got)
    r = ref.detach().numpy()
    assert g.shape == r.shape, (g.shape, r.shape)
    if r.dtype == np.bool_:
        assert g.dtype == np.bool_
        np.testing.assert_array_equal(g, r)
    elif np.issubdtype(r.dtype, np.integer):
        assert np.issubdtype(g.dtype, np.integer), g.dtype
        np.testing.assert_array_equal(g, r)
    else:
        assert g.dtype.kind == r.dtype.kind, (g.dtype, r.dtype)
        np.testing.assert_allclose(g, r, rtol=1e-6, atol=1e-6)


def _check(fn, *tensors, jit: bool = True):
    """`fn` on CPU torch tensors vs `fn` through jaxtorch, eagerly and (optionally) under jax.jit."""
    ref = fn(*[t.clone() for t in tensors])
    arrays = [_j(t) for t in tensors]
    _assert_same(ref, jaxtorch.call_torch(fn, *arrays))
    if jit:
        _assert_same(ref, jax.jit(lambda *a: jaxtorch.call_torch(fn, *a))(*arrays))


def test_functional_copy_casts_and_broadcasts():
    # aten.copy is the functional `a.copy_(src)` that functionalization and torch.export emit.
    x, src = torch.zeros(2, 3, dtype=torch.int32), torch.tensor([1.7, -2.5, 3.2])
    _check(lambda a, s: torch.ops.aten.copy(a, s), x, src)
    got = jaxtorch.call_torch(lambda a, s: torch.ops.aten.copy(a, s), _j(x), _j(src))
    assert got.dtype == jnp.int32 and got.shape == (2, 3)


# ---- views alias their base ------------------------------------------------------------------
def _view_program(x):
    x = x.clone()
    v = x.t()[1:]  # chained view
    v.mul_(10)  # write through the view
    x[0].add_(1)  # write to the base...
    d = x.diagonal()
    d.fill_(-1)  # ...and through another view
    parts = x.split(1, dim=1)
    parts[2].sub_(3)
    return x, v + 0, d + 0  # the views must see every write


def test_view_writes_update_base_and_views_eager_and_jit():
    _check(_view_program, torch.arange(12.0).reshape(3, 4))


def test_view_aliasing_on_jax_device():
    with jaxtorch.default_env():
        x = torch.arange(6.0, device="jax").reshape(2, 3)
        row = x[1]
        col = x[:, 0]
        row.mul_(2)
        assert col.cpu().tolist() == [0.0, 6.0]
        x.add_(1)
        assert row.cpu().tolist() == [7.0, 9.0, 11.0]
        u = x.unsqueeze(0).expand(2, 2, 3)
        assert u.cpu().tolist()[1] == x.cpu().tolist()


def test_view_dtype_bitcast_matches_torch():
    x = torch.tensor([1.0, -2.0, 0.5, 3.0])
    _check(lambda t: t.view(torch.int32), x)
    _check(lambda t: t.view(torch.int16), x)
    _check(lambda t: t.view(torch.uint8).view(torch.float32), x)
    with pytest.raises(RuntimeError, match="cannot be written through"):
        jaxtorch.call_torch(lambda t: t.view(torch.int16).add_(1), _j(x))


def test_write_through_same_width_dtype_view_is_refused():
    x = torch.tensor([1.0, -2.0, 0.5, 3.0])
    with pytest.raises(RuntimeError, match="cannot be written through"):
        jaxtorch.call_torch(lambda t: t.view(torch.int32).add_(1), _j(x))


# ---- __setitem__ ------------------------------------------------------------------------------
def _setitem_program(x, mask, idx, y):
    x = x.clone()
    x[0, 0] = 5.0
    x[:, 1:3] += 1
    x[mask] = 0.0
    x[idx] = y
    x[-1, -1] = -7.0
    return x


def test_setitem_forms_eager_and_jit():
    x = torch.randn(4, 5)
    mask = torch.rand(4, 5) > 0.5
    idx = torch.tensor([3, -4, 1])
    y = torch.randn(5)
    _check(_setitem_program, x, mask, idx, y)


def test_setitem_on_jax_device():
    x = torch.randn(4, 5)
    mask = x > 0
    idx = torch.tensor([3, 1])
    y = torch.randn(5)
    ref = _setitem_program(x.clone(), mask, idx, y)
    with jaxtorch.default_env():
        got = _setitem_program(x.to("jax"), mask.to("jax"), idx.to("jax"), y.to("jax"))
        assert got.device.type == "jax"
        _assert_same(ref, got.cpu())


def test_full_shape_mask_assignment_is_static_under_jit():
    fn = lambda x, m: jaxtorch.call_torch(lambda a, b: a.masked_fill(b, 1.0).index_put((b,), torch.tensor(2.0)), x, m)
    jaxpr = str(jax.make_jaxpr(fn)(jnp.zeros((3, 3)), jnp.eye(3, dtype=bool)))
    assert "select_n" in jaxpr and "scatter" not in jaxpr


def test_mask_assignment_of_one_value_per_true_element():
    x, mask = torch.zeros(3, 4), torch.tensor([[1, 0, 0, 1], [0, 1, 0, 0], [1, 1, 1, 0]], dtype=torch.bool)
    vals = torch.arange(1.0, 7.0)

    def fn(a, m, v):
        a = a.clone()
        a[m] = v
        return a

    _check(fn, x, mask, vals)
    rows = torch.tensor([True, False, True])
    _check(lambda a, m, v: a.index_put((m,), v), x, rows, torch.randn(2, 4))
    _check(lambda a, m, v: torch.ops.aten.index_put(a, [None, m], v, True), torch.randn(4, 3), rows, torch.randn(4, 2))
    _check(lambda a, m, v: torch.ops.aten.index_put(a, [None, m], v), torch.randn(4, 3), rows, torch.randn(4, 1))
    _check(lambda a, m, v: a.index_put((m,), v), torch.randn(3, 2, 4), torch.rand(3, 2) > 0.3, torch.randn(4))


def test_boolean_index_read_is_data_dependent_under_jit():
    x, mask = torch.randn(3, 4), torch.randn(3, 4) > 0
    _check(lambda a, m: a[m], x, mask, jit=False)
    with pytest.raises(DataDependentError):
        jax.jit(lambda a, m: jaxtorch.call_torch(lambda s, t: s[t], a, m))(_j(x), _j(mask))
    with pytest.raises(DataDependentError):
        jax.jit(lambda a: jaxtorch.call_torch(torch.nonzero, a))(_j(x))


# ---- index_put and friends -------------------------------------------------------------------
def test_index_put_accumulate_with_duplicate_indices():
    x = torch.zeros(5)
    idx = torch.tensor([0, 2, 2, 2, -1, 4])
    vals = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    _check(lambda a, i, v: a.index_put((i,), v, accumulate=True), x, idx, vals)
    _check(lambda a, i, v: a.index_put_((i,), v, accumulate=True), x, idx, vals)
    m = torch.zeros(3, 3, dtype=torch.int64)
    r, c = torch.tensor([0, 0, 1, 0]), torch.tensor([1, 1, 2, 1])
    _check(lambda a, i, j: a.index_put((i, j), torch.tensor(3), accumulate=True), m, r, c)
    b = torch.zeros(4, dtype=torch.bool)
    _check(lambda a, i: a.index_put((i,), torch.tensor(True), accumulate=True), b, torch.tensor([1, 1, 3]))


@pytest.mark.parametrize(
    "fn",
    [
        lambda x, i, j: x[i, :, j],  # separated advanced indices go first
        lambda x, i, j: x[:, i, j],  # adjacent ones stay in place
        lambda x, i, j: x[i[:, None], 1:, j],  # broadcasting index tensors
        lambda x, i, j: x[None, ..., j],
        lambda x, i, j: x[-1, i],
    ],
    ids=["separated", "adjacent", "broadcast", "none-ellipsis", "negative"],
)
def test_advanced_indexing_matches_torch(fn):
    x = torch.randn(4, 5, 6)
    _check(fn, x, torch.tensor([0, -1, 2]), torch.tensor([5, 0, -6]))


def test_slices_clamp_like_torch():
    x = torch.arange(10.0)
    _check(lambda a: (a[-100:3], a[7:100], a[5:2], a[::3], a[-3:]), x)
    _check(lambda a: a.narrow(0, -4, 2), x)


def test_gather_scatter_reduce_variants():
    x = torch.randn(3, 5)
    idx = torch.tensor([[0, 1, 1, 4], [2, 2, 0, 0]])
    src = torch.randn(2, 4)
    _check(lambda a, i: a.gather(1, i), x, idx)
    _check(lambda a, i, s: a.scatter(1, i, s, reduce="add"), x, idx, src)
    _check(lambda a, i, s: a.scatter(1, i, s, reduce="multiply"), x, idx, src)
    _check(lambda a, i, s: a.scatter_add(1, i, s), x, idx, src)
    for reduce in ["sum", "prod", "mean", "amax", "amin"]:
        for include_self in [True, False]:
            _check(lambda a, i, s: a.scatter_reduce(1, i, s, reduce, include_self=include_self), x, idx, src)
    xi = torch.arange(15).reshape(3, 5)
    _check(
        lambda a, i, s: a.scatter_reduce(1, i, s, "mean", include_self=False),
        xi,
        idx,
        torch.tensor([[1, 2, 4, 7], [-3, 5, 8, 1]]),
    )


def test_dim_wise_index_ops():
    x = torch.randn(4, 3)
    idx = torch.tensor([3, 0, 3])
    src = torch.randn(3, 3)
    _check(lambda a, i, s: a.index_add(0, i, s, alpha=2.0), x, idx, src)
    _check(lambda a, i, s: a.index_copy(0, torch.tensor([2, 0, 1]), s), x, idx, src)
    _check(lambda a, i: a.index_fill(1, torch.tensor([0, 2]), -1.0), x, idx)
    _check(lambda a, i: a.index_select(0, i), x, idx)
    _check(lambda a, i, s: a.index_reduce(0, i, s, "amax", include_self=False), x, idx, src)
    _check(lambda a, i: (torch.take(a, i), a.put(i, torch.ones(3), accumulate=True)), x, torch.tensor([11, -1, 0]))


def test_masked_ops():
    x = torch.randn(3, 4)
    m = torch.randn(3, 4) > 0
    src = torch.randn(12)
    _check(lambda a, b, s: a.masked_scatter(b, s), x, m, src)
    _check(lambda a, b: (a.masked_fill(b, 3.0), a.masked_fill(b, torch.tensor(-2.0))), x, m)
    _check(lambda a, b: torch.where(b, a, 0), x, m)
    _check(lambda a, b: torch.where(b, a.long(), 2.5), x, m)
    _check(lambda a, b: torch.nonzero_static(b, size=20), x, m)
    _check(lambda a, b: (torch.masked_select(a, b), torch.argwhere(b)), x, m, jit=False)


# ---- shape ops ----------------------------------------------------------------------------------
def test_joins_splits_and_reorders():
    x = torch.randn(2, 3, 4)
    _check(lambda a: torch.cat([a, torch.empty(0), a.int()], dim=-1), x)
    _check(lambda a: (torch.stack([a, a], 1), torch.block_diag(a[0], a[1, 0], a[1, 1, 0])), x)
    _check(lambda a: (a.unbind(1), a.chunk(3, -1), a.tensor_split(3, dim=2)), x)
    _check(lambda a: (a.flip(0, 2), a.roll(2), a.roll((1, -1), (0, 2)), a.rot90(1, (1, 2))), x)
    _check(lambda a: (a.repeat(2, 1, 1, 2), a.repeat_interleave(2, dim=1), a.tile(2)), x)
    _check(lambda a: (a.unfold(2, 2, 1), a.movedim(0, -1), a.permute(2, 0, 1).squeeze(), a[:1].squeeze((0, 1))), x)
    _check(lambda a: a.as_strided((2, 2), (1, 3), 2), x)
    _check(lambda a: (a.diagonal(1, 1, 2), torch.diag_embed(a, -1, 0, 2), a.tril(-1), a.triu(1)), x)


def test_scatter_inverses_of_views():
    x = torch.randn(4, 4)
    _check(lambda a: torch.slice_scatter(a, torch.ones(4, 2), 1, 1, 100, 2), x)
    _check(lambda a: torch.select_scatter(a, torch.ones(4), 0, -1), x)
    _check(lambda a: torch.diagonal_scatter(a, torch.ones(3), 1), x)
    _check(lambda a: torch.as_strided_scatter(a, torch.ones(2, 2), (2, 2), (1, 4), 1), x)


def test_padding_modes_including_negative_pads():
    x = torch.randn(1, 2, 5, 6)
    _check(lambda a: F.pad(a, (1, -2, 2, 0), value=3.0), x)
    _check(lambda a: F.pad(a, (2, 1, 1, 3), mode="reflect"), x)
    _check(lambda a: F.pad(a, (-1, 2, 3, -2), mode="replicate"), x)
    _check(lambda a: F.pad(a, (2, 1, 1, 3), mode="circular"), x)


def test_repeat_interleave_with_output_size_under_jit():
    counts = torch.tensor([2, 0, 3])
    _check(lambda c: torch.repeat_interleave(c, output_size=5), counts)
    with pytest.raises(DataDependentError):
        jax.jit(lambda c: jaxtorch.call_torch(torch.repeat_interleave, c))(_j(counts))


def test_grad_through_indexing_matches_torch():
    x = torch.randn(4, 5, requires_grad=True)
    idx = torch.tensor([1, -1, 0])
    cot = torch.randn(3, 2)

    def loss(a, i):
        b = a.clone()
        b[i, 1:3] += a[i, :2] * 2  # index, slice, index_put
        b.index_put_((torch.tensor([2, 2]),), a[0], accumulate=True)
        return (b[i, 1:3] * cot).sum() + (b[torch.tensor([2, 2, 0])] ** 2).sum()  # duplicate reads

    (ref,) = torch.autograd.grad(loss(x, idx), x)
    got = jax.grad(lambda a: jaxtorch.call_torch(loss, a, _j(idx)))(_j(x.detach()))
    np.testing.assert_allclose(np.asarray(got), ref.numpy(), rtol=1e-5, atol=1e-5)


def _setitem_grad(x):
    y = x * 1
    y[0, 1:3] = x[1, :2] * 4
    y[y > 1] = 0.0
    return y


_BACKWARD = {
    "pad_reflect": lambda x: F.pad(x.reshape(1, 1, 3, 4), (1, 1, 2, 0), mode="reflect"),
    "pad_replicate": lambda x: F.pad(x.reshape(1, 1, 3, 4), (1, -1, 2, 0), mode="replicate"),
    "gather": lambda x: x.gather(1, torch.tensor([[0, 0], [3, 1], [2, 2]], device=x.device)),
    "unfold": lambda x: x.unfold(1, 2, 1),
    "as_strided": lambda x: x.as_strided((2, 2), (1, 2)),
    "scatter_amax": lambda x: x.scatter_reduce(0, torch.tensor([[0, 1, 1, 2]], device=x.device), x[:1] * 2, "amax"),
    "index_put": lambda x: x.index_put((torch.tensor([1, 1], device=x.device),), x[0] * 2, accumulate=True),
    "masked_scatter": lambda x: x.masked_scatter(x > 0, x * 5),
    "setitem": _setitem_grad,
}


@pytest.mark.parametrize("name", sorted(_BACKWARD))
def test_loss_backward_on_jax_device(name):
    """`loss.backward()` on jax-device tensors runs the backward ops through these lowerings too."""
    fn = _BACKWARD[name]
    torch.manual_seed(0)
    base, cot = torch.randn(3, 4), None
    x = base.clone().requires_grad_(True)
    out = fn(x)
    cot = torch.randn(out.shape)
    (out * cot).sum().backward()
    with jaxtorch.default_env():
        xj = base.clone().to("jax").requires_grad_(True)
        outj = fn(xj)
        (outj * cot.to("jax")).sum().backward()
        _assert_same(out, outj.detach().cpu())
        _assert_same(x.grad, xj.grad.cpu())


# ---- out-of-range reads with checks off: the fill value (docs/api/errors.md, issue 30 item 5) ----
_FILL = {torch.float32: float("nan"), torch.int32: -(2**31), torch.int64: -(2**31), torch.uint8: 255, torch.bool: True}
_READS = {
    "index": (lambda w, i: w[i], True),
    "index_2d": (lambda w, i: w[i[:, None], torch.arange(3)], True),
    "index_select": (lambda w, i: w.index_select(0, i), False),
    "gather": (lambda w, i: w.gather(0, i[:, None].expand(-1, 3)), False),
    "take": (lambda w, i: torch.take(w, i * 3), True),
}


@pytest.mark.parametrize("dtype", list(_FILL), ids=str)
@pytest.mark.parametrize("op", list(_READS))
@pytest.mark.parametrize("jit", [False, True])
def test_out_of_range_reads_give_the_documented_fill_value(op, dtype, jit):
    fn, wraps_negative = _READS[op]
    w = (torch.arange(12).reshape(4, 3) % 5).to(dtype)
    good = torch.tensor([1, -1 if wraps_negative else 3, 0])
    bad = torch.tensor([1, 7, -5 if wraps_negative else -1])
    ref = fn(w, good)  # in range: torch's value (a negative index wraps where torch allows it)
    call = lambda a, i: jaxtorch.call_torch(fn, a, i)
    call = jax.jit(call) if jit else call
    _assert_same(ref, call(_j(w), _j(good)))
    got = np.asarray(call(_j(w), _j(bad)))
    with pytest.raises((IndexError, RuntimeError)):
        fn(w, bad)  # torch refuses these indices
    row_ok = fn(w, torch.tensor([1])).numpy()
    fill = np.full(row_ok.shape[1:], _FILL[dtype], got.dtype)
    if op == "take":  # flat: one element per index
        np.testing.assert_array_equal(got[0], row_ok[0])
        np.testing.assert_array_equal(got[1:], np.full(2, _FILL[dtype], got.dtype))
    else:
        np.testing.assert_array_equal(got[0], row_ok[0])
        np.testing.assert_array_equal(got[1], fill)
        np.testing.assert_array_equal(got[2], fill)


@pytest.mark.parametrize("jit", [False, True])
def test_out_of_range_embedding_reads_nan_rows(jit):
    w = torch.randn(5, 4)
    call = lambda a, i: jaxtorch.call_torch(F.embedding, i, a)
    call = jax.jit(call) if jit else call
    got = np.asarray(call(_j(w), jnp.array([[2, 5], [-1, 4]])))
    np.testing.assert_array_equal(got[0, 0], w[2].numpy())
    np.testing.assert_array_equal(got[1, 1], w[4].numpy())
    assert np.isnan(got[0, 1]).all() and np.isnan(got[1, 0]).all()  # torch: IndexError; not row 4 nor clamped
    with pytest.raises(IndexError, match="index out of range in self"), jaxtorch.checks():
        jaxtorch.call_torch(F.embedding, jnp.array([5]), _j(w))


def test_take_along_dim_wraps_every_index_as_torch_does():
    w = torch.arange(12.0).reshape(4, 3)
    _check(lambda a, i: torch.take_along_dim(a, i, 0), w, torch.tensor([[5, -6, 3], [9, 0, -1]]))


def test_split_copy_into_an_out_list_copies_each_part_as_torch_does():
    """`torch.split_copy(x, 2, out=[a, b])` writes each part into its tensor (it raised
    AttributeError): cast to the tensor's dtype, no resizing, torch's errors for a wrong count/shape."""
    x = torch.arange(9.0).reshape(3, 3)
    for device in ("cpu", "jax"):
        _split_copy_into_list(x, device)


def _split_copy_into_list(x, device):
    with jaxtorch.default_env():
        outs = [torch.empty(2, 3, dtype=torch.int64, device=device), torch.empty(1, 3, device=device)]
        assert torch.split_copy(x.to(device), 2, 0, out=outs) is None
        assert outs[0].dtype == torch.int64 and outs[0].cpu().tolist() == [[0, 1, 2], [3, 4, 5]]
        assert outs[1].cpu().tolist() == [[6.0, 7.0, 8.0]]
        with pytest.raises(RuntimeError, match="expected an out= argument of size 2, got size 1"):
            torch.split_copy(x.to(device), 2, 0, out=[torch.empty(2, 3, device=device)])
        with pytest.raises(RuntimeError, match="must match the size"):
            torch.split_copy(x.to(device), 2, 0, out=[torch.empty(0, device=device), torch.empty(5, device=device)])


def test_view_copy_ops_are_the_view_then_a_copy():
    # issue 30 item 6: torchax's suite found these missing (UnsupportedOpError)
    x = torch.randn(3, 4)
    _check(lambda a: torch.select_copy(a, 1, 2), x)
    _check(lambda a: torch.slice_copy(a, 1, 1, 3), x)
    _check(lambda a: torch.split_copy(a, 3, 1), x)
    _check(lambda a: torch.detach_copy(a) * 2, x)
    _check(lambda a: torch.view_as_real_copy(torch.complex(a, -a)), x)
    _check(lambda a: torch._conj_copy(torch.complex(a, a)).imag, x)
    _check(lambda a: torch.unbind_copy(a, 1), x)
    _check(lambda a: torch.view_copy(a, (2, 6)), x)
    _check(lambda a: torch.select_copy(a, 0, -1, out=torch.empty(4, device=a.device)), x)

    def write_to_copy(a):  # a copy, not a view: writing to it leaves the input alone
        c = torch.select_copy(a, 0, 0)
        c.add_(100)
        return a, c

    _check(write_to_copy, x)
