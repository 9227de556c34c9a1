"""Greedy decoding of a Hugging Face causal LM as one JAX program, with a static cache.

The recipe, written out so you can adapt it (sampling, stop tokens, batching):

1. `params, fn = jaxtorch.extract(model)`: the model as a pure function of JAX arrays.
2. A `StaticCache` made on the `jax` device and viewed as arrays (`jaxtorch.jax_view`):
   Hugging Face caches are pytrees to jaxtorch, so it is an ordinary `jax.jit` argument
   and `lax.scan` carry, its arrays traced and its sizes static.
3. Prefill with `fn(params, ids, cache=cache)`, then `lax.scan` one token at a time,
   carrying `(token, out.cache)`; `jax.jit` compiles prefill and the whole decode loop into
   one program per (prompt shape, number of new tokens).

Example:
    ```python
    decode = jaxtorch.generation.greedy_decoder(model, max_cache_len=128)
    tokens = decode(input_ids, max_new_tokens=32)     # jax.Array (batch, 32), torch's greedy tokens
    ```
The torch-first alternatives: `model.forward = jaxtorch.compile(model.forward)` and then
`model.generate(ids, do_sample=False, cache_implementation="static")` (one compilation
for the prefill per prompt length and one for decoding), or a `jaxtorch.jit` step that
updates the cache in place (see `jaxtorch.compile`).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import torch

from .bridge.api._jax_first import extract
from .bridge.tensor._convert import jax_view, to_jax
from .bridge.tensor._device import JAX_DEVICE


def static_cache(model: torch.nn.Module, *, batch_size: int, max_cache_len: int):
    """An initialized Hugging Face `StaticCache` for `model`, as a pytree of JAX arrays.

    **Arguments:**
    - `model`: a Hugging Face causal LM (its config gives layers, heads and head size).
    - `batch_size`, `max_cache_len`: the cache's fixed sizes (prompt plus new tokens).

    **Returns:** a `StaticCache` whose tensors are `jax.Array`s (zeros, length 0).

    **Example:**
        ```python
        cache = static_cache(model, batch_size=1, max_cache_len=64)
        out = jax.jit(fn)(params, ids, cache=cache)     # out.cache: the filled cache
        ```
    """
    from transformers.cache_utils import StaticCache

    config: Any = model.config
    cfg = config.get_text_config(decoder=True)
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    dtype = next(model.parameters()).dtype
    cache = StaticCache(config=config, max_cache_len=max_cache_len)
    cache.early_initialization(batch_size, heads, head_dim, dtype, JAX_DEVICE)
    layer: Any
    for layer in cache.layers:  # the position counter, made on the CPU, joins the others
        if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor):
            layer.cumulative_length = to_jax(layer.cumulative_length)
    return jax_view(cache)


def greedy_decoder(model: torch.nn.Module, *, max_cache_len: int) -> Callable:
    """Compile greedy decoding of a Hugging Face causal LM with a static cache.

    **Arguments:**
    - `model`: a Hugging Face causal LM in eval mode (CPU or `jax` device).
    - `max_cache_len`: the static cache length; prompt length plus new tokens must fit.

    **Returns:** `decode(input_ids, max_new_tokens) -> jax.Array` of shape
    `(batch, max_new_tokens)`: the greedy tokens after the prompt (torch's greedy tokens).
    `input_ids` is a torch tensor or a JAX array. One program per prompt shape and
    `max_new_tokens`, compiled on first use (`decode.compilations` counts them).

    **Example:**
        ```python
        decode = greedy_decoder(model, max_cache_len=64)
        new = decode(torch.tensor([[1, 2, 3]]), max_new_tokens=16)
        ```
    """
    params, fn = extract(model)
    # transformers 5.24 names the cache `cache`; earlier 5.x releases `past_key_values`
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    @functools.partial(jax.jit, static_argnames="steps")
    def run(params, ids, cache, steps: int):
        decode.compilations += 1  # type: ignore[attr-defined]  # runs once per trace
        out = fn(params, ids, logits_to_keep=1, **{key: cache})
        tok = jnp.argmax(out.logits[:, -1], axis=-1).astype(ids.dtype)

        def body(carry, _):
            tok, cache = carry
            out = fn(params, tok[:, None], logits_to_keep=1, **{key: cache})
            return (jnp.argmax(out.logits[:, -1], axis=-1).astype(ids.dtype), out[key]), tok

        _, toks = jax.lax.scan(body, (tok, out[key]), None, length=steps)
        return toks.T

    def decode(input_ids, max_new_tokens: int) -> jax.Array:
        ids = to_jax(input_ids) if isinstance(input_ids, torch.Tensor) else jnp.asarray(input_ids)
        if ids.shape[1] + max_new_tokens > max_cache_len:
            raise ValueError(
                f"greedy_decoder: a prompt of {ids.shape[1]} tokens plus {max_new_tokens} new ones "
                f"does not fit the static cache of {max_cache_len}; make a decoder with a larger "
                "`max_cache_len`."
            )
        cache = static_cache(model, batch_size=ids.shape[0], max_cache_len=max_cache_len)
        return run(params, ids, cache, max_new_tokens)

    decode.compilations = 0  # type: ignore[attr-defined]
    return decode


__all__ = ["greedy_decoder", "static_cache"]
