"""Neural-network lowerings (`jaxtorch/ops/nn.py`, `attention.py`) against eager CPU torch.

Covers forms the OpInfo samples leave out: transposed grouped convolutions with output_padding,
'same' padding, pooling with ceil_mode / count_include_pad / divisor_override / dilation and the
indices torch returns, batch norm running statistics, half-precision softmax, losses with
ignore_index and weights, resampling with align_corners, grid sampling, dropout, fused attention
(causal, bool and float masks, GQA), gradients via `jax.grad` against `torch.autograd`, and
torch autograd on the `jax` device running the backward ops (`convolution_backward`, ...).
"""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxtorch

F = torch.nn.functional


def _jax(t):
    return jnp.asarray(t.numpy()) if isinstance(t, torch.Tensor) else t


def _run(fn, *tensors, jit=False):
    call = lambda *arrays: jaxtorch.call_torch(fn, *arrays)
    return (jax.jit(call) if jit else call)(*[_jax(t) for t in tensors])


def _check(ref, got, tol=1e-5):
    if isinstance(ref, (tuple, list)):
        assert len(ref) == len(got)
        for r, g in zip(ref, got):
            _check(r, g, tol)
        return
    r, g = ref.detach().numpy(), np.asarray(got)
    assert g.shape == r.shape, (g.shape, r.shape)
    if r.dtype.kind in "iub":
        np.testing.assert_array_equal(g, r)
    else:
        np.testing.assert_allclose(g, r, rtol=tol, atol=tol)


def _both(fn, *tensors, tol=1e-5):
    """Eager and jitted results equal torch's."""
    ref = fn(*tensors)
    _check(ref, _run(fn, *tensors), tol)
    _check(ref, _run(fn, *tensors, jit=True), tol)


def _grad_check(fn, *tensors, tol=1e-4):
    """jax.grad of sum(fn(...) * cotangent) w.r.t. every float input equals torch.autograd's."""
    ref_out = fn(*tensors)
    cot = torch.randn(ref_out.shape)
    leaves = [t.clone().requires_grad_(t.is_floating_point()) for t in tensors]
    (fn(*leaves) * cot).sum().backward()
    argnums = tuple(i for i, t in enumerate(tensors) if t.is_floating_point())

    def loss(*arrays):
        return jnp.sum(jaxtorch.call_torch(fn, *arrays) * _jax(cot))

    grads = jax.jit(jax.grad(loss, argnums=argnums))(*[_jax(t) for t in tensors])
    for i, g in zip(argnums, grads):
        np.testing.assert_allclose(np.asarray(g), leaves[i].grad.numpy(), rtol=tol, atol=tol)


