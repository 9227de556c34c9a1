"""Scaled dot-product attention, lowered as one fused JAX expression.

`aten::scaled_dot_product_attention` is CompositeImplicitAutograd: left alone, torch
decomposes it into a dozen small ops (the "math" path) before jaxtorch sees it. Registering
a `PrivateUse1` (the `jax` device) kernel makes the dispatcher skip that decomposition, so the
op reaches `__torch_dispatch__` whole and lowers to two `dot_general`s around a masked
softmax, which XLA fuses. When torch autograd must record the op (a tensor on the `jax`
device that requires grad), an `AutogradPrivateUse1` kernel routes it to torch's
differentiable math path instead, so `loss.backward()` keeps working.

The lowering goes through one `jax.jit` per option set, so the layers of a model trace it
once (`_sdpa_once`). Causal attention is one product each way with a mask: splitting it into
query blocks that skip the products above the diagonal saved ~3% of a CPU train step but gave
every block its own shapes, so XLA compiled 4x the attention kernels and created 2x the
YNNPACK runtimes on the first call (compile time 2.2x, benchmarks/README.md "Time to first
result").

Example:
    ```python
    import jax.numpy as jnp, torch, jaxtorch
    q = jnp.ones((2, 4, 8, 16))
    out = jaxtorch.call_torch(torch.nn.functional.scaled_dot_product_attention, q, q, q, is_causal=True)
    ```
"""

from __future__ import annotations

import math
import operator

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from ..bridge.core._random import next_key
from ..bridge.core._registry import keep_whole, register
from ._semantics import binary, broadcast_to

aten = torch.ops.aten


def _masked_softmax(scores: jax.Array) -> jax.Array:
    """Softmax over the last axis where rows that are entirely -inf give 0, not NaN (torch's
    `_safe_softmax`), at the cost of a plain softmax. (`lax` ops: this runs in every traced
    attention, and `jnp`'s jitted functions cost more to trace.)"""
    last = scores.ndim - 1
    m = lax.expand_dims(lax.stop_gradient(lax.reduce_max(scores, (last,))), (last,))
    m = lax.select(lax.is_finite(m), m, lax.full_like(m, 0))
    e = lax.exp(lax.sub(scores, broadcast_to(m, scores.shape)))
    denom = lax.expand_dims(lax.reduce_sum(e, (last,)), (last,))
    denom = lax.select(denom == 0, lax.full_like(denom, 1), denom)
    return lax.div(e, broadcast_to(denom, e.shape))


def _softmax(scores: jax.Array) -> jax.Array:
    """Plain softmax over the last axis, for scores whose every row keeps at least one entry
    (causal masks do: key 0 is never masked), so no guard against all -inf rows is needed."""
    last = scores.ndim - 1
    m = lax.expand_dims(lax.stop_gradient(lax.reduce_max(scores, (last,))), (last,))
    e = lax.exp(lax.sub(scores, broadcast_to(m, scores.shape)))
    return lax.div(e, broadcast_to(lax.expand_dims(lax.reduce_sum(e, (last,)), (last,)), e.shape))


def _mask_out(scores: jax.Array, keep) -> jax.Array:
    """`scores` with -inf where `keep` (broadcastable bool) is False."""
    keep = broadcast_to(jnp.asarray(keep), scores.shape)
    return lax.select(keep, scores, lax.full_like(scores, -jnp.inf))


