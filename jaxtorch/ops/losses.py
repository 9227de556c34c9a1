"""Loss-function lowerings: nll / cross entropy, regression losses, binary cross entropy, KL,
margin losses, CTC, and torch's chunked linear + cross entropy.

Each forward lowering computes the per-element loss and reduces it as torch's `reduction` enum
says (0 none, 1 mean, 2 sum). The `*_backward` ops, which torch autograd calls on the `jax`
device, are the VJP of the forward lowering unless torch's backward is not the true gradient
(`binary_cross_entropy`'s clamped denominator, CTC's softmax-folded gradient), in which case
they follow torch's formula.

Example:
    ```python
    import jax.numpy as jnp, torch, jaxtorch
    x, y = jnp.array([[0.1, 0.5, -1.0]]), jnp.array([1])
    loss = jaxtorch.call_torch(torch.nn.functional.multi_margin_loss, x, y)   # 0.2
    ```
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import torch
from jax import lax

from ..bridge.core._checks import ON as _CHECKS
from ..bridge.core._checks import check
from ..bridge.core._registry import keep_whole, register
from ._derivatives import torch_derivative
from ._semantics import result_type
from .nn import _opmath, _vjp

aten = torch.ops.aten


def _reduce(loss: jax.Array, reduction: int) -> jax.Array:
    """torch's `reduction` enum: 0 none, 1 mean, 2 sum."""
    if reduction == 1:
        return jnp.mean(loss)
    if reduction == 2:
        return jnp.sum(loss)
    return loss


def _relu_strict(z: jax.Array) -> jax.Array:
    """max(z, 0) whose gradient at z == 0 is 0, as torch's `z > 0` tests in margin losses."""
    return jnp.where(z > 0, z, 0)


# ---- nll, regression losses, binary cross entropy, kl ----------------------------------------
def _class_hit(shape: tuple[int, ...], target: jax.Array, cdim: int) -> jax.Array:
    """Bool one-hot of `target` along `cdim` (an iota comparison, which XLA fuses)."""
    return lax.broadcasted_iota(jnp.int32, shape, cdim) == jnp.expand_dims(target.astype(jnp.int32), cdim)


def _weighted_mean(loss: jax.Array, w: jax.Array, reduction: int) -> jax.Array:
    """torch's nll reduction of per-element `loss` already multiplied by its class weight `w`:
    the mean divides by the kept weights' sum; with every target ignored it is NaN, as in torch,
    while the gradient stays 0 (torch's backward writes nothing for ignored targets)."""
    if reduction != 1:
        return jnp.sum(loss) if reduction == 2 else loss
    total = jnp.sum(w)
    return jnp.sum(loss) / jnp.where(total == 0, 1, total) + jnp.where(total == 0, jnp.nan, 0).astype(loss.dtype)


def _check_targets(target, classes: int, ignore_index: int) -> None:
    """Checked mode: torch's `IndexError: Target 5 is out of bounds.` for a class index outside
    `[0, classes)` that is not `ignore_index`."""
    if _CHECKS[0]:
        ok = (target == ignore_index) | ((target >= 0) & (target < classes))
        check(ok, target, IndexError, "Target {value} is out of bounds.")


