"""Greedy decoding of a Hugging Face causal LM as one JAX program, with a static cache.

The recipe, written out so you can adapt it (sampling, other stop rules, batching):

1. `params, fn = jaxtorch.extract(model)`: the model as a pure function of JAX arrays.
2. A `StaticCache` made on the `jax` device and viewed as arrays (`jaxtorch.jax_view`):
   Hugging Face caches are pytrees to jaxtorch, so it is an ordinary `jax.jit` argument
   and loop carry, its arrays traced and its sizes static.
3. Prefill with `fn(params, ids, cache=cache)`, then a `lax.while_loop` one token at a time,
   carrying `(step, token, out.cache, ended, tokens)`: a sequence ends at its first
   end-of-sequence token and is padded after it, as `generate` does, and the loop exits when
   every sequence has ended. `jax.jit` compiles prefill and the whole decode loop into one
   program per (prompt shape, number of new tokens).

**Example:**
    ```python
    import transformers

    config = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=16, intermediate_size=32,
                                      vocab_size=32, num_attention_heads=2)
    model = transformers.LlamaForCausalLM(config).eval()  # eval: no dropout, as generate
    input_ids = torch.randint(3, 32, (2, 5))
    decode = jaxtorch.generation.greedy_decoder(model, max_cache_len=16)
    tokens = decode(input_ids, max_new_tokens=4)  # jax.Array (2, <= 4): generate's greedy tokens
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


def static_cache(model: torch.nn.Module, *, batch_size: int, max_cache_len: int) -> Any:
    """An initialized Hugging Face `StaticCache` for `model`, as a pytree of JAX arrays.

    **Arguments:**
    - `model`: a Hugging Face causal LM (its config gives layers, heads and head size).
    - `batch_size`, `max_cache_len`: the cache's fixed sizes (prompt plus new tokens).

    **Returns:** a `StaticCache` whose tensors are `jax.Array`s (zeros, length 0). Its layers
    are all full-length: a sliding-window layer's Python position counter would change the
    pytree at every step; the model's sliding-window mask keeps attention to the window.

    **Example:**
        ```python
        import transformers

        config = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=16, intermediate_size=32,
                                          vocab_size=32, num_attention_heads=2)
        model = transformers.LlamaForCausalLM(config).eval()  # eval: no dropout, as generate
        params, fn = jaxtorch.extract(model)
        cache = jaxtorch.generation.static_cache(model, batch_size=1, max_cache_len=8)
        out = jax.jit(fn)(params, jnp.array([[5, 6, 7]]), cache=cache)  # out.cache: the filled cache
        ```
    """
    from transformers.cache_utils import StaticCache, StaticLayer, StaticSlidingWindowLayer

    config: Any = model.config
    cfg = config.get_text_config(decoder=True)
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    dtype = next(model.parameters()).dtype
    cache = StaticCache(config=config, max_cache_len=max_cache_len)
    # a sliding-window (or chunked) layer counts its length in a Python int that each step changes, so a
    # loop cannot carry it: such layers get a full-length layer, and the model's own sliding-window mask
    # hides the keys outside the window (the attention generate computes, over the same keys)
    cache.layers = [
        StaticLayer(max_cache_len=max_cache_len) if isinstance(layer, StaticSlidingWindowLayer) else layer
        for layer in cache.layers
    ]
    cache.early_initialization(batch_size, heads, head_dim, dtype, JAX_DEVICE)
    layer: Any
    for layer in cache.layers:  # the position counter, made on the CPU, joins the others
        if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor):
            layer.cumulative_length = to_jax(layer.cumulative_length)
    return jax_view(cache)


_FROM_MODEL: Any = object()  # the default of `eos_token_id`/`pad_token_id`: the model's generation config


def _token_ids(value: Any, name: str) -> tuple[int, ...]:
    """`value` (None, an int or a list of ints) as a tuple of token ids, checked."""
    if value is None:
        return ()
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    ids = [value] if isinstance(value, int) else list(value)
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"greedy_decoder: `{name}` must be None, a token id or a list of token ids; got {value!r}")
    return tuple(ids)


def stop_tokens(
    model: torch.nn.Module, eos_token_id: Any = _FROM_MODEL, pad_token_id: Any = _FROM_MODEL
) -> tuple[tuple[int, ...], int | None]:
    """The end-of-sequence ids and the pad id greedy decoding uses, resolved as Hugging Face's `generate` does.

    **Arguments:**
    - `model`: a Hugging Face model; its `generation_config` gives the defaults.
    - `eos_token_id`: an id or a list of ids ending a sequence; None: none (decode every step).
    - `pad_token_id`: the id written after a sequence ended; by default the generation config's,
      falling back to the first end-of-sequence id, as `generate` does.

    **Returns:** `(eos_ids, pad_id)`: a tuple of ints (empty when nothing ends a sequence) and an int,
    or None when neither is set (then no position is ever padded).

    **Example:**
        ```python
        import transformers

        config = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=16, intermediate_size=32,
                                          vocab_size=32, num_attention_heads=2)
        model = transformers.LlamaForCausalLM(config).eval()  # eval: no dropout, as generate
        assert jaxtorch.generation.stop_tokens(model) == ((2,), 2)     # a LlamaConfig's defaults
        assert jaxtorch.generation.stop_tokens(model, eos_token_id=None) == ((), None)   # nothing ends
        ```
    """
    config: Any = getattr(model, "generation_config", None)
    if eos_token_id is _FROM_MODEL:
        eos_token_id = getattr(config, "eos_token_id", None)
    if pad_token_id is _FROM_MODEL:
        pad_token_id = getattr(config, "pad_token_id", None)
    eos = _token_ids(eos_token_id, "eos_token_id")
    pad = _token_ids(pad_token_id, "pad_token_id")
    if len(pad) > 1:
        raise ValueError(f"greedy_decoder: `pad_token_id` must be one token id; got {pad_token_id!r}")
    return eos, (pad[0] if pad else eos[0] if eos else None)


def greedy_decoder(
    model: torch.nn.Module,
    *,
    max_cache_len: int,
    eos_token_id: Any = _FROM_MODEL,
    pad_token_id: Any = _FROM_MODEL,
) -> Callable:
    """Compile greedy decoding of a Hugging Face causal LM with a static cache, as `generate` decodes.

    Each sequence stops at its first end-of-sequence token (kept in the output); positions after
    it hold `pad_token_id`; decoding stops when every sequence has ended or after `max_new_tokens`,
    so the tokens and their number are those of `model.generate(ids, do_sample=False,
    max_new_tokens=...)` after the prompt.

    **Arguments:**
    - `model`: a Hugging Face causal LM in eval mode (CPU or `jax` device).
    - `max_cache_len`: the static cache length; prompt length plus new tokens must fit.
    - `eos_token_id`: an id or a list of ids that end a sequence; by default the model's
      `generation_config.eos_token_id`; None decodes `max_new_tokens` tokens for every sequence.
    - `pad_token_id`: what follows an ended sequence; by default `generation_config.pad_token_id`,
      else the first end-of-sequence id (as `generate`).

    **Returns:** `decode(input_ids, max_new_tokens) -> jax.Array` of shape `(batch, n)`: the greedy
    tokens after the prompt, `n <= max_new_tokens` (fewer only when every sequence has ended).
    `input_ids` is a torch tensor or a JAX array, unpadded (there is no attention mask). One
    program per prompt shape and `max_new_tokens` (a `lax.while_loop` that exits when every
    sequence has ended), compiled on first use (`decode.compilations` counts them).

    **Example:**
        ```python
        import transformers

        config = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=16, intermediate_size=32,
                                          vocab_size=32, num_attention_heads=2)
        model = transformers.LlamaForCausalLM(config).eval()  # eval: no dropout, as generate
        decode = jaxtorch.generation.greedy_decoder(model, max_cache_len=16)
        new = decode(torch.tensor([[1, 5, 3]]), max_new_tokens=4)  # ends at config.eos_token_id (2)
        ```
    """
    eos, pad_id = stop_tokens(model, eos_token_id, pad_token_id)
    pad = 0 if pad_id is None else pad_id  # with no end-of-sequence id nothing ends, so nothing is padded
    params, fn = extract(model)
    # transformers 5.24 names the cache `cache`; earlier 5.x releases `past_key_values`
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    @functools.partial(jax.jit, static_argnames="steps")
    def run(params: Any, ids: Any, cache: Any, steps: int) -> Any:
        decode.compilations += 1  # type: ignore[attr-defined]  # runs once per trace
        eos_ids = jnp.asarray(eos, dtype=ids.dtype).reshape(-1)

        def next_token(out: Any, ended: Any) -> Any:  # generate's rule: an ended sequence continues with the pad id
            tok = jnp.argmax(out.logits[:, -1], axis=-1).astype(ids.dtype)
            return jnp.where(ended, jnp.asarray(pad, ids.dtype), tok)

        def unfinished(carry: Any) -> Any:
            i, _, _, ended, _ = carry
            return (i < steps) & ~jnp.all(ended)

        def body(carry: Any) -> Any:
            i, tok, cache, ended, toks = carry
            toks = toks.at[:, i].set(tok)
            ended = ended | jnp.any(tok[:, None] == eos_ids, axis=-1)
            out = fn(params, tok[:, None], logits_to_keep=1, **{key: cache})
            return i + 1, next_token(out, ended), out[key], ended, toks

        out = fn(params, ids, logits_to_keep=1, **{key: cache})
        ended = jnp.zeros(ids.shape[0], dtype=bool)
        toks = jnp.full((ids.shape[0], steps), pad, dtype=ids.dtype)
        carry = (jnp.asarray(0), next_token(out, ended), out[key], ended, toks)
        n, _, _, _, toks = jax.lax.while_loop(unfinished, body, carry)
        return toks, n

    def decode(input_ids: Any, max_new_tokens: int) -> jax.Array:
        ids = to_jax(input_ids) if isinstance(input_ids, torch.Tensor) else jnp.asarray(input_ids)
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"greedy_decoder: `max_new_tokens` must be a positive int; got {max_new_tokens!r}")
        if ids.ndim != 2 or not jnp.issubdtype(ids.dtype, jnp.integer):
            raise ValueError(
                f"greedy_decoder: `input_ids` must be integer token ids of shape (batch, length); got "
                f"{ids.dtype} {tuple(ids.shape)}"
            )
        if ids.shape[1] == 0:
            raise ValueError(
                f"greedy_decoder: `input_ids` of shape {tuple(ids.shape)} holds no token; a decoder-only model needs "
                "at least one token to predict from (`generate` fails on an empty prompt too): start each prompt "
                "with the tokenizer's beginning-of-sequence id (`tokenizer.bos_token_id`)."
            )
        if ids.shape[1] + max_new_tokens > max_cache_len:
            raise ValueError(
                f"greedy_decoder: a prompt of {ids.shape[1]} tokens plus {max_new_tokens} new ones "
                f"does not fit the static cache of {max_cache_len}; make a decoder with a larger "
                "`max_cache_len`."
            )
        if pad_id is not None and pad_id not in eos and bool(jnp.any(ids == pad_id)):
            raise ValueError(
                f"greedy_decoder: the prompt contains the pad token {pad_id}, which `generate` would mask out as "
                "padding; greedy_decoder takes unpadded prompts (no attention mask). Decode prompts of "
                "different lengths separately, or pass another `pad_token_id`."
            )
        cache = static_cache(model, batch_size=ids.shape[0], max_cache_len=max_cache_len)
        toks, n = run(params, ids, cache, max_new_tokens)
        return toks[:, : int(n)]

    decode.compilations = 0  # type: ignore[attr-defined]
    return decode


__all__ = ["greedy_decoder", "static_cache", "stop_tokens"]