def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, rng=None):
    """softmax(q k^T * scale + mask) v, with torch's semantics.

    **Arguments:** `q` (..., Hq, L, E), `k` (..., Hk, S, E), `v` (..., Hk, S, Ev); `attn_mask`
    broadcastable to (..., Hq, L, S), bool (True = attend) or additive float; `is_causal` keeps
    the lower triangle (top-left aligned); `enable_gqa` lets Hq be a multiple of Hk without
    materializing repeated keys/values; `rng` is the key for `dropout_p > 0`.

    **Returns:** (..., Hq, L, Ev) in the dtype of `q`; half inputs accumulate in float32.
    """
    L, S, E = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(E) if scale is None else scale
    acc = jnp.float32 if q.dtype in (jnp.bfloat16, jnp.float16) else q.dtype
    groups = q.shape[-3] // k.shape[-3] if (enable_gqa and q.ndim >= 3 and q.shape[-3] != k.shape[-3]) else 1
    if groups > 1:  # (..., Hk, G, L, E) against (..., Hk, 1, S, E): no repeat of k and v
        q = q.reshape(q.shape[:-3] + (k.shape[-3], groups, L, E))
        k, v = k[..., None, :, :], v[..., None, :, :]
    qs = binary(lax.mul, operator.mul, q, scale)
    nb = q.ndim - 2
    plain = q.shape[:-2] == k.shape[:-2] == v.shape[:-2]  # the common case: one dot_general each way
    batch = (tuple(range(nb)),) * 2
    if plain:
        scores = lax.dot_general(qs, k, (((nb + 1,), (nb + 1,)), batch), preferred_element_type=acc)
    else:
        scores = jnp.einsum("...le,...se->...ls", qs, k, preferred_element_type=acc)
    if groups > 1 and attn_mask is not None and attn_mask.ndim >= 3:
        attn_mask = (
            jnp.broadcast_to(attn_mask, attn_mask.shape[:-3] + (q.shape[-4] * groups,) + attn_mask.shape[-2:])
            if attn_mask.shape[-3] == 1
            else attn_mask
        )
        attn_mask = attn_mask.reshape(attn_mask.shape[:-3] + (q.shape[-4], groups) + attn_mask.shape[-2:])
    if is_causal:
        scores = _mask_out(scores, np.tril(np.ones((L, S), np.bool_)))
    if attn_mask is not None:
        if attn_mask.dtype == jnp.bool_:
            scores = _mask_out(scores, attn_mask)
        else:
            scores = binary(lax.add, operator.add, scores, attn_mask.astype(acc))
    # a causal mask alone keeps key 0 in every row: no all-masked rows to guard against
    p = _softmax(scores) if is_causal and attn_mask is None and S > 0 else _masked_softmax(scores)
    if dropout_p > 0:
        keep = jax.random.bernoulli(rng, 1.0 - dropout_p, p.shape)
        p = jnp.where(keep, p / (1.0 - dropout_p), 0)
    if plain:
        out = lax.dot_general(p.astype(v.dtype), v, (((nb + 1,), (nb,)), batch), preferred_element_type=acc)
    else:
        out = jnp.einsum("...ls,...sv->...lv", p.astype(v.dtype), v, preferred_element_type=acc)
    if groups > 1:
        out = out.reshape(out.shape[:-4] + (out.shape[-4] * groups,) + out.shape[-2:])
    return out.astype(q.dtype)


# Each transformer layer calls attention with the same shapes: as one jitted function, JAX traces
# it once per model and reuses the jaxpr for the other layers (XLA inlines it when compiling).
_sdpa_jit = jax.jit(sdpa, static_argnames=("dropout_p", "is_causal", "scale", "enable_gqa"))


def _sdpa_once(q, k, v, attn_mask=None, *, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, rng=None):
    """`sdpa` through `_sdpa_jit` when its options are Python values (the eager path passes a
    float `scale` or `dropout_p` traced, to spare recompiles; those go to `sdpa` directly)."""
    if isinstance(dropout_p, (int, float)) and (scale is None or isinstance(scale, (int, float))):
        return _sdpa_jit(
            q, k, v, attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, rng=rng
        )
    return sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, rng)


@register(aten.scaled_dot_product_attention.default)
def scaled_dot_product_attention(
    query, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False
):
    rng = next_key(aten.scaled_dot_product_attention.default) if dropout_p > 0 else None
    return _sdpa_once(
        query, k, v, attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, rng=rng
    )


@register(aten._scaled_dot_product_flash_attention_for_cpu.default)
def _scaled_dot_product_flash_attention_for_cpu(
    query, k, v, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None
):
    """(output, logsumexp): the CPU flash kernel's outputs."""
    rng = next_key(aten._scaled_dot_product_flash_attention_for_cpu.default) if dropout_p > 0 else None
    out = _sdpa_once(query, k, v, attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, rng=rng)
    L, S, E = query.shape[-2], k.shape[-2], query.shape[-1]
    sc = 1.0 / math.sqrt(E) if scale is None else scale
    scores = jnp.einsum("...le,...se->...ls", query.astype(jnp.float32), k.astype(jnp.float32)) * sc
    if is_causal:
        scores = jnp.where(jnp.tril(jnp.ones((L, S), jnp.bool_)), scores, -jnp.inf)
    if attn_mask is not None:
        scores = jnp.where(attn_mask, scores, -jnp.inf) if attn_mask.dtype == jnp.bool_ else scores + attn_mask
    return out, jax.nn.logsumexp(scores, axis=-1)