def _nll(self, target, weight, reduction, ignore_index):
    """(loss, total_weight) for (N, C, ...) or (C,) log-probabilities."""
    cdim = 0 if self.ndim == 1 else 1
    _check_targets(target, self.shape[cdim], ignore_index)
    valid = target != ignore_index
    safe = jnp.where(valid, target, 0).astype(jnp.int32)
    # A one-hot select-and-sum rather than a gather: XLA fuses it, and its gradient is a fused
    # select instead of a scatter into a zero (N, C) array (slow on CPUs for large C).
    picked = jnp.sum(jnp.where(_class_hit(self.shape, safe, cdim), self, 0), axis=cdim)
    w = jnp.where(valid, 1, 0).astype(self.dtype) if weight is None else jnp.where(valid, weight[safe], 0)
    loss = -picked * w
    if reduction == 0:
        return loss, jnp.zeros((), self.dtype)
    total = jnp.sum(w)
    return _weighted_mean(loss, w, reduction), total


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _lse_and_pick(x: jax.Array, target: jax.Array, cdim: int) -> tuple[jax.Array, jax.Array]:
    """(logsumexp of `x` along `cdim`, `x` at `target` along `cdim`): the two halves of
    `-log_softmax(x)[target]`, so cross entropy never materializes the log-probabilities.

    Its VJP is one fused `exp(x - lse) g_lse + onehot g_pick`, which keeps only `x` (alive
    anyway) and the row-wise `lse`: JAX's own derivative of `log_softmax` followed by a pick
    keeps two more full-size (rows, classes) buffers, which for a language model's logits
    cost memory and a pass each.
    """
    return _lse_and_pick_fwd(x, target, cdim)[0]


def _lse_and_pick_fwd(x, target, cdim):
    m = lax.stop_gradient(jnp.max(x, axis=cdim, keepdims=True))
    lse = jnp.log(jnp.sum(jnp.exp(x - m), axis=cdim, keepdims=True)) + m
    # a gather of one value per row (XLA CPU does not fuse a one-hot select into the reduce, so
    # that form writes a full-size buffer); the VJP below is written out, so no scatter follows
    picked = jnp.squeeze(jnp.take_along_axis(x, jnp.expand_dims(target.astype(jnp.int32), cdim), axis=cdim), cdim)
    return (jnp.squeeze(lse, cdim), picked), (x, lse, target, picked)


def _lse_and_pick_bwd(cdim, residuals, cotangents):
    x, lse, target, picked = residuals
    g_lse, g_pick = (jnp.expand_dims(g, cdim) for g in cotangents)
    # min(|picked|, 0) is 0 (NaN only where the row's gradient is NaN anyway), but reading it
    # makes the gradient wait for the pick, so the gradient is the last reader of `x` and XLA
    # writes it over `x`'s buffer; else the pick may run after it and keep `x` alive.
    g_lse = g_lse + jnp.expand_dims(jnp.minimum(jnp.abs(picked), 0), cdim)
    dx = jnp.exp(x - lse) * g_lse + jnp.where(_class_hit(x.shape, target, cdim), g_pick, 0)
    return dx, None


_lse_and_pick.defvjp(_lse_and_pick_fwd, _lse_and_pick_bwd)


@register(aten.cross_entropy_loss.default)
def cross_entropy_loss(self, target, weight=None, reduction=1, ignore_index=-100, label_smoothing=0.0):
    """`F.cross_entropy`, kept whole: class-index targets without label smoothing (the language
    model case) compute `logsumexp - picked` directly (see `_lse_and_pick`); probability
    targets and label smoothing follow torch's `log_softmax` formulas."""
    x = _opmath(self)
    cdim = 0 if x.ndim == 1 else 1
    if jnp.issubdtype(target.dtype, jnp.floating):  # class probabilities, same shape as the input
        return _xent_probabilities(x, target.astype(x.dtype), weight, reduction, label_smoothing, cdim).astype(
            self.dtype
        )
    _check_targets(target, x.shape[cdim], ignore_index)
    valid = target != ignore_index
    safe = jnp.where(valid, target, 0).astype(jnp.int32)
    w = jnp.where(valid, 1, 0).astype(x.dtype) if weight is None else jnp.where(valid, weight.astype(x.dtype)[safe], 0)
    if label_smoothing == 0.0:
        lse, picked = _lse_and_pick(x, safe, cdim)
        return _weighted_mean((lse - picked) * w, w, reduction).astype(self.dtype)
    logp = jax.nn.log_softmax(x, axis=cdim)
    nll = _nll(logp, target, weight, reduction, ignore_index)[0]
    cw = 1 if weight is None else jnp.reshape(weight.astype(x.dtype), (-1,) + (1,) * (x.ndim - cdim - 1))
    smooth = _weighted_mean(jnp.where(valid, -jnp.sum(logp * cw, axis=cdim), 0), w, reduction)
    return ((1 - label_smoothing) * nll + smooth * (label_smoothing / x.shape[cdim])).astype(self.dtype)