# ---- convolution ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "case",
    [
        dict(dim=1, stride=2, padding=1, dilation=1, groups=1),
        dict(dim=2, stride=1, padding="same", dilation=2, groups=1),
        dict(dim=2, stride=(2, 1), padding=(1, 0), dilation=1, groups=2),
        dict(dim=3, stride=1, padding=1, dilation=1, groups=1),
    ],
)
def test_conv(case):
    d, g = case["dim"], case["groups"]
    x = torch.randn((2, 4) + (7,) * d)
    w = torch.randn((6, 4 // g) + (3,) * d)
    b = torch.randn(6)
    conv = getattr(F, f"conv{d}d")
    fn = lambda x, w, b: conv(
        x,
        w,
        b,
        stride=case["stride"],
        padding=case["padding"],
        dilation=case["dilation"],
        groups=g,
    )
    _both(fn, x, w, b, tol=1e-4)
    _grad_check(fn, x, w, b, tol=1e-3)


@pytest.mark.parametrize(
    "case",
    [
        dict(dim=1, mult=2, stride=2, padding=2, dilation=1, k=5),
        dict(dim=2, mult=1, stride=(2, 1), padding=(1, 0), dilation=(1, 2), k=3),
        dict(dim=2, mult=3, stride=1, padding="same", dilation=1, k=7),
        dict(dim=3, mult=1, stride=1, padding=1, dilation=1, k=3),
    ],
)
def test_depthwise_conv(case):
    """groups == input channels (with a channel multiplier): lowered as a sum of shifted slices."""
    d, c = case["dim"], 4
    x = torch.randn((2, c) + (9,) * d)
    w = torch.randn((c * case["mult"], 1) + (case["k"],) * d)
    b = torch.randn(c * case["mult"])
    conv = getattr(F, f"conv{d}d")
    fn = lambda x, w, b: conv(
        x,
        w,
        b,
        stride=case["stride"],
        padding=case["padding"],
        dilation=case["dilation"],
        groups=c,
    )
    _both(fn, x, w, b, tol=1e-4)
    _grad_check(fn, x, w, b, tol=1e-4)
    # bfloat16 accumulates in float32, as torch's CPU kernel does
    xh, wh = x.bfloat16(), w.bfloat16()
    got = _run(lambda x, w: fn(x, w, None), *(_jax(t.float()).astype(jnp.bfloat16) for t in (xh, wh)))
    _check(fn(xh, wh, None).float(), got.astype(jnp.float32), tol=1e-2)
    # torch autograd on the jax device runs convolution_backward through the same lowering
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    fn(*leaves).square().sum().backward()
    with jaxtorch.default_env():
        dev = [t.to("jax").requires_grad_() for t in (x, w, b)]
        fn(*dev).square().sum().backward()
    for t, tj in zip(leaves, dev):
        np.testing.assert_allclose(tj.grad.cpu().numpy(), t.grad.numpy(), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("dim,groups,output_padding", [(1, 1, 1), (2, 2, 1), (2, 1, 0), (3, 1, 0)])
def test_conv_transpose(dim, groups, output_padding):
    x = torch.randn((2, 4) + (5,) * dim)
    w = torch.randn((4, 6 // groups) + (3,) * dim)
    conv = getattr(F, f"conv_transpose{dim}d")
    fn = lambda x, w: conv(
        x,
        w,
        stride=2,
        padding=1,
        output_padding=output_padding,
        groups=groups,
        dilation=1,
    )
    _both(fn, x, w, tol=1e-4)
    _grad_check(fn, x, w, tol=1e-3)


# ---- pooling ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw",
    [
        dict(kernel_size=2),
        dict(kernel_size=3, stride=2, padding=1, ceil_mode=True),
        dict(kernel_size=3, stride=2, padding=1, dilation=2),
    ],
)
def test_max_pool2d_with_indices(kw):
    x = torch.randn(2, 3, 9, 8)
    x[0, 0, 0, :3] = float("nan")
    _both(lambda x: F.max_pool2d(x, return_indices=True, **kw), x)
    _grad_check(lambda x: F.max_pool2d(x, **kw), torch.randn(2, 3, 9, 8))


def test_max_pool_1d_3d():
    _both(lambda x: F.max_pool1d(x, 3, 2, 1, return_indices=True), torch.randn(2, 3, 10))
    _both(lambda x: F.max_pool3d(x, 2, ceil_mode=True, return_indices=True), torch.randn(1, 2, 5, 5, 5))


@pytest.mark.parametrize(
    "kw",
    [
        dict(kernel_size=3, stride=2, padding=1, ceil_mode=True, count_include_pad=True),
        dict(kernel_size=3, stride=2, padding=1, ceil_mode=True, count_include_pad=False),
        dict(kernel_size=2, divisor_override=3),
    ],
)
def test_avg_pool2d(kw):
    x = torch.randn(2, 3, 9, 8)
    _both(lambda x: F.avg_pool2d(x, **kw), x)
    _grad_check(lambda x: F.avg_pool2d(x, **kw), x)


@pytest.mark.parametrize("out", [(1, 1), (3, 4), (4, 3)])
def test_adaptive_pools(out):
    x = torch.randn(2, 3, 8, 10)
    _both(lambda x: F.adaptive_avg_pool2d(x, out), x)
    _both(lambda x: F.adaptive_max_pool2d(x, out, return_indices=True), x)
    _grad_check(lambda x: F.adaptive_avg_pool2d(x, out), x)


# ---- normalization ----------------------------------------------------------------------------
def test_norms_forward_and_grad():
    x = torch.randn(4, 6, 5, 5)
    w, b = torch.randn(6), torch.randn(6)
    _both(lambda x, w, b: F.group_norm(x, 3, w, b), x, w, b)
    _grad_check(lambda x, w, b: F.group_norm(x, 3, w, b), x, w, b)
    _both(lambda x, w, b: F.layer_norm(x, (5,), w[:5], b[:5]), x, w, b)
    _grad_check(lambda x, w: F.layer_norm(x, (5, 5), None, None) * w.sum(), x, w)
    rm, rv = torch.randn(6), torch.rand(6) + 0.5
    _both(lambda x, w, b: F.batch_norm(x, rm, rv, w, b, training=False), x, w, b)
    _grad_check(lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True), x, w, b)


def test_norm_weight_shapes_accepted_and_refused_as_torch_does():
    # issue 30 item 6: F.batch_norm with a (1, C, 1, 1) weight crashed with a JAX broadcasting error
    x = torch.randn(2, 3, 4, 5)
    w, b = torch.randn(1, 3, 1, 1), torch.randn(3, 1)  # torch accepts any C elements, forward
    rm, rv = torch.randn(3), torch.rand(3) + 0.5
    _both(lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True), x, w, b)
    _both(lambda x, w, b: F.batch_norm(x, rm, rv, w, b, training=False), x, w, b)
    refused = {  # torch refuses these: so does jaxtorch, with torch's message
        "should contain 3 elements not 4": lambda x, w, b: F.batch_norm(x, None, None, torch.ones(4), None, True),
        "expected 1 dims but tensor has 4": lambda x, w, b: F.batch_norm(x, w, torch.ones(3), training=False),
        "Expected weight to be of same shape": lambda x, w, b: F.layer_norm(x, (4, 5), torch.ones(1, 4, 5)),
        "Expected bias to be of same shape": lambda x, w, b: F.layer_norm(x, (4, 5), None, torch.ones(20)),
        "a vector of size equal to the number of channels": lambda x, w, b: F.group_norm(x, 3, w),
        "repeat dims can not be smaller": lambda x, w, b: F.instance_norm(x, weight=w, bias=w),
    }
    for message, fn in refused.items():
        with pytest.raises(RuntimeError, match=message):
            fn(x, w, b)
        with pytest.raises(RuntimeError, match=message):
            _run(fn, x, w, b)
    xj, wj = x.to("jax").requires_grad_(), w.to("jax").requires_grad_()
    with pytest.raises(RuntimeError, match="expected 1 dims but tensor has 4"):  # torch's backward refuses it
        F.batch_norm(xj, None, None, wj, None, training=True).sum().backward()


def test_batchnorm_train_updates_running_stats_on_jax_device():
    bn_ref = torch.nn.BatchNorm2d(3)
    bn = torch.nn.BatchNorm2d(3)
    x = torch.randn(4, 3, 5, 5)
    with jaxtorch.default_env():
        bn = bn.to("jax")
        y = bn(x.to("jax")).detach().cpu()
        rm, rv = bn.running_mean.cpu(), bn.running_var.cpu()
    y_ref = bn_ref(x)
    _check(y_ref, y)
    _check(bn_ref.running_mean, rm)
    _check(bn_ref.running_var, rv)


def test_batchnorm_running_stats_through_extract():
    m = torch.nn.BatchNorm1d(4)
    params, fn = jaxtorch.extract(m, mutable=True)
    x = torch.randn(8, 4)
    out, new_state = jax.jit(fn)(params, _jax(x))
    ref = m(x)
    _check(ref, out)
    _check(m.running_mean, new_state["running_mean"])
    _check(m.running_var, new_state["running_var"])


def test_softmax_half_computes_in_float32():
    x = (torch.randn(4, 50) * 8).to(torch.bfloat16)
    for fn in (
        lambda x: F.softmax(x, -1),
        lambda x: F.log_softmax(x, -1),
        lambda x: F.softmax(x, -1, dtype=torch.float32),
    ):
        ref = fn(x).float()
        got = np.asarray(
            jaxtorch.call_torch(fn, jnp.asarray(x.float().numpy()).astype(jnp.bfloat16)).astype(jnp.float32)
        )
        np.testing.assert_allclose(got, ref.numpy(), rtol=1e-2, atol=1e-2)


# ---- activations ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "fn",
    [
        lambda x: F.gelu(x),
        lambda x: F.gelu(x, approximate="tanh"),
        F.silu,
        F.mish,
        F.hardswish,
        F.hardsigmoid,
        F.elu,
        lambda x: F.celu(x, 0.7),
        F.selu,
        lambda x: F.leaky_relu(x, 0.2),
        F.relu,
        F.relu6,
        lambda x: F.hardtanh(x, -0.5, 0.7),
        lambda x: F.threshold(x, 0.1, -2.0),
        lambda x: F.glu(x, 1),
        F.logsigmoid,
        lambda x: F.softplus(x, 2.0, 3.0),
        lambda x: F.prelu(x, torch.tensor([0.1, 0.2, 0.3, 0.4], device=x.device)),
    ],
    ids=lambda f: getattr(f, "__name__", "lambda"),
)
def test_activation_forward_grad_and_device_backward(fn):
    x = torch.randn(3, 4, 6) * 3
    _both(fn, x)
    _grad_check(fn, x)
    # torch autograd on the jax device runs the *_backward ops through jaxtorch
    xc = x.clone().requires_grad_()
    fn(xc).sum().backward()
    with jaxtorch.default_env():
        xj = x.to("jax").requires_grad_()
        fn(xj).sum().backward()
        gj = xj.grad.cpu()
    np.testing.assert_allclose(gj.numpy(), xc.grad.numpy(), rtol=1e-5, atol=1e-5)


# ---- embedding, losses ------------------------------------------------------------------------
def test_embedding_padding_idx_gets_no_grad():
    w = torch.randn(10, 4)
    idx = torch.tensor([[0, 2, 3], [3, 0, 9]])
    fn = lambda w: F.embedding(idx, w, padding_idx=3)
    _both(fn, w)
    _grad_check(fn, w)


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_classification_losses(reduction):
    x = torch.randn(6, 5)
    t = torch.tensor([0, 4, -100, 2, 2, 1])
    w = torch.rand(5)
    _both(lambda x: F.cross_entropy(x, t, weight=w, reduction=reduction), x)
    _grad_check(lambda x: F.cross_entropy(x, t, weight=w, reduction=reduction), x)
    x2, t2 = torch.randn(2, 5, 3, 3), torch.randint(0, 5, (2, 3, 3))
    _both(lambda x: F.cross_entropy(x, t2, reduction=reduction, label_smoothing=0.1), x2)
    _both(lambda x: F.nll_loss(F.log_softmax(x, 1), t2, reduction=reduction), x2)


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_regression_losses(reduction):
    x, y = torch.randn(4, 7), torch.randn(4, 7)
    p, q = torch.rand(4, 7) * 0.98 + 0.01, torch.rand(4, 7)
    for fn, a, b in [
        (lambda a, b: F.mse_loss(a, b, reduction=reduction), x, y),
        (lambda a, b: F.l1_loss(a, b, reduction=reduction), x, y),
        (lambda a, b: F.smooth_l1_loss(a, b, reduction=reduction, beta=0.5), x, y),
        (lambda a, b: F.huber_loss(a, b, reduction=reduction, delta=0.7), x, y),
        (lambda a, b: F.binary_cross_entropy(a, b, reduction=reduction), p, q),
        (
            lambda a, b: F.binary_cross_entropy_with_logits(a, b, reduction=reduction, pos_weight=torch.ones(7) * 2),
            x,
            q,
        ),
        (
            lambda a, b: F.kl_div(F.log_softmax(a, -1), b, reduction="batchmean" if reduction == "mean" else reduction),
            x,
            q,
        ),
    ]:
        _both(fn, a, b)
        _grad_check(fn, a, b)


# ---- resampling -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "mode,align",
    [
        ("nearest", None),
        ("nearest-exact", None),
        ("bilinear", False),
        ("bilinear", True),
        ("bicubic", False),
        ("bicubic", True),
    ],
)
def test_interpolate(mode, align):
    x = torch.randn(2, 3, 5, 7)
    for kw in (dict(size=(8, 11)), dict(scale_factor=1.5), dict(size=(3, 4))):
        fn = lambda x: F.interpolate(x, mode=mode, align_corners=align, **kw)
        _both(fn, x, tol=1e-4)
        _grad_check(fn, x)


