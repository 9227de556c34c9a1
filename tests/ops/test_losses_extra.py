"""Losses (`jaxtorch/ops/losses.py`) and embedding_bag against eager CPU torch, eagerly, under
jax.jit, and under jax.grad against torch.autograd: margin losses (weights, p=2, repeated
multilabel targets), CTC (padded and concatenated targets, tensor lengths, unbatched,
reductions, zero_infinity with infeasible targets), linear_cross_entropy (bias, class weights,
ignore_index), and embedding_bag (sum / mean / max, offsets, per_sample_weights,
include_last_offset, padding_idx) including the shapes of its auxiliary outputs.
"""

from __future__ import annotations

import warnings

import jax
import numpy as np
import pytest
import torch

import jaxtorch

from ._compare import check, compare, to_jax

F = torch.nn.functional
aten = torch.ops.aten


def _grad_check(fn, *tensors, argnum=0, tol=1e-4):
    """jax.grad of sum(fn(...) * cotangent) w.r.t. tensors[argnum] equals torch.autograd's."""
    torch.manual_seed(3)
    ref = fn(*tensors)
    cot = torch.randn(ref.shape)
    leaves = [t.clone().requires_grad_(i == argnum) for i, t in enumerate(tensors)]
    (ref_grad,) = torch.autograd.grad((fn(*leaves) * cot).sum(), leaves[argnum])

    def loss(x):
        arrays = [to_jax(t) for t in tensors]
        arrays[argnum] = x
        return (jaxtorch.call_torch(fn, *arrays) * to_jax(cot)).sum()

    got = jax.grad(loss)(to_jax(tensors[argnum]))
    np.testing.assert_allclose(np.asarray(got), ref_grad.numpy(), rtol=tol, atol=tol)


# ---- margin losses ----------------------------------------------------------------------------
@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("weighted", [False, True])
def test_multi_margin_loss(p, reduction, weighted):
    torch.manual_seed(0)
    x, y, w = torch.randn(6, 5), torch.randint(0, 5, (6,)), torch.rand(5)
    fn = lambda x, y, w: F.multi_margin_loss(
        x,
        y,
        p=p,
        margin=0.7,
        weight=w if weighted else None,
        reduction=reduction,
    )
    check(fn, x, y, w, tol=1e-5)
    _grad_check(fn, x, y, w)


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_multilabel_margin_loss(reduction):
    torch.manual_seed(0)
    x = torch.randn(4, 5)
    y = torch.tensor([[3, 0, -1, 1, 2], [1, 1, 4, -1, -1], [-1, 2, 2, 2, 2], [0, 1, 2, 3, 4]])  # repeats count twice
    fn = lambda x, y: F.multilabel_margin_loss(x, y, reduction=reduction)
    check(fn, x, y, tol=1e-5)
    check(lambda x, y: aten.multilabel_margin_loss_forward(x, y, 1), x, y, tol=1e-6)  # is_target too
    _grad_check(fn, x, y)


def test_margin_losses_backward_ops_on_jax_device():
    """torch autograd on the `jax` device runs multi_margin_loss_backward / multilabel_margin_loss_backward."""
    torch.manual_seed(0)
    x, y, yl = torch.randn(3, 4), torch.randint(0, 4, (3,)), torch.randint(-1, 4, (3, 4))

    def fn(x, y, yl):
        x = x.clone().requires_grad_()
        loss = F.multi_margin_loss(x, y, p=2) + F.multilabel_margin_loss(x, yl)
        (g,) = torch.autograd.grad(loss, x)
        return g

    check(fn, x, y, yl, jit=False, tol=1e-5)