def _xent_probabilities(x, target, weight, reduction, label_smoothing, cdim):
    """Cross entropy against class probabilities (torch's `cross_entropy_loss_prob_target`)."""
    if label_smoothing > 0:
        target = target * (1 - label_smoothing) + label_smoothing / x.shape[cdim]
    logp = jax.nn.log_softmax(x, axis=cdim)
    if weight is not None:
        logp = logp * jnp.reshape(weight.astype(x.dtype), (-1,) + (1,) * (x.ndim - cdim - 1))
    loss = -jnp.sum(logp * target, axis=cdim)
    if reduction == 1:
        return jnp.sum(loss) / (x.size // x.shape[cdim])
    return jnp.sum(loss) if reduction == 2 else loss


keep_whole(aten.cross_entropy_loss.default)  # else torch decomposes it before jaxtorch sees it


@register(aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
def nll_loss_forward(self, target, weight, reduction, ignore_index):
    return _nll(self, target, weight, reduction, ignore_index)


@register(aten.nll_loss_backward.default, aten.nll_loss2d_backward.default)
def nll_loss_backward(grad_output, self, target, weight, reduction, ignore_index, total_weight):
    if reduction == 1:  # mean divides by the given total_weight
        f = lambda x: _nll(x, target, weight, 2, ignore_index)[0] / total_weight
    else:
        f = lambda x: _nll(x, target, weight, reduction, ignore_index)[0]
    return _vjp(f, (self,), grad_output)[0]


def _loss_op(name: str, fn: Callable, *extra_defaults):
    """Register `aten.<name>` (forward, reduction) and `aten.<name>_backward` as its VJP."""

    def forward(self, target, reduction=1, *extra):
        extra = extra or extra_defaults
        dtype = result_type(self, target)
        return _reduce(fn(self.astype(dtype), target.astype(dtype), *extra), reduction)

    def backward(grad_output, self, target, reduction, *extra):
        return _vjp(lambda x: forward(x, target, reduction, *extra), (self,), grad_output)[0]

    forward.__name__, backward.__name__ = name, name + "_backward"
    register(getattr(aten, name).default)(forward)
    bw = getattr(aten, name + "_backward", None)
    if bw is not None:
        register(bw.default)(backward)
    return forward


mse_loss = _loss_op("mse_loss", lambda x, y: jnp.square(x - y))
l1_loss = _loss_op("l1_loss", lambda x, y: jnp.abs(x - y))
smooth_l1_loss = _loss_op(
    "smooth_l1_loss",
    lambda x, y, beta: (
        jnp.abs(x - y)
        if beta == 0
        else jnp.where(jnp.abs(x - y) < beta, 0.5 * jnp.square(x - y) / beta, jnp.abs(x - y) - 0.5 * beta)
    ),
    1.0,
)
huber_loss = _loss_op(
    "huber_loss",
    lambda x, y, delta: jnp.where(
        jnp.abs(x - y) < delta, 0.5 * jnp.square(x - y), delta * (jnp.abs(x - y) - 0.5 * delta)
    ),
    1.0,
)
soft_margin_loss = _loss_op("soft_margin_loss", lambda x, y: jnp.log1p(jnp.exp(-y * x)))


def _bce(x, y, weight):
    loss = -(y * jnp.maximum(jnp.log(x), -100) + (1 - y) * jnp.maximum(jnp.log1p(-x), -100))
    return loss if weight is None else loss * weight


def _bce_derivative(t, out, self, target, weight=None, reduction=1):
    """torch's `binary_cross_entropy_backward` closed form (finite at p = 0 and 1, where the VJP of
    the clamped logs is NaN), applied to the input's tangent."""
    return _reduce(binary_cross_entropy_backward(jnp.ones((), self.dtype), self, target, weight, 0) * t, reduction)


@register(aten.binary_cross_entropy.default)
@torch_derivative(_bce_derivative)
def binary_cross_entropy(self, target, weight=None, reduction=1):
    return _reduce(_bce(self, target, weight), reduction).astype(self.dtype)


@register(aten.binary_cross_entropy_backward.default)
def binary_cross_entropy_backward(grad_output, self, target, weight=None, reduction=1):
    # torch's closed form (clamped denominator), not the VJP of the clamped logs.
    g = (self - target) / jnp.maximum((1 - self) * self, 1e-12)
    if weight is not None:
        g = g * weight
    if reduction == 1:
        g = g / self.size
    return (g * grad_output).astype(self.dtype)


@register(aten.binary_cross_entropy_with_logits.default)
def binary_cross_entropy_with_logits(self, target, weight=None, pos_weight=None, reduction=1):
    log_sig, log_sig_neg = jax.nn.log_sigmoid(self), jax.nn.log_sigmoid(-self)
    if pos_weight is not None:
        loss = -(pos_weight * target * log_sig + (1 - target) * log_sig_neg)
    else:
        loss = -(target * log_sig + (1 - target) * log_sig_neg)
    if weight is not None:
        loss = loss * weight
    return _reduce(loss, reduction)


@register(aten.kl_div.default)
def kl_div(self, target, reduction=1, log_target=False):
    if log_target:
        loss = jnp.exp(target) * (target - self)
    else:
        loss = jnp.where(target > 0, target * (jnp.log(jnp.where(target > 0, target, 1)) - self), 0)
        loss = loss.astype(result_type(self, target))
    return _reduce(loss, reduction)


# ---- margin losses ----------------------------------------------------------------------------
def _multi_margin(self, target, p, margin, weight):
    """Per-sample loss (N,) of `multi_margin_loss` for a (N, C) input, torch's CPU formula."""
    x = _opmath(self)
    t = target.astype(jnp.int32)
    picked = jnp.take_along_axis(x, t[:, None], axis=1)
    z = _relu_strict(margin - picked + x)
    h = z if p == 1 else z * z
    if weight is not None:
        h = h * weight.astype(x.dtype)[t][:, None]
    h = jnp.where(jnp.arange(x.shape[1]) == t[:, None], 0, h)
    return (jnp.sum(h, axis=1) / x.shape[1]).astype(self.dtype)


@register(aten.multi_margin_loss.default)
def multi_margin_loss(self, target, p=1, margin=1, weight=None, reduction=1):
    """Multi-class hinge loss: sum_{j != y} max(0, margin - x[y] + x[j])^p / C, weighted by w[y]."""
    x = self.reshape(1, -1) if self.ndim < 2 else self
    loss = _multi_margin(x, target.reshape(-1), p, margin, weight)
    if reduction == 0 and self.ndim < 2:
        return loss.reshape(target.shape)
    return _reduce(loss, reduction)


@register(aten.multi_margin_loss_backward.default)
def multi_margin_loss_backward(grad_output, self, target, p, margin, weight=None, reduction=1):
    return _vjp(lambda x: multi_margin_loss(x, target, p, margin, weight, reduction), (self,), grad_output)[0]


def _multilabel_targets(target):
    """(labels, valid, is_target) for an (N, C) target: labels before the first -1 count."""
    t = target.astype(jnp.int32)
    valid = jnp.cumprod(t >= 0, axis=1).astype(bool)
    labels = jnp.where(valid, t, 0)
    hits = jnp.zeros(t.shape, jnp.int32).at[jnp.arange(t.shape[0])[:, None], labels].add(valid.astype(jnp.int32))
    return labels, valid, hits > 0


@register(aten.multilabel_margin_loss_forward.default)
def multilabel_margin_loss_forward(self, target, reduction):
    """(loss, is_target): sum over target labels j and non-target classes i of
    max(0, 1 - (x[j] - x[i])) / C, per sample; labels are read up to the first -1."""
    x = _opmath(self.reshape(1, -1) if self.ndim < 2 else self)
    labels, valid, is_target = _multilabel_targets(target.reshape(x.shape))
    xt = jnp.take_along_axis(x, labels, axis=1)  # (N, C) label scores
    z = _relu_strict(1 - xt[:, :, None] + x[:, None, :])  # (N, label j, class i)
    z = jnp.where(valid[:, :, None] & ~is_target[:, None, :], z, 0)
    loss = (jnp.sum(z, axis=(1, 2)) / x.shape[1]).astype(self.dtype)
    is_target = is_target.astype(self.dtype).reshape(self.shape)
    if self.ndim < 2:
        return (loss.reshape(()) if reduction == 0 else _reduce(loss, reduction)), is_target
    return _reduce(loss, reduction), is_target


@register(aten.multilabel_margin_loss_backward.default)
def multilabel_margin_loss_backward(grad_output, self, target, reduction, is_target):
    f = lambda x: multilabel_margin_loss_forward(x, target, reduction)[0]
    return _vjp(f, (self,), grad_output)[0]


# ---- linear + cross entropy (torch's chunked custom ops) --------------------------------------
def _linear_xent_rows(input, linear_weight, target, linear_bias, weight, ignore_index):
    """(per-row loss, per-row class weight) of cross_entropy(input @ W.T + b, target), rows masked
    where target == ignore_index; computed in float32 for half inputs."""
    x, w = _opmath(input), linear_weight.astype(_opmath(input).dtype)
    logits = x @ w.T
    if linear_bias is not None:
        logits = logits + linear_bias.astype(logits.dtype)
    t = target.astype(jnp.int32)
    masked = t == ignore_index
    t = jnp.where(masked, 0, t)
    lse, picked = _lse_and_pick(logits, t, 1)
    nll = lse - picked
    row_w = jnp.ones(t.shape, logits.dtype) if weight is None else weight.astype(logits.dtype)[t]
    row_w = jnp.where(masked, 0, row_w)
    return nll * row_w, row_w


def _linear_xent(input, linear_weight, target, linear_bias, weight, reduction, ignore_index):
    loss, row_w = _linear_xent_rows(input, linear_weight, target, linear_bias, weight, ignore_index)
    total = jnp.sum(loss)
    if reduction == "mean":
        d = jnp.sum(row_w)
        total = total / jnp.where(d == 0, jnp.nan, d)
    return total.astype(input.dtype)


def _linear_xent_chunked_op():
    try:
        import torch.nn.modules.linear_cross_entropy  # (defines the torch_nn ops)
    except ImportError:  # an older torch without F.linear_cross_entropy
        return None, None
    ns = torch.ops.torch_nn
    return ns._linear_cross_entropy_batch_chunked.default, ns._linear_cross_entropy_batch_chunked_no_reduction.default


_LCE, _LCE_NONE = _linear_xent_chunked_op()


def linear_cross_entropy_batch_chunked(
    input,
    linear_weight,
    target,
    linear_bias,
    weight,
    reduction,
    ignore_index,
    label_smoothing,
    batch_chunk_size,
    acc_policy,
    acc_dtype,
    allow_retain_graph,
    compute_input_grad,
    compute_linear_weight_grad,
    compute_linear_bias_grad,
):
    """`F.linear_cross_entropy` (mean/sum): (loss, grad_input, grad_linear_weight, grad_linear_bias).

    torch's op precomputes the gradients in its forward; here they are the VJP of the unchunked
    loss (XLA drops them when unused). A gradient not asked for is an empty tensor, as in torch.
    """
    if label_smoothing > 0.0:
        raise NotImplementedError("linear_cross_entropy does not support label smoothing")
    f = lambda x, w, b: _linear_xent(x, w, target, b, weight, reduction, ignore_index)
    if not (compute_input_grad or compute_linear_weight_grad or compute_linear_bias_grad):
        loss, (gx, gw, gb) = f(input, linear_weight, linear_bias), (None, None, None)
    else:
        loss, pullback = jax.vjp(f, input, linear_weight, linear_bias)
        gx, gw, gb = pullback(jnp.ones((), loss.dtype))
    gx = gx.astype(input.dtype) if compute_input_grad and gx is not None else jnp.zeros((0, 0), input.dtype)
    gw = gw.astype(input.dtype) if compute_linear_weight_grad and gw is not None else jnp.zeros((0, 0), input.dtype)
    gb = gb.astype(input.dtype) if compute_linear_bias_grad and gb is not None else jnp.zeros((0,), input.dtype)
    return loss, gx, gw, gb


def linear_cross_entropy_batch_chunked_no_reduction(
    input, linear_weight, target, linear_bias, weight, ignore_index, batch_chunk_size, acc_policy, acc_dtype
):
    """`F.linear_cross_entropy(..., reduction='none')`: the per-row loss (N,), 0 on ignored rows."""
    loss, _ = _linear_xent_rows(input, linear_weight, target, linear_bias, weight, ignore_index)
    return loss.astype(input.dtype)


if _LCE is not None:
    register(_LCE)(linear_cross_entropy_batch_chunked)
    register(_LCE_NONE)(linear_cross_entropy_batch_chunked_no_reduction)


# ---- ctc --------------------------------------------------------------------------------------
def _logsumexp(*xs: jax.Array) -> jax.Array:
    """log(sum(exp(x))) of same-shaped arrays, -inf where all are -inf, with finite gradients there."""
    m = functools.reduce(jnp.maximum, xs)
    m = lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0))
    s = sum(jnp.exp(x - m) for x in xs)
    return jnp.where(s > 0, jnp.log(jnp.where(s > 0, s, 1)), -jnp.inf) + m