@pytest.mark.parametrize("mode", ["bilinear", "nearest", "bicubic"])
@pytest.mark.parametrize("padding_mode", ["zeros", "border", "reflection"])
def test_grid_sample(mode, padding_mode):
    x, g = torch.randn(2, 3, 5, 7), torch.rand(2, 4, 6, 2) * 2.4 - 1.2
    for align in (False, True):
        fn = lambda x: F.grid_sample(x, g, mode=mode, padding_mode=padding_mode, align_corners=align)
        _both(fn, x, tol=1e-4)


def test_shuffles_unfold_fold_one_hot():
    x = torch.randn(2, 8, 3, 5)
    _both(lambda x: F.pixel_shuffle(x, 2), x)
    _both(lambda x: F.pixel_unshuffle(x, 1), x)
    _both(lambda x: F.unfold(x, (2, 3), dilation=1, padding=1, stride=2), x)
    cols = torch.randn(2, 12, 18)
    _both(lambda c: F.fold(c, (5, 6), (2, 3), padding=1, stride=(2, 1)), cols)
    _check(F.one_hot(torch.tensor([2, 0, 1]), 4), _run(lambda t: F.one_hot(t, 4), torch.tensor([2, 0, 1]), jit=True))


# ---- dropout ----------------------------------------------------------------------------------
def test_dropout_is_keyed_and_scaled():
    x = jnp.ones((1000,))
    a = jaxtorch.call_torch(lambda x: F.dropout(x, 0.25, True), x, rng=jax.random.key(0))
    b = jaxtorch.call_torch(lambda x: F.dropout(x, 0.25, True), x, rng=jax.random.key(0))
    c = jaxtorch.call_torch(lambda x: F.dropout(x, 0.25, True), x, rng=jax.random.key(1))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    kept = np.asarray(a) != 0
    np.testing.assert_allclose(np.asarray(a)[kept], 1 / 0.75, rtol=1e-6)
    assert 0.65 < kept.mean() < 0.85
    np.testing.assert_array_equal(jaxtorch.call_torch(lambda x: F.dropout(x, 0.25, False), x), x)


