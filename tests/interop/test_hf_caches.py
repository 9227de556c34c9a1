"""Hugging Face caches are pytrees to jaxtorch with no user code (issue 12 item 1).

Every cache kind of the pinned transformers goes into and out of `jax.jit`, `jax.grad`,
`jaxtorch.jit`/`compile` and `jax.export`, its arrays traced and its metadata (max length,
layer kinds, Python counters) in the treedef; the full `ModelOutput` with its cache comes
back from `jax.jit(fn)(params, ids)` under a Llama's default config.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.utils._pytree as torch_pytree

import jaxtorch
from tests._hf_models import TINY_DECODER, tiny_llama

transformers = pytest.importorskip("transformers")
cu = pytest.importorskip("transformers.cache_utils")


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    return tiny_llama(bos_token_id=0, eos_token_id=0).eval()


@pytest.fixture(scope="module")
def qwen2_hybrid():
    """One sliding-window layer and one full-attention layer (a hybrid cache)."""
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        **TINY_DECODER,
        use_sliding_window=True,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
    )
    return transformers.Qwen2ForCausalLM(cfg).eval()


def _filled(model, cache):
    """`cache` after a torch prefill of 6 tokens and one decode step."""
    with torch.no_grad():
        model(torch.randint(1, 64, (1, 6)), cache=cache)
        model(torch.randint(1, 64, (1, 1)), cache=cache)
    return cache


def _cache(kind, llama, qwen2_hybrid):
    cfg = llama.config
    if kind == "dynamic":
        return _filled(llama, cu.DynamicCache(config=cfg))
    if kind == "static":
        return _filled(llama, cu.StaticCache(config=cfg, max_cache_len=12))
    if kind == "sliding_dynamic":
        return _filled(qwen2_hybrid, cu.DynamicCache(config=qwen2_hybrid.config))
    if kind == "sliding_static":
        return _filled(qwen2_hybrid, cu.StaticCache(config=qwen2_hybrid.config, max_cache_len=12))
    if kind == "quantized_fp8":
        return _filled(llama, cu.QuantizedCache("fp8", cfg))
    if kind == "encoder_decoder":
        return cu.EncoderDecoderCache(
            _filled(llama, cu.DynamicCache(config=cfg)), _filled(llama, cu.DynamicCache(config=cfg))
        )
    raise ValueError(kind)


KINDS = ["dynamic", "static", "sliding_dynamic", "sliding_static", "quantized_fp8", "encoder_decoder"]
LAYERS = {
    "dynamic": {"DynamicLayer"},
    "static": {"StaticLayer"},
    "sliding_dynamic": {"DynamicSlidingWindowLayer", "DynamicLayer"},
    "sliding_static": {"StaticSlidingWindowLayer", "StaticLayer"},
    "quantized_fp8": {"Fp8QuantizedLayer"},
    "encoder_decoder": {"DynamicLayer"},
}


def _tensors(cache):
    return [x for x in torch_pytree.tree_leaves(cache) if isinstance(x, torch.Tensor)]


def _layer_kinds(cache):
    caches = (
        [cache.self_attention_cache, cache.cross_attention_cache]
        if hasattr(cache, "cross_attention_cache")
        else [cache]
    )
    return {type(layer).__name__ for c in caches for layer in c.layers}


def _double(tree):
    return jax.tree_util.tree_map(lambda a: a * 2 if jnp.issubdtype(a.dtype, jnp.float32) else a, tree)


@pytest.mark.parametrize("kind", KINDS)
def test_every_cache_kind_goes_through_jit_grad_export_and_jaxtorch_jit(kind, llama, qwen2_hybrid):
    cache = _cache(kind, llama, qwen2_hybrid)
    assert _layer_kinds(cache) == LAYERS[kind]
    tensors = _tensors(cache)  # torch's pytree walks it too (one registration, both registries)
    assert len(tensors) >= 4

    jc = jaxtorch.to_jax(cache)
    assert type(jc) is type(cache)
    leaves = jax.tree_util.tree_leaves(jc)
    assert len(leaves) == len(tensors) and all(isinstance(a, jax.Array) for a in leaves)
    for a, t in zip(leaves, tensors):
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), t.float().numpy())

    traced = []
    out = jax.jit(lambda c: (traced.append(1), _double(c))[1])(jc)  # arrays traced, never static
    assert type(out) is type(cache) and len(traced) == 1
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(jc)
    for a, b in zip(jax.tree_util.tree_leaves(out), leaves):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b * 2 if b.dtype == jnp.float32 else b))

    def total(c):
        return sum(jnp.sum(a) for a in jax.tree_util.tree_leaves(c) if a.dtype == jnp.float32)

    grads = jax.grad(total, allow_int=True)(jc)
    assert type(grads) is type(cache)
    for g, a in zip(jax.tree_util.tree_leaves(grads), leaves):
        if a.dtype == jnp.float32:
            np.testing.assert_array_equal(np.asarray(g), np.ones(a.shape, np.float32))

    exported = jax.export.deserialize(jax.export.export(jax.jit(_double))(jc).serialize())
    for a, b in zip(jax.tree_util.tree_leaves(exported.call(jc)), jax.tree_util.tree_leaves(out)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    step = jaxtorch.jit(lambda c: c)
    back = step(cache)
    step(cache)
    assert type(back) is type(cache) and step.compilations == 1
    for a, t in zip(_tensors(back), tensors):
        assert a is t  # a returned input is the input itself, as in eager torch (issue 23 item 8)


def test_static_metadata_lives_in_the_treedef(llama):
    def structure(n):
        return jax.tree_util.tree_structure(jaxtorch.to_jax(cu.StaticCache(config=llama.config, max_cache_len=n)))

    assert structure(12) == structure(12)
    assert structure(12) != structure(13)  # max_cache_len is static
    assert "max_cache_len=12" in str(structure(12))


def test_model_output_with_its_cache_comes_back_from_jax_jit(llama):
    params, fn = jaxtorch.extract(llama)  # the default config: use_cache=True, a DynamicCache
    ids = torch.randint(1, 64, (2, 7))
    out = jax.jit(fn)(params, jnp.asarray(ids.numpy()))
    with torch.no_grad():
        ref = llama(ids)
    assert type(out) is type(ref) and type(out.cache) is cu.DynamicCache
    np.testing.assert_allclose(np.asarray(out.logits), ref.logits.numpy(), rtol=1e-5, atol=1e-5)
    for a, t in zip(jax.tree_util.tree_leaves(out.cache), _tensors(ref.cache)):
        np.testing.assert_allclose(np.asarray(a), t.numpy(), rtol=1e-5, atol=1e-5)

    nxt = ids[:, -1:]  # the returned cache goes back in for the next step
    out2 = jax.jit(fn)(params, jnp.asarray(nxt.numpy()), cache=out.cache)
    with torch.no_grad():
        ref2 = llama(nxt, cache=ref.cache)
    np.testing.assert_allclose(np.asarray(out2.logits), ref2.logits.numpy(), rtol=1e-5, atol=1e-5)


class _KV:
    def __init__(self, k, v, length: int):
        self.k, self.v, self.length = k, v, length


jax.tree_util.register_pytree_node(  # the way public tutorials register a type
    _KV, lambda kv: ((kv.k, kv.v), kv.length), lambda length, kv: _KV(kv[0], kv[1], length)
)


def test_a_tutorial_style_jax_registration_works_with_every_conversion():
    def grow(kv, x):
        return _KV(torch.cat([kv.k, x]), torch.cat([kv.v, -x]), kv.length + 1)

    kv = _KV(jnp.ones(2), jnp.zeros(2), 2)
    out = jax.jit(lambda kv, x: jaxtorch.call_torch(grow, kv, x))(kv, jnp.full(1, 3.0))
    assert type(out) is _KV and out.length == 3
    np.testing.assert_array_equal(np.asarray(out.k), [1, 1, 3])
    back = jaxtorch.to_torch(out)
    assert isinstance(back.v, torch.Tensor) and back.v.tolist() == [0, 0, -3]


@jaxtorch.register_object
class _Counter:
    def __init__(self, total, steps: int):
        self.total, self.steps = total, steps


def test_register_object_makes_a_class_a_pytree_of_both_registries():
    c = _Counter(torch.zeros(3), 0)
    assert torch_pytree.tree_leaves(c)[0] is c.total
    j = jaxtorch.to_jax(c)
    assert isinstance(j.total, jax.Array) and j.steps == 0
    out = jax.jit(lambda c: _Counter(c.total + 1, c.steps))(j)
    assert out.steps == 0 and np.asarray(out.total).tolist() == [1, 1, 1]
