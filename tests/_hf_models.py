"""Tiny Hugging Face decoders with random weights, shared by the tests (nothing downloaded).

Each test passes the values it differs in as overrides, so its config stays exactly what it
was; seeding (`torch.manual_seed`) and `.eval()` / `.train()` stay with the caller.
`transformers` is imported on call, so a test module can still `pytest.importorskip` it first.

Example:
    ```python
    torch.manual_seed(0)
    model = tiny_llama(vocab_size=128, tie_word_embeddings=True).eval()
    cfg = tiny_llama_config(max_position_embeddings=32, attn_implementation="sdpa")
    ```
"""

from __future__ import annotations

from typing import Any

# the sizes of a 2-layer decoder with grouped-query attention (4 query heads, 2 key/value heads)
TINY_DECODER: dict[str, Any] = dict(
    num_hidden_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=64,
    vocab_size=64,
)
TINY_LLAMA: dict[str, Any] = dict(TINY_DECODER, max_position_embeddings=64)


def tiny_llama_config(**overrides: Any) -> Any:
    """A `transformers.LlamaConfig` of `TINY_LLAMA`'s values, `overrides` replacing or adding keys.

    Example: `tiny_llama_config(max_position_embeddings=32, use_cache=False)`.
    """
    import transformers

    return transformers.LlamaConfig(**{**TINY_LLAMA, **overrides})


def tiny_llama(cls: Any = None, **overrides: Any) -> Any:
    """`cls(tiny_llama_config(**overrides))` with random weights; `cls` is `LlamaForCausalLM` by default.

    Example: `tiny_llama(transformers.LlamaModel, vocab_size=128)`.
    """
    import transformers

    return (cls or transformers.LlamaForCausalLM)(tiny_llama_config(**overrides))