# ---- attention --------------------------------------------------------------------------------
@pytest.mark.parametrize("kw", [dict(is_causal=True), dict(mask="bool"), dict(mask="float", scale=0.3), dict()])
@pytest.mark.parametrize("gqa", [False, True])
def test_sdpa(kw, gqa):
    kw = dict(kw)
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 3)
    if not gqa:
        k, v = k.repeat(1, 2, 1, 1), v.repeat(1, 2, 1, 1)
    mask = kw.pop("mask", None)
    m = {"bool": torch.rand(5, 6) > 0.3, "float": torch.randn(2, 1, 5, 6), None: None}[mask]
    fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=gqa, **kw)
    _both(fn, q, k, v)
    _grad_check(fn, q, k, v)


@pytest.mark.parametrize("shape", [(2, 3, 128, 16), (1, 2, 256, 8), (4, 128, 32)])
def test_causal_self_attention_is_one_product_each_way(shape):
    """Causal self-attention is two products around one masked softmax (query blocks gave XLA
    4x the kernels to compile, benchmarks/README.md "Time to first result"), with torch's values
    and gradients."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(shape) for _ in range(3))
    fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    _both(fn, q, k, v)
    _grad_check(fn, q, k, v)
    jaxpr = jax.make_jaxpr(lambda *a: jaxtorch.call_torch(fn, *a))(*[_jax(t) for t in (q, k, v)])
    assert str(jaxpr).count("dot_general") == 2


def test_sdpa_reaches_jaxtorch_whole():
    """The fused op, not torch's 'math' decomposition, is what the interpreter lowers."""
    from jaxtorch.bridge.dispatch import _interpreter as interpreter

    seen = []
    orig = interpreter.dispatch

    def spy(func, args, kwargs):
        seen.append(func)
        return orig(func, args, kwargs)

    interpreter.dispatch = spy
    try:
        q = jnp.ones((1, 2, 3, 4))
        jaxtorch.call_torch(lambda q: F.scaled_dot_product_attention(q, q, q, is_causal=True), q)
    finally:
        interpreter.dispatch = orig
    assert seen == [torch.ops.aten.scaled_dot_product_attention.default]