# ---- ctc --------------------------------------------------------------------------------------
def _ctc_inputs(T=12, N=3, C=5, S=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    lp = torch.randn(T, N, C, generator=g).log_softmax(2)
    targets = torch.randint(1, C, (N, S), generator=g)
    targets[0, 1] = targets[0, 0]  # a repeated label needs a blank between
    return lp, targets, [12, 9, 7], [4, 3, 0]


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_ctc_loss_padded_targets(reduction):
    lp, targets, il, tl = _ctc_inputs()
    fn = lambda lp, t: F.ctc_loss(lp, t, il, tl, reduction=reduction)
    check(fn, lp, targets, tol=1e-4)
    _grad_check(fn, lp, targets)


def test_ctc_loss_concatenated_targets_tensor_lengths_blank():
    lp, targets, il, tl = _ctc_inputs()
    flat = torch.cat([targets[i, :n] for i, n in enumerate(tl)]) - 1  # labels 0..3, blank = 4
    il_t, tl_t = torch.tensor(il), torch.tensor(tl)
    fn = lambda lp, t, a, b: F.ctc_loss(lp, t, a, b, blank=4, reduction="sum")
    check(fn, lp, flat, il_t, tl_t, tol=1e-4)
    _grad_check(fn, lp, flat, il_t, tl_t)


def test_ctc_loss_unbatched():
    lp, targets, _, _ = _ctc_inputs()
    fn = lambda lp, t: F.ctc_loss(lp, t, [10], [4], reduction="none")
    check(fn, lp[:10, 0], targets[0], tol=1e-4)


@pytest.mark.parametrize("zero_infinity", [False, True])
def test_ctc_loss_infeasible_target(zero_infinity):
    """A target longer than the input has infinite loss; zero_infinity makes it (and its gradient) 0."""
    lp, targets, _, _ = _ctc_inputs()
    il, tl = [12, 2, 7], [4, 3, 2]
    fn = lambda lp, t: F.ctc_loss(lp, t, il, tl, reduction="none", zero_infinity=zero_infinity)
    check(fn, lp, targets, tol=1e-4)
    if zero_infinity:
        _grad_check(fn, lp, targets)


def test_ctc_loss_log_alpha_and_backward_op():
    """_ctc_loss's log_alpha where torch defines it, and _ctc_loss_backward (torch autograd on jax)."""
    lp, targets, il, tl = _ctc_inputs()
    ref_nll, ref_alpha = aten._ctc_loss(lp, targets, il, tl)
    nll, alpha = jaxtorch.call_torch(lambda a, b: aten._ctc_loss(a, b, il, tl), to_jax(lp), to_jax(targets))
    compare(ref_nll, nll, 1e-4)
    assert alpha.shape == tuple(ref_alpha.shape)
    for n in range(3):  # defined entries: t < input_length, s <= 2 * target_length
        compare(ref_alpha[n, : il[n], : 2 * tl[n] + 1], alpha[n, : il[n], : 2 * tl[n] + 1], 1e-4)

    def fn(lp, t):
        lp = lp.clone().requires_grad_()
        (g,) = torch.autograd.grad(F.ctc_loss(lp, t, il, tl), lp)
        return g

    check(fn, lp, targets, jit=False, tol=1e-4)


# ---- linear_cross_entropy ---------------------------------------------------------------------
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_linear_cross_entropy_chunked(reduction):
    torch.manual_seed(0)
    x, w, b, cw = torch.randn(7, 4), torch.randn(6, 4), torch.randn(6), torch.rand(6)
    y = torch.tensor([0, 5, 2, -100, 3, 3, 1])
    opts = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=2, allow_retain_graph=True)
    fn = lambda x, w, b, y, cw: F.linear_cross_entropy(
        x,
        w,
        y,
        linear_bias=b,
        weight=cw,
        reduction=reduction,
        ignore_index=-100,
        options=opts,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when it leaves the chunked custom op
        check(fn, x, w, b, y, cw, tol=1e-5)
    _grad_check(fn, x, w, b, y, cw, argnum=0)
    _grad_check(fn, x, w, b, y, cw, argnum=1)


def test_linear_cross_entropy_chunked_grads_output():
    """The mean op's precomputed gradients (what torch's backward scales) equal torch's."""
    import torch.nn.modules.linear_cross_entropy

    torch.manual_seed(0)
    x, w, b, y = torch.randn(5, 3), torch.randn(4, 3), torch.randn(4), torch.tensor([0, 3, -100, 1, 1])
    op = torch.ops.torch_nn._linear_cross_entropy_batch_chunked.default
    fn = lambda x, w, b, y: op(
        x,
        w,
        y,
        b,
        None,
        "mean",
        -100,
        0.0,
        2,
        "none",
        torch.float32,
        True,
        True,
        True,
        True,
    )
    check(fn, x, w, b, y, tol=1e-5)


# ---- embedding_bag ----------------------------------------------------------------------------
_IDX = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9, 0, 4])
_OFF = torch.tensor([0, 4, 4, 7])  # an empty bag in the middle


@pytest.mark.parametrize("op", [aten._embedding_bag_forward_only, aten._embedding_bag])
@pytest.mark.parametrize("mode", [0, 1, 2])
@pytest.mark.parametrize("padding_idx", [-1, 4])
@pytest.mark.parametrize("include_last_offset", [False, True])
def test_embedding_bag_outputs(op, mode, padding_idx, include_last_offset):
    """All four outputs (offset2bag, bag_size, max_indices included) match torch's values and shapes."""
    torch.manual_seed(0)
    w = torch.randn(10, 3)
    # with include_last_offset the last offset must be len(indices): torch's kernels disagree otherwise
    off = torch.cat([_OFF, torch.tensor([len(_IDX)])]) if include_last_offset else _OFF
    fn = lambda w, i, o: op(w, i, o, False, mode, False, None, include_last_offset, padding_idx)
    check(fn, w, _IDX, off, tol=1e-6)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_embedding_bag_functional_grad(mode):
    torch.manual_seed(0)
    w = torch.randn(10, 3)
    fn = lambda w, i, o: F.embedding_bag(i, w, o, mode=mode, padding_idx=4)
    check(fn, w, _IDX, _OFF, tol=1e-6)
    _grad_check(fn, w, _IDX, _OFF)


