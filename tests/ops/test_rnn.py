"""Recurrent networks (`jaxtorch/ops/rnn.py`) against eager PyTorch on the CPU.

Each module runs three ways: `jax.jit` of `extract`'s fn (forward), `jax.grad` of
`sum(out * cotangent)` with respect to parameters, input and initial state (against
`torch.autograd`), and PyTorch-first (`.to("jax")`, forward, `backward`, `.cpu()`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import jaxtorch
from jaxtorch.ops import rnn

TOL = 1e-5
GRAD_TOL = 1e-4
nn = torch.nn


def _j(t: torch.Tensor) -> jax.Array:
    return jnp.asarray(t.detach().numpy())


def _leaves(tree) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _close(got, ref, tol):
    got = jax.tree_util.tree_leaves(got)
    ref = _leaves(ref)
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        assert tuple(np.shape(g)) == tuple(r.shape)
        np.testing.assert_allclose(np.asarray(g), r.detach().cpu().numpy(), rtol=tol, atol=tol)


def _check_module(module: nn.Module, *inputs: torch.Tensor):
    """Forward under jax.jit and gradients (params, every float input) equal torch's."""
    ref = module(*inputs)
    params, fn = jaxtorch.extract(module)
    _close(jax.jit(fn)(params, *map(_j, inputs)), ref, TOL)

    gen = torch.Generator().manual_seed(1)
    cots = [torch.randn(o.shape, generator=gen) for o in _leaves(ref)]
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    loss = sum((o * c).sum() for o, c in zip(_leaves(module(*leaves)), cots))
    module.zero_grad()
    loss.backward()

    def jloss(p, xs):
        return sum(jnp.sum(o * _j(c)) for o, c in zip(jax.tree_util.tree_leaves(fn(p, *xs)), cots))

    gp, gx = jax.jit(jax.grad(jloss, argnums=(0, 1)))(params, [_j(x) for x in inputs])
    for name, p in module.named_parameters():
        np.testing.assert_allclose(np.asarray(gp[name]), p.grad.numpy(), rtol=GRAD_TOL, atol=GRAD_TOL, err_msg=name)
    for g, x in zip(gx, leaves):
        np.testing.assert_allclose(np.asarray(g), x.grad.numpy(), rtol=GRAD_TOL, atol=GRAD_TOL)