def test_sdpa_autograd_on_jax_device():
    q, k, v = torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    qc = q.clone().requires_grad_()
    F.scaled_dot_product_attention(qc, k, v, is_causal=True).sum().backward()
    with jaxtorch.default_env():
        qj = q.to("jax").requires_grad_()
        F.scaled_dot_product_attention(qj, k.to("jax"), v.to("jax"), is_causal=True).sum().backward()
        g = qj.grad.cpu()
    np.testing.assert_allclose(g.numpy(), qc.grad.numpy(), rtol=1e-5, atol=1e-5)


# ---- a small CNN, both ways ---------------------------------------------------------------------
class SmallCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1, bias=False),
            torch.nn.BatchNorm2d(8),
            torch.nn.ReLU(inplace=True),
            torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(8, 16, 3, padding=1),
            torch.nn.BatchNorm2d(16),
            torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d((1, 1)),
        )
        self.head = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Dropout(0.5), torch.nn.Linear(16, 10))

    def forward(self, x):
        return self.head(self.features(x))


def test_cnn_extract_jit_grad_eval():
    m = SmallCNN().eval()
    x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))
    params, fn = jaxtorch.extract(m)
    _check(m(x), jax.jit(fn)(params, _jax(x)), 1e-5)
    floats = {k: v for k, v in params.items() if jnp.issubdtype(v.dtype, jnp.floating)}

    def loss(f):
        logits = fn({**params, **f}, _jax(x))
        return jaxtorch.call_torch(F.cross_entropy, logits, _jax(y))

    grads = jax.jit(jax.grad(loss))(floats)
    F.cross_entropy(m(x), y).backward()
    for name, p in m.named_parameters():
        np.testing.assert_allclose(np.asarray(grads[name]), p.grad.numpy(), rtol=1e-4, atol=1e-5)


