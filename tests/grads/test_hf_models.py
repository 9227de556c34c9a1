"""One gradient, whichever path, for tiny Hugging Face causal LMs (issue 29, item 6).

The decoders of `tests/_hf_models.py` (random weights, nothing downloaded), in eval mode,
with the causal-LM loss `model(ids, labels=ids).loss`: their parameters' gradients agree
between CPU PyTorch and every other path of `tests/grads/_paths.py`. Two-way expected
failures as in `test_semantics_models.py` (names `hf.<model>`).
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests._hf_models import tiny_llama
from tests.grads import _paths
from tests.grads._expected import check

pytest.importorskip("transformers", reason="Hugging Face transformers is not installed")

PATHS = ("eager", "jit", "extract", "train_step")
RTOL = 1e-5


class CausalLM(torch.nn.Module):
    """`lm(ids, labels=ids).loss` as a module of the token ids (parameter names `lm.*`)."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, ids):
        return self.lm(ids, labels=ids, use_cache=False).loss


def _llama(**overrides):
    def factory():
        torch.manual_seed(0)
        return CausalLM(tiny_llama(**overrides).eval())

    return factory


MODELS = {
    "hf.llama": _llama(),
    "hf.llama_tied": _llama(tie_word_embeddings=True),  # one gradient for the shared embedding
}
IDS = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))


def _loss(out):
    return out


@functools.cache
def _reference(name: str):
    return _paths.grads_cpu(MODELS[name], (IDS,), _loss)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", list(MODELS))
def test_hf_causal_lm(name, path):
    check(
        path,
        name,
        lambda: _paths.compare(_reference(name), _paths.GRADS[path](MODELS[name], (IDS,), _loss), rtol=RTOL),
    )