def test_embedding_bag_per_sample_weights_2d_input():
    torch.manual_seed(0)
    w, idx, psw = torch.randn(10, 3), torch.randint(0, 10, (4, 3)), torch.rand(4, 3)
    fn = lambda w, i, p: F.embedding_bag(i, w, per_sample_weights=p, mode="sum")
    check(fn, w, idx, psw, tol=1e-6)
    _grad_check(fn, w, idx, psw, argnum=0)
    _grad_check(fn, w, idx, psw, argnum=2)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_embedding_bag_backward_ops_on_jax_device(mode):
    """torch autograd on the `jax` device runs _embedding_bag's backward ops."""
    torch.manual_seed(0)
    w, psw = torch.randn(10, 3), torch.rand(10)

    def fn(w, i, o, p):
        w = w.clone().requires_grad_()
        p = p.clone().requires_grad_() if mode == "sum" else None
        out = F.embedding_bag(i, w, o, mode=mode, per_sample_weights=p, padding_idx=4)
        grads = torch.autograd.grad(
            (out * torch.arange(out.numel()).reshape(out.shape)).sum(), [w] if p is None else [w, p]
        )
        return tuple(grads)

    check(fn, w, _IDX, _OFF, psw, jit=False, tol=1e-5)


# ---- rrelu ------------------------------------------------------------------------------------
def test_rrelu_eval_exact():
    x = torch.linspace(-3, 3, 13)
    fn = lambda x: F.rrelu(x, 0.1, 0.4, training=False)
    check(fn, x, tol=1e-6)
    _grad_check(fn, x)


def test_rrelu_training_draws_slopes_and_records_noise():
    """Random, so not comparable with torch's draws: slopes lie in [lower, upper), the noise buffer
    holds them (1 for x > 0), and both torch autograd and jax.grad return the slope."""
    x = jnp_x = to_jax(torch.linspace(-3, 3, 13))

    def fn(x):
        noise = torch.empty_like(x)
        xg = x.clone().requires_grad_()
        y = torch.ops.aten.rrelu_with_noise(xg, noise, 0.1, 0.4, True)
        (g,) = torch.autograd.grad(y.sum(), xg)
        return y, noise, g

    y, noise, g = jaxtorch.call_torch(fn, jnp_x, rng=jax.random.key(0))
    y, noise, g, x = map(np.asarray, (y, noise, g, x))
    neg = x <= 0
    assert np.all((noise[neg] >= 0.1) & (noise[neg] < 0.4)) and np.all(noise[~neg] == 1)
    assert len(np.unique(noise[neg])) > 1
    np.testing.assert_allclose(y, x * noise, rtol=1e-6)
    np.testing.assert_allclose(g, noise, rtol=1e-6)
    jg = jax.grad(
        lambda x: jaxtorch.call_torch(lambda t: F.rrelu(t, 0.1, 0.4, training=True), x, rng=jax.random.key(0)).sum()
    )(jnp_x)
    assert np.all((np.asarray(jg)[neg] >= 0.1) & (np.asarray(jg)[neg] < 0.4)) and np.all(np.asarray(jg)[~neg] == 1)


# ---- batch norm: torch's CPU output shapes, running statistics, autograd on the jax device ------
@pytest.mark.parametrize("op", [aten.native_batch_norm.default, aten._native_batch_norm_legit.default])
@pytest.mark.parametrize("training", [False, True])
def test_batch_norm_outputs_and_running_stats(op, training):
    torch.manual_seed(0)
    x, w, b = torch.randn(4, 3, 5), torch.randn(3), torch.randn(3)
    rm, rv = torch.randn(3), torch.rand(3) + 0.5

    def fn(x, w, b, rm, rv):
        rm, rv = rm.clone(), rv.clone()
        out = op(x, w, b, rm, rv, training, 0.3, 1e-5)
        return (*out, rm, rv)  # save_mean/invstd are (0,) in eval, as on CPU

    check(fn, x, w, b, rm, rv, tol=1e-5)