def test_cnn_train_on_jax_device_backward():
    m = SmallCNN().train()
    m.head[1].p = 0.0  # deterministic comparison; dropout itself is tested above
    mj = SmallCNN()
    mj.load_state_dict(m.state_dict())
    x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))
    loss = F.cross_entropy(m(x), y)
    loss.backward()
    with jaxtorch.default_env():
        mj = mj.to("jax").train()
        mj.head[1].p = 0.0
        lj = F.cross_entropy(mj(x.to("jax")), y.to("jax"))
        lj.backward()
        assert abs(lj.item() - loss.item()) < 1e-5
        for (name, p), pj in zip(m.named_parameters(), mj.parameters()):
            np.testing.assert_allclose(pj.grad.cpu().numpy(), p.grad.numpy(), rtol=1e-4, atol=1e-5, err_msg=name)
        np.testing.assert_allclose(
            mj.features[1].running_var.cpu().numpy(), m.features[1].running_var.numpy(), rtol=1e-5, atol=1e-6
        )


def test_cnn_train_mode_dropout_under_jit_needs_and_uses_rng():
    m = SmallCNN().train()
    params, fn = jaxtorch.extract(m, mutable=True)  # (train-mode BatchNorm writes its statistics)
    x = _jax(torch.randn(2, 3, 16, 16))
    a, _ = jax.jit(fn)(params, x, rng=jax.random.key(0))
    b, _ = jax.jit(fn)(params, x, rng=jax.random.key(1))
    assert a.shape == (2, 10) and not np.allclose(a, b)


def test_rms_norm_kept_whole_and_differentiable_on_device():
    x, w = torch.randn(3, 5, 8), torch.randn(8)
    for eps in (None, 1e-3):
        _both(lambda x, w: F.rms_norm(x, (8,), w, eps), x, w)
    _grad_check(lambda x, w: F.rms_norm(x, (8,), w), x, w)
    xc = x.clone().requires_grad_()
    F.rms_norm(xc, (8,), w).sum().backward()
    with jaxtorch.default_env():
        xj = x.to("jax").requires_grad_()
        F.rms_norm(xj, (8,), w.to("jax")).sum().backward()
        g = xj.grad.cpu()
    np.testing.assert_allclose(g.numpy(), xc.grad.numpy(), rtol=1e-5, atol=1e-5)