keep_whole(aten.scaled_dot_product_attention.default)  # see the module docstring


# ---- nn.TransformerEncoderLayer's fast path (eval, no grad) ---------------------------------------
def _layer_norm(x, weight, bias, eps):
    mean = jnp.mean(x, -1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), -1, keepdims=True)
    return (x - mean) * lax.rsqrt(var + eps) * weight + bias


def _fast_path_mask(mask, mask_type, batch: int, heads: int, length: int):
    """The `keep` mask (B, H, L, L) of `merge_masks`' output: True masks out (torch's bool masks;
    a float mask is added to the scores, as `_masked_softmax` does)."""
    if mask_type == 1:  # src_key_padding_mask (B, L)
        mask = mask.reshape(batch, 1, 1, length)
    elif mask_type == 0 or mask.ndim == 2:  # src_mask (L, L)
        mask = mask.reshape(1, 1, length, length)
    return mask


@register(aten._transformer_encoder_layer_fwd.default)
def transformer_encoder_layer_fwd(
    src, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias, use_gelu, norm_first, eps,
    norm_weight_1, norm_bias_1, norm_weight_2, norm_bias_2, ffn_weight_1, ffn_bias_1, ffn_weight_2, ffn_bias_2,
    mask=None, mask_type=None,
):  # fmt: skip
    """`nn.TransformerEncoderLayer`'s fused eval-mode forward (batch_first `src` (B, L, E)), as torch's
    CPU kernel computes it: self-attention whose fully masked rows give 0 (`_masked_softmax`),
    residuals, layer norms before (`norm_first`) or after, and a relu/gelu feed-forward."""
    x0 = src.astype(jnp.promote_types(src.dtype, jnp.float32))
    batch, length, _ = x0.shape
    head = embed_dim // num_heads

    def attention(x):
        qkv = x @ qkv_weight.T.astype(x.dtype) + qkv_bias.astype(x.dtype)
        q, k, v = (t.reshape(batch, length, num_heads, head).transpose(0, 2, 1, 3) for t in jnp.split(qkv, 3, -1))
        scores = (q / math.sqrt(head)) @ k.transpose(0, 1, 3, 2)
        if mask is not None:
            m = _fast_path_mask(mask, mask_type, batch, num_heads, length)
            scores = _mask_out(scores, ~m) if m.dtype == np.bool_ else scores + m.astype(scores.dtype)
        out = (_masked_softmax(scores) @ v).transpose(0, 2, 1, 3).reshape(batch, length, embed_dim)
        return out @ proj_weight.T.astype(x.dtype) + proj_bias.astype(x.dtype)

    def feed_forward(x):
        h = x @ ffn_weight_1.T.astype(x.dtype) + ffn_bias_1.astype(x.dtype)
        h = jax.nn.gelu(h, approximate=False) if use_gelu else jax.nn.relu(h)
        return h @ ffn_weight_2.T.astype(x.dtype) + ffn_bias_2.astype(x.dtype)

    def norm1(x):
        return _layer_norm(x, norm_weight_1, norm_bias_1, eps)

    def norm2(x):
        return _layer_norm(x, norm_weight_2, norm_bias_2, eps)

    if norm_first:
        x = x0 + attention(norm1(x0))
        x = x + feed_forward(norm2(x))
    else:
        x = norm1(x0 + attention(x0))
        x = norm2(x + feed_forward(x))
    return x.astype(src.dtype)


_NESTED = (
    "nn.TransformerEncoder's eval-mode fast path turns a batch with a src_key_padding_mask into a "
    "nested tensor (torch.{op}), which the jax device cannot hold. Build the encoder with "
    "`nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=False)`: the unpadded positions "
    "are the same; the padded ones hold computed values where the nested path gives 0 before the "
    "encoder's final `norm` (the CPU gives the same with that flag)"
)


@register(aten._nested_tensor_from_mask_left_aligned.default)
def nested_tensor_from_mask_left_aligned(t, mask):
    """Refused: the nested path of `nn.TransformerEncoder` cannot run on the jax device (see `_NESTED`)."""
    raise NotImplementedError(_NESTED.format(op="_nested_tensor_from_mask_left_aligned"))


@register(aten._nested_tensor_from_mask.default)
def nested_tensor_from_mask(t, mask, mask_check=True):
    """Refused: see `nested_tensor_from_mask_left_aligned`."""
    raise NotImplementedError(_NESTED.format(op="_nested_tensor_from_mask"))
