"""State semantics of `jaxtorch.jit` / `jaxtorch.compile` (issue 12 items 2 and 3).

Every tensor reachable from the arguments that the function writes in place is program
state, carried in and written back, compiled once per shape; a write jaxtorch cannot carry
out raises; no tracer leaks; modules are left as found. Greedy decoding with a static cache
gives exactly torch's tokens, and `model.generate` with a compiled forward compiles a
bounded number of times.
"""

from __future__ import annotations

import copy
import dataclasses
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxtorch
from jaxtorch import StateWriteError
from tests._hf_models import TINY_LLAMA, tiny_llama

transformers = pytest.importorskip("transformers")
cu = pytest.importorskip("transformers.cache_utils")

PROMPT, STEPS = 5, 32


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    return tiny_llama(bos_token_id=0, eos_token_id=0).eval()


@pytest.fixture(scope="module")
def jax_llama(llama):
    jaxtorch.enable_globally()  # generate's own bookkeeping runs eagerly on the jax device
    yield copy.deepcopy(llama).to("jax")
    jaxtorch.disable_globally()


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(1, 64, (1, PROMPT), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def torch_tokens(llama, prompt):
    """Torch's greedy tokens with a static cache, one forward per token."""
    cache = cu.StaticCache(config=llama.config, max_cache_len=PROMPT + STEPS)
    with torch.no_grad():
        tok = llama(prompt, cache=cache).logits[:, -1:].argmax(-1)
        tokens = [tok.item()]
        for _ in range(STEPS - 1):
            tok = llama(tok, cache=cache).logits[:, -1:].argmax(-1)
            tokens.append(tok.item())
    return tokens


def test_in_place_static_cache_decode_step_matches_torch_with_one_compilation(jax_llama, prompt, torch_tokens, llama):
    @jaxtorch.jit
    def step(model, tok, cache):  # updates the cache in place, returns only the next token
        return model(tok, cache=cache).logits[:, -1:].argmax(-1)

    cache = cu.StaticCache(config=llama.config, max_cache_len=PROMPT + STEPS)
    with torch.no_grad():
        prefill = jaxtorch.jit(step.__wrapped__)
        tok = prefill(jax_llama, prompt.to("jax"), cache)
        tokens = [tok.item()]
        for _ in range(STEPS - 1):
            tok = step(jax_llama, tok, cache)
            tokens.append(tok.item())
    assert tokens == torch_tokens
    assert step.compilations == 1 and prefill.compilations == 1
    assert int(cache.layers[0].cumulative_length.cpu()) == PROMPT + STEPS - 1  # written back, concrete
    assert not isinstance(cache.layers[0].keys.jax(), jax.core.Tracer)


def test_decode_step_returning_the_cache_matches_torch(jax_llama, prompt, torch_tokens, llama):
    @jaxtorch.jit
    def step(model, tok, cache):
        return model(tok, cache=cache).logits[:, -1:].argmax(-1), cache

    cache = cu.StaticCache(config=llama.config, max_cache_len=PROMPT + STEPS)
    with torch.no_grad():
        tok, cache = step(jax_llama, prompt.to("jax"), cache)
        tokens = [tok.item()]
        for _ in range(STEPS - 1):
            tok, cache = step(jax_llama, tok, cache)
            tokens.append(tok.item())
    assert tokens == torch_tokens
    assert step.compilations == 2  # prefill (5 tokens) and decode (1 token)


def test_generate_with_a_compiled_forward_compiles_prefill_and_decode_once(jax_llama, llama, prompt):
    model = copy.deepcopy(jax_llama)
    model.forward = jaxtorch.compile(model.forward)  # as torch.compile users do
    kw = dict(max_new_tokens=12, do_sample=False, cache_implementation="static", pad_token_id=0)
    ref = llama.generate(prompt, **kw)
    got = model.generate(prompt.to("jax"), **kw)
    assert got.cpu().tolist() == ref.tolist()
    assert model.forward.compilations == 2  # prefill once for this prompt length, decode once
    got = model.generate(prompt.to("jax"), **kw)
    assert got.cpu().tolist() == ref.tolist() and model.forward.compilations == 2
    assert all(not isinstance(p.jax(), jax.core.Tracer) for p in model.parameters())


@dataclasses.dataclass
class _Acc:
    total: torch.Tensor
    seen: list


def test_in_place_writes_through_lists_dicts_and_dataclasses_are_carried():
    @jaxtorch.jit
    def f(x, box):
        box["sum"].add_(x.sum())
        box["acc"].total.mul_(2)
        box["log"][0].copy_(x)
        return x * 2

    box = {"sum": torch.zeros(()), "acc": _Acc(torch.ones(2), []), "log": [torch.zeros(3)]}
    for i in range(3):
        x = torch.full((3,), float(i + 1))
        f(x, box)
    assert f.compilations == 1
    assert float(box["sum"]) == 18.0 and box["acc"].total.tolist() == [8.0, 8.0]
    assert box["log"][0].tolist() == [3.0, 3.0, 3.0] and type(box["sum"]) is torch.Tensor


def test_a_write_to_a_closed_over_tensor_is_written_back_and_leaks_nothing():
    # issue 23 item 7: a closed-over tensor is a program input, its writes are written back
    counter = torch.zeros(3, device="jax")

    @jaxtorch.jit
    def f(x):
        counter.add_(x)
        return x * 2

    f(torch.ones(3))
    f(torch.ones(3))
    assert not isinstance(counter.jax(), jax.core.Tracer)
    assert counter.cpu().tolist() == [2.0, 2.0, 2.0]
    assert f.compilations == 1


def test_a_write_to_a_closed_over_cache_raises_naming_it(jax_llama, llama, prompt):
    cache = cu.StaticCache(config=llama.config, max_cache_len=PROMPT + 2)
    with torch.no_grad():
        jax_llama(prompt.to("jax"), cache=cache)  # eager prefill: the cache holds jax arrays

    @jaxtorch.jit
    def step(tok):
        return jax_llama(tok, cache=cache).logits.argmax(-1)

    with torch.no_grad(), pytest.raises(StateWriteError, match=r"cache\.layers\[0\]"):
        step(prompt[:, :1].to("jax"))
    assert not isinstance(cache.layers[0].keys.jax(), jax.core.Tracer)
    assert int(cache.layers[0].cumulative_length.cpu()) == PROMPT


class _Shared(torch.nn.Module):
    """One submodule under two names (as timm's CoaT reuses its cpe convs)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = self.a
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return self.b(self.a(x))


def test_a_compiled_module_sharing_a_submodule_is_left_exactly_as_found():
    torch.manual_seed(0)
    model = _Shared()
    before = {k: v for k, v in vars(model.a).items()}
    params_before = dict(model.a._parameters)
    fast = jaxtorch.compile(model)
    x = torch.randn(2, 4)
    np.testing.assert_allclose(
        fast(x).detach().cpu().numpy(), model.a(model.a(x)).detach().numpy(), rtol=1e-5, atol=1e-6
    )
    fast(x)
    assert fast.compilations == 1 and float(model.calls) == 2.0
    assert model.b is model.a and dict(model.a._parameters) == params_before
    assert all(vars(model.a)[k] is v for k, v in before.items())
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())


def test_a_traced_tensor_stored_on_a_module_raises_and_the_module_is_restored():
    class Stash(torch.nn.Module):
        def forward(self, x):
            self.last = x * 2  # a plain attribute, not a buffer: cannot outlive the program
            return x + 1

    model = Stash()
    with pytest.raises(StateWriteError, match="Stash.last"):
        jaxtorch.compile(model)(torch.ones(2))
    assert not hasattr(model, "last")


def test_greedy_decoder_is_one_program_with_torchs_tokens(llama, prompt, torch_tokens):
    # the config's end-of-sequence id, 0, is never the greedy choice here (the prompt's ids are >= 1 too),
    # so torch's generate also gives all STEPS tokens: the decoder's default (the config's id) is in force
    generated = llama.generate(prompt, max_new_tokens=STEPS, do_sample=False)[0, PROMPT:].tolist()
    assert llama.generation_config.eos_token_id == 0 and 0 not in torch_tokens and generated == torch_tokens
    decode = jaxtorch.generation.greedy_decoder(llama, max_cache_len=PROMPT + STEPS)
    assert np.asarray(decode(prompt, STEPS))[0].tolist() == torch_tokens
    decode(prompt, STEPS)
    assert decode.compilations == 1
    with pytest.raises(ValueError, match="max_cache_len"):
        decode(prompt, STEPS + 1)


@pytest.fixture(scope="module")
def batch():
    """Three prompts whose greedy continuations (no end-of-sequence id) differ."""
    return torch.randint(1, 64, (3, PROMPT), generator=torch.Generator().manual_seed(2))


@pytest.fixture(scope="module")
def endless(llama, batch):
    """generate's greedy tokens for `batch` with nothing ending a sequence."""
    return llama.generate(batch, max_new_tokens=STEPS, do_sample=False, eos_token_id=None)[:, PROMPT:]


def _first_ends(tokens: torch.Tensor, eos: list[int]) -> list[int]:
    """Per row, the step of its first end-of-sequence token (len(row) when none)."""
    hits = torch.isin(tokens, torch.tensor(eos))
    return [int(row.nonzero()[0]) if row.any() else tokens.shape[1] for row in hits]


def _stops(endless: torch.Tensor) -> list[int]:
    """End-of-sequence ids, one per row, that end the three rows at three different steps."""
    eos = [int(endless[0, 3]), int(endless[1, 8]), int(endless[2, 5])]
    ends = _first_ends(endless, eos)
    assert len(set(ends)) == 3 and max(ends) < STEPS - 1, (eos, ends)  # the data this test needs
    return eos


# how each case sets the stop tokens (`eos`; `pad`, an id in no prompt: generate would mask it out) on
# the model's generation config, or as arguments (to both `generate` and `greedy_decoder`); "row 0 only"
# ends one row, so decoding runs all STEPS steps
_EOS_CASES = {
    "config list, pad from eos": lambda eos, pad: ({"eos_token_id": eos}, {}),
    "config int, arguments override with a list and a pad": lambda eos, pad: (
        {"eos_token_id": 0},
        {"eos_token_id": eos, "pad_token_id": pad},
    ),
    "config pad id": lambda eos, pad: ({"eos_token_id": eos[::-1], "pad_token_id": pad}, {}),
    "row 0 only": lambda eos, pad: ({}, {"eos_token_id": eos[0]}),
    "None disables the config's": lambda eos, pad: ({"eos_token_id": eos}, {"eos_token_id": None}),
}


@pytest.mark.parametrize("case", list(_EOS_CASES))
def test_greedy_decoder_stops_each_sequence_at_eos_and_pads_as_generate(llama, batch, endless, case):
    eos = _stops(endless)
    pad = max(set(range(1, 64)) - set(batch.flatten().tolist()) - set(eos))
    config, kwargs = _EOS_CASES[case](eos, pad)
    model = copy.deepcopy(llama)
    for name, value in config.items():
        setattr(model.generation_config, name, value)
    expected = model.generate(batch, max_new_tokens=STEPS, do_sample=False, **kwargs)[:, PROMPT:]
    decode = jaxtorch.generation.greedy_decoder(model, max_cache_len=PROMPT + STEPS, **kwargs)
    tokens = decode(batch, STEPS)
    assert tokens.shape == tuple(expected.shape)  # generate stops when every sequence has ended
    np.testing.assert_array_equal(np.asarray(tokens), expected.numpy())
    assert decode.compilations == 1
    np.testing.assert_array_equal(np.asarray(decode(batch, STEPS)), expected.numpy())
    assert decode.compilations == 1  # one program: prefill and the early-exiting loop


def test_greedy_decoder_ends_when_every_sequence_has_ended(llama, batch, endless):
    eos = _stops(endless)
    decode = jaxtorch.generation.greedy_decoder(llama, max_cache_len=PROMPT + STEPS, eos_token_id=eos)
    tokens = np.asarray(decode(batch, STEPS))
    ends = _first_ends(endless, eos)
    assert tokens.shape == (3, max(ends) + 1)
    for row, end in enumerate(ends):  # each row: the greedy tokens up to its end token, then the pad id (eos[0])
        assert tokens[row, : end + 1].tolist() == endless[row, : end + 1].tolist()
        assert (tokens[row, end + 1 :] == eos[0]).all()


def test_greedy_decoder_refuses_a_prompt_holding_the_pad_id_and_bad_ids(llama, batch):
    # generate would treat pad ids in the prompt as padding (an attention mask the decoder does not take)
    padded = batch.clone()
    padded[0, 0] = 63
    decode = jaxtorch.generation.greedy_decoder(llama, max_cache_len=PROMPT + STEPS, pad_token_id=63)
    assert 63 != llama.generation_config.eos_token_id
    with pytest.raises(ValueError, match="contains the pad token 63"):
        decode(padded, 4)
    for bad in (-1, "2", [1.5], True):
        with pytest.raises(ValueError, match="eos_token_id"):
            jaxtorch.generation.greedy_decoder(llama, max_cache_len=PROMPT + STEPS, eos_token_id=bad)
    with pytest.raises(ValueError, match="one token id"):
        jaxtorch.generation.greedy_decoder(llama, max_cache_len=PROMPT + STEPS, pad_token_id=[1, 2])
    for steps in (0, -1, 2.0):
        with pytest.raises(ValueError, match="max_new_tokens"):
            decode(batch, steps)
    with pytest.raises(ValueError, match="token ids of shape"):
        decode(batch[0], 4)


_WINDOWED = {  # tiny decoders with a sliding window of 4 (prompts of 6 go beyond it); hybrid: one of each layer
    "mistral": lambda: transformers.MistralConfig(sliding_window=4, **TINY_LLAMA),
    "qwen2 hybrid": lambda: transformers.Qwen2Config(
        use_sliding_window=True, sliding_window=4, max_window_layers=1, **TINY_LLAMA
    ),
    "gemma2 hybrid": lambda: transformers.Gemma2Config(sliding_window=4, head_dim=8, **TINY_LLAMA),
}


@pytest.mark.parametrize("arch", list(_WINDOWED))
def test_greedy_decoder_of_a_sliding_window_model_gives_generates_tokens(arch):
    """Issue 30 item 8: before, the sliding layers' Python position counter changed the loop carry's
    pytree (JAX's 'while_loop carry ... pytree structure' error)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_WINDOWED[arch]()).eval()
    ids = torch.randint(1, 64, (2, 6), generator=torch.Generator().manual_seed(3))
    expected = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None)[:, 6:]
    windowless = copy.deepcopy(model)
    windowless.config.sliding_window = 64  # the window matters here: without it, other tokens
    unwindowed = windowless.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None)[:, 6:]
    assert not torch.equal(unwindowed, expected)
    decode = jaxtorch.generation.greedy_decoder(model, max_cache_len=18, eos_token_id=None)
    np.testing.assert_array_equal(np.asarray(decode(ids, 12)), expected.numpy())
    assert decode.compilations == 1


def test_greedy_decoder_refuses_an_empty_prompt_clearly(llama):
    """Issue 30 item 8: before, ZeroDivisionError (generate fails too, with a reshape error)."""
    decode = jaxtorch.generation.greedy_decoder(llama, max_cache_len=8)
    with pytest.raises(ValueError, match="holds no token.*bos_token_id"):
        decode(torch.zeros(1, 0, dtype=torch.long), 3)


class _Running:  # a plain class of the user's, not registered anywhere
    def __init__(self):
        self.mean = torch.zeros(2)
        self.steps = 0


def test_tensors_of_a_plain_object_argument_are_state_not_constants():
    @jaxtorch.jit
    def update(stats, x):
        stats.mean.mul_(0.5).add_(x * 0.5)
        return stats.mean.sum()

    stats = _Running()
    for _ in range(3):
        update(stats, torch.full((2,), 4.0))
    assert stats.mean.tolist() == [3.5, 3.5] and update.compilations == 1 and stats.steps == 0


def test_a_write_to_a_closed_over_cpu_tensor_is_written_back():
    # issue 23 item 7: the closed-over CPU tensor is a program input, written back like an argument
    counter = torch.zeros(())

    @jaxtorch.jit
    def f(x):
        counter.add_(1)
        return x + 1

    f(torch.ones(2))
    f(torch.ones(2))
    assert float(counter) == 2.0 and type(counter) is torch.Tensor


def test_the_generation_docstring_examples_run_on_a_model_built_from_a_config():
    """Each Example of `jaxtorch.generation` runs as written (with the imports every docstring Example
    may assume, as tests/test_docs.py runs them) and gives what its comments say."""
    import re

    gen = jaxtorch.generation
    results = []
    for doc in [gen.__doc__, gen.greedy_decoder.__doc__, gen.static_cache.__doc__, gen.stop_tokens.__doc__]:
        (code,) = re.findall(r"```python\n(.*?)```", doc, re.S)
        namespace: dict = {"torch": torch, "jax": jax, "jnp": jnp, "jaxtorch": jaxtorch}
        exec(textwrap.dedent(code), namespace)
        results.append(namespace)
    tokens, new, out = results[0]["tokens"], results[1]["new"], results[2]["out"]
    assert tokens.shape[0] == 2 and 1 <= tokens.shape[1] <= 4
    assert new.shape[0] == 1 and 1 <= new.shape[1] <= 4
    assert out.logits.shape == (1, 3, 32)


def test_python_values_a_compiled_function_returns_are_torch_s():
    """Issue 30 item 13: `x.shape`, `x.dtype`, `x.size(0)` come back as torch.Size, torch.dtype, int."""

    def f(x):
        return x.shape, x.dtype, x.size(0), x * 2, {"n": x.numel(), "rows": [x.size(1), None]}

    fast = jaxtorch.jit(f)
    x = torch.randn(3, 2)
    for _ in range(2):  # traced, then cached
        shape, dtype, n, y, d = fast(x)
        eshape, edtype, en, ey, ed = f(x)
        assert type(shape) is torch.Size and shape == eshape
        assert dtype is edtype and type(n) is int and n == en
        assert d == ed and type(d["n"]) is int
        np.testing.assert_allclose(y.cpu().numpy(), ey.numpy())
    assert fast.compilations == 1
    assert jaxtorch.jit(lambda x: x.size(0))(x) == 3


def test_python_values_returned_beside_a_differentiable_result():
    lin = torch.nn.Linear(2, 2)
    fast = jaxtorch.compile(lambda x: (lin(x).sum(), lin.weight.shape))
    loss, shape = fast(torch.ones(1, 2))
    loss.backward()
    assert shape == torch.Size([2, 2]) and lin.weight.grad is not None
    np.testing.assert_allclose(lin.weight.grad.cpu().numpy(), np.ones((2, 2)))