def test_max_unpool_and_bilinear():
    x = torch.randn(2, 3, 8, 8)
    vals, idx = F.max_pool2d(x, 2, return_indices=True)
    fn = lambda v: F.max_unpool2d(v, idx, 2, output_size=(8, 8))
    _both(fn, vals)
    _grad_check(fn, vals)
    a, b, w, bias = torch.randn(4, 3), torch.randn(4, 5), torch.randn(2, 3, 5), torch.randn(2)
    _both(F.bilinear, a, b, w, bias)
    _grad_check(F.bilinear, a, b, w, bias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.complex64])
@pytest.mark.parametrize("op", ["tanh_backward", "sigmoid_backward"])
def test_activation_backward_from_output_matches_cpu_kernel(op, dtype):
    """tanh/sigmoid backward lowerings (not torch's 3-op decompositions) equal the CPU kernels."""
    f = getattr(torch.ops.aten, op).default
    g = torch.Generator().manual_seed(0)
    y, grad = torch.rand(40, 30, generator=g).to(dtype), torch.randn(40, 30, generator=g).to(dtype)
    if dtype.is_complex:
        y, grad = y + 0.3j * torch.rand(40, 30, generator=g), grad + 1j * torch.randn(40, 30, generator=g)
    want = f(grad, y)
    got = f(grad.to("jax"), y.to("jax")).cpu()
    if dtype.is_complex:  # the CPU kernel's complex products round differently
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(got, want)


# ---- nn.TransformerEncoder(Layer)'s eval fast path (aten._transformer_encoder_layer_fwd) -----------
def _encoder_pair(norm_first, activation, nested=True, final_norm=False):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(
        8, 2, 16, dropout=0.0, activation=activation, batch_first=True, norm_first=norm_first
    )
    norm = torch.nn.LayerNorm(8) if final_norm else None
    enc = torch.nn.TransformerEncoder(layer, 2, norm=norm, enable_nested_tensor=nested).eval()
    return layer.eval(), enc


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_transformer_encoder_fast_path_matches_cpu(norm_first, activation):
    # issue 30 item 12: the fused eval-mode layer was an UnsupportedOpError
    layer, enc = _encoder_pair(norm_first, activation, nested=norm_first)  # nested: see the next test
    x = torch.randn(3, 5, 8)
    pad = torch.tensor([[False] * 5, [False, False, False, True, True], [False] * 4 + [True]])
    causal = torch.nn.Transformer.generate_square_subsequent_mask(5) < 0  # bool: True masks out
    calls = {
        "layer": lambda m, x: m(x),
        "layer_pad": lambda m, x: m(x, src_key_padding_mask=pad.to(x.device)),
        "layer_causal_pad": lambda m, x: m(x, src_mask=causal.to(x.device), src_key_padding_mask=pad.to(x.device)),
        "encoder": lambda m, x: m(x),
        "encoder_pad": lambda m, x: m(x, src_key_padding_mask=pad.to(x.device)),
    }
    for name, call in calls.items():
        module = layer if name.startswith("layer") else enc
        with torch.no_grad():
            want = call(module, x)
            got = call(copy.deepcopy(module).to("jax"), x.to("jax")).cpu()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("final_norm", [False, True])
def test_transformer_encoder_nested_path_refused_naming_the_flag(final_norm):
    layer, enc = _encoder_pair(False, "relu", final_norm=final_norm)
    x = torch.randn(2, 5, 8)
    pad = torch.tensor([[False] * 5, [False, False, False, True, True]])
    with torch.no_grad():
        nested = enc(x, src_key_padding_mask=pad)  # CPU: padded positions are 0 before the final norm
        with pytest.raises(NotImplementedError, match="enable_nested_tensor=False"):
            copy.deepcopy(enc).to("jax")(x.to("jax"), src_key_padding_mask=pad.to("jax"))
        _, flat = _encoder_pair(False, "relu", nested=False, final_norm=final_norm)
        want = flat(x, src_key_padding_mask=pad)
        got = copy.deepcopy(flat).to("jax")(x.to("jax"), src_key_padding_mask=pad.to("jax")).cpu()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    keep = ~pad[..., None]
    torch.testing.assert_close(got * keep, nested * keep, rtol=1e-5, atol=1e-5)  # the unpadded positions agree