def test_batch_norm_module_torch_autograd_on_jax_device():
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm1d(3)
    x = torch.randn(6, 3, 4)

    def fn(x):
        m = torch.nn.BatchNorm1d(3).to(x.device)
        m.load_state_dict(bn.state_dict())
        xg = x.clone().requires_grad_()
        y = m(xg)
        (gx, gw) = torch.autograd.grad((y * y).sum(), [xg, m.weight])
        m.eval()
        (ge,) = torch.autograd.grad(m(xg).sum() * 2, xg)
        return y.detach(), gx, gw, ge, m.running_mean, m.running_var, m.num_batches_tracked

    check(fn, x, jit=False, tol=1e-4)


# ---- cross entropy, kept whole ----------------------------------------------------------------
def _xent_cases():
    torch.manual_seed(0)
    t2 = torch.tensor([0, 4, -100, 2, 1, 3])
    t3 = torch.randint(0, 5, (3, 4))
    t3[0, 0] = -100
    return {
        "rows": (torch.randn(6, 5), t2),
        "spatial": (torch.randn(3, 5, 4), t3),
        "unbatched": (torch.randn(5), torch.tensor(2)),
        "probabilities": (torch.randn(6, 5), torch.rand(6, 5).softmax(1)),
    }


@pytest.mark.parametrize("case", ["rows", "spatial", "unbatched", "probabilities"])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_cross_entropy(case, reduction, weighted, smoothing):
    x, y = _xent_cases()[case]
    w = torch.rand(5) + 0.1
    fn = lambda x, y, w: F.cross_entropy(
        x,
        y,
        weight=w if weighted else None,
        reduction=reduction,
        label_smoothing=smoothing,
    )
    check(fn, x, y, w, tol=1e-5)
    _grad_check(fn, x, y, w, tol=1e-5)


def test_cross_entropy_all_targets_ignored():
    """mean over no kept target: NaN like torch, and a zero gradient like torch's backward."""
    x, y = torch.randn(3, 4), torch.full((3,), -100)
    check(lambda x, y: F.cross_entropy(x, y), x, y, tol=0)
    g = jax.grad(lambda a: jaxtorch.call_torch(lambda a, y: F.cross_entropy(a, y), a, to_jax(y)))(to_jax(x))
    xr = x.clone().requires_grad_()
    F.cross_entropy(xr, y).backward()
    np.testing.assert_array_equal(np.asarray(g), xr.grad.numpy())


def test_cross_entropy_under_torch_autograd_on_jax_device():
    """With torch autograd recording on the `jax` device, cross entropy takes torch's decomposition."""
    x, y = _xent_cases()["rows"]

    def fn(x, y):
        x = x.clone().requires_grad_()
        (g,) = torch.autograd.grad(F.cross_entropy(x, y, label_smoothing=0.1), x)
        return g

    check(fn, x, y, jit=False, tol=1e-5)


def test_cross_entropy_gradient_keeps_one_logit_sized_buffer():
    """The LM-head case: jit(grad) of cross_entropy(h @ W.T) keeps one (rows, classes) buffer (the
    logits' gradient is written over the logits), not also the log-probabilities that autodiff
    of log_softmax + nll keeps (2x before cross entropy was kept whole)."""
    n, c, d = 256, 2048, 64
    h, w = jax.random.normal(jax.random.key(0), (n, d)), jax.random.normal(jax.random.key(1), (c, d))
    y = jax.random.randint(jax.random.key(2), (n,), 0, c)

    def loss(h, w):
        return jaxtorch.call_torch(lambda h, w, y: F.cross_entropy(h @ w.T, y), h, w, y)

    temp = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(h, w).compile().memory_analysis().temp_size_in_bytes
    assert temp <= 1.5 * n * c * 4, temp / (n * c * 4)


def test_language_model_train_step_keeps_one_logit_sized_buffer():
    """In a whole GPT-2 train step the loss's pick of the target logits is ordered before the
    logits' gradient, which is then written over the logits: the compiled step's temporaries
    hold one (tokens, vocab) buffer, not two (2.65x the logits before, 1.65x after)."""
    import optax
    import transformers

    from jaxtorch.train import make_train_step

    cfg = transformers.GPT2Config(
        vocab_size=4096, n_positions=64, n_embd=64, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).train()
    ids = to_jax(torch.randint(0, 4096, (4, 64)))
    logits = 4 * 64 * 4096 * 4
    totals = {}
    for donate in (False, True):
        init, step = make_train_step(model, lambda out, _: out.loss, optax.adam(1e-3), donate=donate)
        lowered = step.lower(init(), {"input_ids": ids, "labels": ids}, None, jax.random.key(0))
        m = lowered.compile().memory_analysis()
        totals[donate] = (
            m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
        )
        if not donate:  # (donation moves buffers between arguments and temporaries: compare totals there)
            assert m.temp_size_in_bytes < 2.0 * logits, m.temp_size_in_bytes / logits
    assert totals[True] < totals[False], totals  # the default donates: less memory in all