def _ctc_padded_targets(targets, target_lengths, s_max):
    """(N, s_max) labels from (N, S) padded or 1-D concatenated targets."""
    if targets.ndim == 2:
        t = targets[:, :s_max]
        return jnp.pad(t, ((0, 0), (0, s_max - t.shape[1]))) if t.shape[1] < s_max else t
    starts = jnp.cumsum(target_lengths) - target_lengths
    pos = jnp.clip(starts[:, None] + jnp.arange(s_max), 0, max(targets.shape[0] - 1, 0))
    return targets[pos] if targets.shape[0] else jnp.zeros(pos.shape, targets.dtype)


def _ctc_forward(log_probs, labels, input_lengths, target_lengths, blank):
    """(nll (N,), log_alpha (N, T, 2S+1)): the CTC forward recursion in log space over time.

    `labels` is (N, S); positions s > 2 * target_length and times t >= input_length of
    log_alpha are -inf (torch leaves them uninitialized).
    """
    T, N, _ = log_probs.shape
    S = 2 * labels.shape[1] + 1
    s_idx = jnp.arange(S)
    ext = jnp.full((N, S), blank, jnp.int32).at[:, 1::2].set(labels.astype(jnp.int32))
    # torch's skip transition s-2 -> s: odd s > 1 whose label differs from the one at s-2
    skip = (s_idx % 2 == 1) & (s_idx > 1) & (ext != jnp.roll(ext, 2, axis=1))
    lp = jnp.take_along_axis(log_probs, jnp.broadcast_to(ext[None], (T, N, S)), axis=2)  # (T, N, S)
    neg = jnp.full((N, 1), -jnp.inf, lp.dtype)
    alpha0 = jnp.where((s_idx == 0) | ((s_idx == 1) & (target_lengths[:, None] > 0)), lp[0], -jnp.inf)

    def step(prev, lp_t):
        prev1 = jnp.concatenate([neg, prev[:, :-1]], axis=1)
        prev2 = jnp.where(skip, jnp.concatenate([neg, neg, prev[:, :-2]], axis=1), -jnp.inf)
        cur = _logsumexp(prev, prev1, prev2) + lp_t
        return cur, cur

    _, rest = lax.scan(step, alpha0, lp[1:])
    alpha = jnp.concatenate([alpha0[None], rest], axis=0)  # (T, N, S)
    last_t = jnp.clip(input_lengths - 1, 0, T - 1).astype(jnp.int32)
    final = alpha[last_t, jnp.arange(N)]  # (N, S)
    end = (2 * target_lengths).astype(jnp.int32)
    l1 = jnp.take_along_axis(final, end[:, None], axis=1)[:, 0]
    l2 = jnp.where(
        target_lengths > 0, jnp.take_along_axis(final, jnp.maximum(end - 1, 0)[:, None], axis=1)[:, 0], -jnp.inf
    )
    nll = -_logsumexp(l1, l2)
    valid = (jnp.arange(T)[:, None, None] < input_lengths[None, :, None]) & (s_idx <= end[:, None])[None]
    return nll, jnp.where(valid, alpha, -jnp.inf).transpose(1, 0, 2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _ctc(log_probs, labels, input_lengths, target_lengths, blank, zero_infinity):
    return _ctc_forward(log_probs, labels, input_lengths, target_lengths, blank)


def _ctc_fwd(log_probs, labels, input_lengths, target_lengths, blank, zero_infinity):
    out = _ctc_forward(log_probs, labels, input_lengths, target_lengths, blank)
    return out, (log_probs, labels, input_lengths, target_lengths, out[0])


def _ctc_bwd(blank, zero_infinity, res, cotangents):
    # torch's gradient is exp(lp) - exp(log(alpha*beta) + nll - lp) per time step t < input_length:
    # the true gradient (the second term) plus exp(lp), i.e. it assumes lp = log_softmax(logits).
    log_probs, labels, input_lengths, target_lengths, nll = res
    g = cotangents[0]
    f = lambda lp: _ctc_forward(lp, labels, input_lengths, target_lengths, blank)[0]
    (true_grad,) = _vjp(f, (log_probs,), g)
    live = jnp.arange(log_probs.shape[0])[:, None, None] < input_lengths[None, :, None]
    grad = true_grad + jnp.where(live, jnp.exp(log_probs) * g[None, :, None], 0)
    inf = jnp.isinf(nll)[None, :, None]
    grad = jnp.where(inf, 0 if zero_infinity else jnp.nan, grad).astype(log_probs.dtype)
    return grad, None, None, None


_ctc.defvjp(_ctc_fwd, _ctc_bwd)


def _ctc_lengths(lengths, n):
    return jnp.broadcast_to(jnp.asarray(lengths, dtype=jnp.int32), (n,))


@register(aten._ctc_loss.default, aten._ctc_loss.Tensor)
def _ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, zero_infinity=False):
    """(neg_log_likelihood (N,), log_alpha (N, T, 2S+1)) of the CTC loss (Graves et al. 2006).

    With `int[]` lengths S is max(target_lengths), as in torch; with tensor lengths (which may be
    traced) S is the static bound targets.shape[1] (padded) or targets.shape[0] (concatenated).
    The gradient is torch's (see `_ctc_bwd`).
    """
    unbatched = log_probs.ndim == 2
    if unbatched:
        log_probs, targets = log_probs[:, None], targets.reshape(1, -1) if targets.ndim == 1 else targets
    n = log_probs.shape[1]
    if isinstance(target_lengths, (list, tuple)):
        s_max = max(target_lengths, default=0)
    else:
        s_max = targets.shape[1] if targets.ndim == 2 else targets.shape[0]
    il, tl = _ctc_lengths(input_lengths, n), _ctc_lengths(target_lengths, n)
    labels = _ctc_padded_targets(targets, tl, s_max)
    nll, log_alpha = _ctc(log_probs, labels, il, tl, blank, zero_infinity)
    if unbatched:
        return nll[0], log_alpha[0]
    return nll, log_alpha


@register(aten._ctc_loss_backward.default, aten._ctc_loss_backward.Tensor)
def _ctc_loss_backward(
    grad, log_probs, targets, input_lengths, target_lengths, neg_log_likelihood, log_alpha, blank, zero_infinity=False
):
    f = lambda lp: _ctc_loss(lp, targets, input_lengths, target_lengths, blank, zero_infinity)[0]
    return _vjp(f, (log_probs,), grad)[0]
