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
from ._semantics import binary, broadcast_to
from .registry import keep_whole, register

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