class _WithState(nn.Module):
    """Calls a recurrent module with an explicit initial state."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x, *state):
        return self.inner(x, state if len(state) > 1 else state[0])


SEQUENCE_CASES = {
    "lstm": lambda: nn.LSTM(4, 6),
    "lstm_2layer_bidirectional": lambda: nn.LSTM(4, 6, num_layers=2, bidirectional=True),
    "lstm_batch_first_proj": lambda: nn.LSTM(4, 6, num_layers=2, batch_first=True, proj_size=3),
    "lstm_bidirectional_proj_nobias": lambda: nn.LSTM(4, 6, bidirectional=True, proj_size=2, bias=False),
    "gru": lambda: nn.GRU(4, 6),
    "gru_3layer_bidirectional_batch_first": lambda: nn.GRU(4, 6, 3, batch_first=True, bidirectional=True),
    "gru_nobias": lambda: nn.GRU(4, 6, bias=False),
    "rnn_tanh_2layer": lambda: nn.RNN(4, 6, 2),
    "rnn_relu_bidirectional": lambda: nn.RNN(4, 6, nonlinearity="relu", bidirectional=True),
}


@pytest.mark.parametrize("name", list(SEQUENCE_CASES))
def test_sequence_module(name):
    _check_module(SEQUENCE_CASES[name](), torch.randn(5, 3, 4))


@pytest.mark.parametrize(
    "name", ["lstm_2layer_bidirectional", "lstm_batch_first_proj", "gru_3layer_bidirectional_batch_first"]
)
def test_initial_state(name):
    inner = SEQUENCE_CASES[name]()
    dirs = 2 if inner.bidirectional else 1
    h_size = inner.proj_size if getattr(inner, "proj_size", 0) else inner.hidden_size
    h0 = torch.randn(inner.num_layers * dirs, 3, h_size)
    state = (h0, torch.randn(inner.num_layers * dirs, 3, inner.hidden_size)) if isinstance(inner, nn.LSTM) else (h0,)
    _check_module(_WithState(inner), torch.randn(3, 5, 4) if inner.batch_first else torch.randn(5, 3, 4), *state)


def test_unbatched_sequence():
    _check_module(nn.LSTM(4, 6, 2, bidirectional=True), torch.randn(7, 4))


CELL_CASES = {
    "lstm_cell": lambda: nn.LSTMCell(4, 6),
    "gru_cell": lambda: nn.GRUCell(4, 6),
    "rnn_cell_tanh": lambda: nn.RNNCell(4, 6),
    "rnn_cell_relu_nobias": lambda: nn.RNNCell(4, 6, bias=False, nonlinearity="relu"),
}


@pytest.mark.parametrize("name", list(CELL_CASES))
@pytest.mark.parametrize("batched", [True, False])
def test_cell(name, batched):
    cell = CELL_CASES[name]()
    shape = (3,) if batched else ()
    h = torch.randn(*shape, 6)
    state = (h, torch.randn(*shape, 6)) if isinstance(cell, nn.LSTMCell) else (h,)
    _check_module(_WithState(cell), torch.randn(*shape, 4), *state)
    _check_module(cell, torch.randn(*shape, 4))  # zero initial state


class _Packed(nn.Module):
    """pack_padded_sequence (CPU lengths) -> module -> pad_packed_sequence."""

    def __init__(self, inner: nn.Module, lengths: torch.Tensor, enforce_sorted: bool = True):
        super().__init__()
        self.inner, self.lengths, self.enforce_sorted = inner, lengths, enforce_sorted

    def forward(self, x):
        packed = pack_padded_sequence(
            x, self.lengths, batch_first=self.inner.batch_first, enforce_sorted=self.enforce_sorted
        )
        out, state = self.inner(packed)
        padded, lengths = pad_packed_sequence(out, batch_first=self.inner.batch_first)
        return padded, state


PACKED_CASES = {
    "lstm_2layer_bidirectional": lambda: nn.LSTM(4, 6, 2, bidirectional=True),
    "gru_batch_first_bidirectional": lambda: nn.GRU(4, 6, batch_first=True, bidirectional=True),
    "rnn_tanh": lambda: nn.RNN(4, 6),
}


@pytest.mark.parametrize("name", list(PACKED_CASES))
def test_packed_sequence(name):
    inner = PACKED_CASES[name]()
    lengths = torch.tensor([5, 4, 3, 1])
    x = torch.randn(4, 5, 4) if inner.batch_first else torch.randn(5, 4, 4)
    _check_module(_Packed(inner, lengths), x)


def test_packed_unsorted_eager_and_under_jit():
    """enforce_sorted=False: the sequences go through the module in length order and come back
    in their own order. Eagerly equal to torch; under jax.jit `pad_packed_sequence` moves the
    (now traced) unsorted indices to the CPU in torch's Python code, which raises the clear
    data-dependent error naming that conversion."""
    m = _Packed(nn.GRU(4, 6), torch.tensor([3, 5, 1, 4]), enforce_sorted=False)
    x = torch.randn(5, 4, 4)
    params, fn = jaxtorch.extract(m)
    _close(fn(params, _j(x)), m(x), TOL)
    g = jax.grad(lambda p: fn(p, _j(x))[0].sum())(params)
    m.zero_grad()
    m(x)[0].sum().backward()
    for name, p in m.named_parameters():
        np.testing.assert_allclose(np.asarray(g[name]), p.grad.numpy(), rtol=GRAD_TOL, atol=GRAD_TOL, err_msg=name)
    with pytest.raises(jaxtorch.DataDependentError, match="conversion to a CPU torch.Tensor"):
        jax.jit(fn)(params, _j(x))


def test_packed_sequence_traced_lengths_raise():
    params, fn = jaxtorch.extract(nn.LSTM(4, 6))

    def run(p, x, lengths):
        return jaxtorch.call_torch(lambda x, n: pack_padded_sequence(x, n, enforce_sorted=False).data, x, lengths)

    with pytest.raises(jaxtorch.DataDependentError, match="PackedSequence"):
        jax.jit(run)(params, jnp.ones((5, 2, 4)), jnp.array([5, 3]))


def test_pytorch_first():
    """`.to("jax")`: forward, backward into `.grad`, packed input with CPU lengths, `.cpu()`."""
    jaxtorch.enable_globally()
    try:
        for ctor in [
            lambda: nn.LSTM(4, 6, 2, bidirectional=True, proj_size=3),
            lambda: nn.GRU(4, 6),
            lambda: nn.LSTMCell(4, 6),
        ]:
            ref_m = ctor()
            m = ctor().to("jax")
            m.load_state_dict(ref_m.state_dict())
            x = torch.randn(5, 3, 4) if not isinstance(ref_m, nn.RNNCellBase) else torch.randn(3, 4)
            ref = ref_m(x)
            out = m(x.to("jax"))
            _close([t.jax() for t in _leaves(out)], ref, TOL)
            sum(t.sum() for t in _leaves(ref)).backward()
            sum(t.sum() for t in _leaves(out)).backward()
            for (name, p), (_, q) in zip(ref_m.named_parameters(), m.named_parameters()):
                np.testing.assert_allclose(
                    q.grad.cpu().numpy(), p.grad.numpy(), rtol=GRAD_TOL, atol=GRAD_TOL, err_msg=name
                )
        ref_m = nn.LSTM(4, 6, bidirectional=True)
        m = nn.LSTM(4, 6, bidirectional=True).to("jax")
        m.load_state_dict(ref_m.state_dict())
        lengths = torch.tensor([2, 5, 3])
        x = torch.randn(5, 3, 4)
        ref, _ = pad_packed_sequence(ref_m(pack_padded_sequence(x, lengths, enforce_sorted=False))[0])
        packed = pack_padded_sequence(x.to("jax"), lengths, enforce_sorted=False)
        assert packed.batch_sizes.device.type == "cpu"  # as torch keeps it
        out, out_lengths = pad_packed_sequence(m(packed)[0])
        np.testing.assert_allclose(out.detach().cpu().numpy(), ref.detach().numpy(), rtol=TOL, atol=TOL)
        assert out_lengths.tolist() == lengths.tolist()
    finally:
        jaxtorch.disable_globally()


# ---- dropout between layers -------------------------------------------------------------------
def test_dropout_all_dropped_equals_torch():
    """p = 1 drops every activation between layers in torch too: a deterministic comparison."""
    m = nn.LSTM(4, 6, 2, dropout=1.0).train()
    x = torch.randn(5, 3, 4)
    params, fn = jaxtorch.extract(m)
    _close(jax.jit(fn)(params, _j(x), rng=jax.random.key(0)), m(x), TOL)


def test_dropout_uses_the_bridge_key():
    m = nn.GRU(4, 6, 3, dropout=0.5).train()
    params, fn = jaxtorch.extract(m)
    x = jnp.ones((5, 3, 4))
    f = jax.jit(lambda p, x, k: fn(p, x, rng=k)[0])
    a, b, c = f(params, x, jax.random.key(0)), f(params, x, jax.random.key(0)), f(params, x, jax.random.key(1))
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c)
    with pytest.raises(jaxtorch.MissingKeyError):
        jax.jit(fn)(params, x)
    m.eval()  # fn's mode was fixed by extract: still train mode
    with pytest.raises(jaxtorch.MissingKeyError):
        jax.jit(fn)(params, x)
    _, efn = jaxtorch.extract(m)  # no dropout in eval mode: no key needed, and equal to torch
    _close(jax.jit(efn)(params, x), m(torch.ones(5, 3, 4)), TOL)


# ---- tracing does not grow with the sequence ---------------------------------------------------
def _count_eqns(jaxpr) -> int:
    """Equations of `jaxpr`, those of nested jaxprs (scan bodies, custom rules) included."""
    n = 0
    for eqn in jaxpr.eqns:
        n += 1
        for v in eqn.params.values():
            for sub in v if isinstance(v, (list, tuple)) else [v]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    n += _count_eqns(inner)
    return n


def _grad_jaxpr(length: int):
    params, fn = jaxtorch.extract(nn.LSTM(4, 8, 2, bidirectional=True))
    return jax.make_jaxpr(jax.grad(lambda p, x: fn(p, x)[0].sum()))(params, jnp.ones((length, 2, 4))).jaxpr


def test_trace_size_independent_of_length():
    """A 1,000-step LSTM traces to the same program as a 10-step one: one scan per layer and
    direction, forward and backward (8 here), never one step per time step."""
    short, long = _grad_jaxpr(10), _grad_jaxpr(1000)
    assert _count_eqns(short) == _count_eqns(long)
    assert str(long).count("scan[") == str(short).count("scan[") == 8  # 2 layers x 2 directions x fwd/bwd


# ---- the fused cell kernels --------------------------------------------------------------------
def test_fused_lstm_cell_and_backward():
    B, H = 3, 5
    ig, hg, cx = torch.randn(B, 4 * H), torch.randn(B, 4 * H), torch.randn(B, H)
    bi, bh = torch.randn(4 * H), torch.randn(4 * H)
    hy, cy, ws = rnn.thnn_fused_lstm_cell(_j(ig), _j(hg), _j(cx), _j(bi), _j(bh))
    gates = (ig + bi + hg + bh).chunk(4, 1)
    i, f, g, o = gates[0].sigmoid(), gates[1].sigmoid(), gates[2].tanh(), gates[3].sigmoid()
    ref_cy = f * cx + i * g
    _close([hy, cy], [o * ref_cy.tanh(), ref_cy], TOL)
    ghy, gcy = torch.randn(B, H), torch.randn(B, H)
    ref = torch.ops.aten._thnn_differentiable_lstm_cell_backward(ghy, gcy, ig, hg, bi, bh, cx, ref_cy)
    got = rnn.thnn_fused_lstm_cell_backward_impl(_j(ghy), _j(gcy), _j(cx), cy, ws, True)
    _close(got, [ref[0], ref[2], ref[3]], TOL)


def test_fused_gru_cell_and_backward():
    B, H = 3, 5
    ig, hg, hx = torch.randn(B, 3 * H), torch.randn(B, 3 * H), torch.randn(B, H)
    bi, bh = torch.randn(3 * H), torch.randn(3 * H)
    hy, ws = rnn.thnn_fused_gru_cell(_j(ig), _j(hg), _j(hx), _j(bi), _j(bh))
    xr, xz, xn = (ig + bi).chunk(3, 1)
    hr, hz, hn = (hg + bh).chunk(3, 1)
    r, z = (xr + hr).sigmoid(), (xz + hz).sigmoid()
    n = (xn + r * hn).tanh()
    _close(hy, (1 - z) * n + z * hx, TOL)
    ghy = torch.randn(B, H)
    ref = torch.ops.aten._thnn_differentiable_gru_cell_backward(ghy, ig, hg, hx, bi, bh)
    _close(rnn.thnn_fused_gru_cell_backward(_j(ghy), ws, True), ref, TOL)


def test_packed_batch_sizes_stay_on_the_cpu_with_the_modes_on():
    """`batch_sizes` is host metadata torch requires on the CPU, also when the lowering runs with
    jaxtorch's modes active (`jax_by_default` would make its `torch.from_numpy` a jax tensor; a
    CI run's test order once did this)."""
    with jaxtorch.default_env(jax_by_default=True):
        x = torch.randn(5, 4, 4, device="jax")
        packed = pack_padded_sequence(x, torch.tensor([5, 4, 3, 1]))
        from jaxtorch.ops.rnn import pack_padded_sequence as lowering

        _, sizes = lowering(np.ones((5, 4, 4), np.float32), torch.tensor([5, 4, 3, 1]), False)
    assert packed.batch_sizes.device.type == "cpu" and sizes.device.type == "cpu"
    assert packed.batch_sizes.tolist() == [4, 3, 3, 2, 1]
