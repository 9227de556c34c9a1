"""Loading, saving and decoding under hostile inputs (issue 30, beyond its list): what `load_params`
reads from a folder, names, prefixes, tied weights, dtypes and buffers; `load_into` a meta-device
module; `torch.save` / `safetensors` / `save_checkpoint` round trips, an interrupted save; and
`greedy_decoder` against Hugging Face's `generate(do_sample=False)` on several small architectures.

The reference is always `from_pretrained` on the same folder, CPU `load_state_dict`, or `generate`.
"""

from __future__ import annotations

import copy
import functools
import io
import json
import warnings
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import jaxtorch
from jaxtorch.train import CheckpointError
from jaxtorch.train._load import CheckpointKeysWarning
from tests._hf_models import TINY_LLAMA

from .harness import case, clear_error, equal, refuses_or, scratch_dir


def _tmp() -> Path:
    return scratch_dir("jt-loading-")


@functools.cache
def _llama(seed: int, tie: bool = False, cls: str = "LlamaForCausalLM"):
    """A tiny Llama with random weights (`seed`), eval mode; shared, so never mutate it."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(**{**TINY_LLAMA, "num_hidden_layers": 1}, tie_word_embeddings=tie)
    return getattr(transformers, cls)(cfg).eval()


def _meta(model):
    with torch.device("meta"):
        return type(model)(model.config).eval()


def _sd(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


def _bin_index(sd: dict[str, torch.Tensor], d: Path) -> None:
    """`sd` as two `.bin` shards and their `pytorch_model.bin.index.json`."""
    names = sorted(sd)
    files = {"pytorch_model-00001-of-00002.bin": names[::2], "pytorch_model-00002-of-00002.bin": names[1::2]}
    for f, keys in files.items():
        torch.save({k: sd[k] for k in keys}, d / f)
    weight_map = {k: f for f, keys in files.items() for k in keys}
    (d / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _as_from_pretrained(model, d: Path, **kw) -> None:
    """load_params of `model`'s meta twin from `d` holds exactly what `from_pretrained(d)` holds."""
    ref = type(model).from_pretrained(d).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointKeysWarning)
        params, state = jaxtorch.load_params(_meta(model), d, **kw)
    got = {**params, **state}
    for name, value in ref.state_dict().items():
        if name in got:
            equal(np.asarray(got[name]), value.numpy())
    assert set(params) <= set(ref.state_dict()), sorted(set(params) - set(ref.state_dict()))


def _folder(model) -> Path:
    d = _tmp()
    model.save_pretrained(d)
    return d


# ---- which file of a folder: from_pretrained's order --------------------------------------------
@case("loading/dir/safetensors_over_a_single_bin")
def _st_over_bin():
    d = _folder(_llama(0))
    torch.save(_sd(_llama(1)), d / "pytorch_model.bin")
    _as_from_pretrained(_llama(0), d)


@case("loading/dir/safetensors_index_over_a_single_bin")
def _st_index_over_bin():
    d = _tmp()
    _llama(0).save_pretrained(d, max_shard_size="20KB")
    assert (d / "model.safetensors.index.json").exists()
    torch.save(_sd(_llama(1)), d / "pytorch_model.bin")
    _as_from_pretrained(_llama(0), d)


@case("loading/dir/single_bin_over_a_bin_index")
def _bin_over_bin_index():
    d = _tmp()
    _llama(0).config.save_pretrained(d)
    torch.save(_sd(_llama(0)), d / "pytorch_model.bin")
    _bin_index(_sd(_llama(1)), d)
    _as_from_pretrained(_llama(0), d)


@case("loading/dir/bin_index_alone")
def _bin_index_alone():
    d = _tmp()
    _llama(1).config.save_pretrained(d)
    _bin_index(_sd(_llama(1)), d)
    _as_from_pretrained(_llama(1), d)


@case("loading/dir/stale_safetensors_index_beside_the_single_file")
def _stale_index():
    d = _folder(_llama(0))
    stale = {"metadata": {}, "weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(stale))
    _as_from_pretrained(_llama(0), d)


@case("loading/dir/config_transformers_weights_names_the_file")
def _explicit_file():
    d = _folder(_llama(0))
    save_file(_sd(_llama(1)), d / "other.safetensors")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "transformers_weights": "other.safetensors"}))
    _as_from_pretrained(_llama(1), d)


@case("loading/dir/config_transformers_weights_outside_refused")
def _explicit_outside():
    d = _folder(_llama(0))
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "transformers_weights": "../x.safetensors"}))
    with pytest.raises(CheckpointError) as e:
        jaxtorch.load_params(_meta(_llama(0)), d)
    clear_error(e.value, "transformers_weights")


@case("loading/dir/empty_folder_names_the_files_it_looked_for")
def _empty_dir():
    with pytest.raises(CheckpointError) as e:
        jaxtorch.load_params(_meta(_llama(0)), _tmp())
    clear_error(e.value, "model.safetensors")


@case("loading/file/index_json_given_directly")
def _index_path():
    d = _tmp()
    _llama(0).save_pretrained(d, max_shard_size="20KB")
    (d / "model.safetensors.index.json").rename(d / "shards.safetensors.index.json")
    params, _ = jaxtorch.load_params(_meta(_llama(0)), d / "shards.safetensors.index.json")
    equal(np.asarray(params["model.norm.weight"]), _llama(0).model.norm.weight.detach().numpy())
    equal(np.asarray(params["lm_head.weight"]), _llama(0).lm_head.weight.detach().numpy())


# ---- names: prefixes, heads, strictness ---------------------------------------------------------
@case("loading/keys/backbone_from_a_full_untied_checkpoint")
def _backbone():
    d = _folder(_llama(0))
    base = _llama(0, cls="LlamaModel")
    with pytest.warns(CheckpointKeysWarning, match="lm_head.weight"):
        jaxtorch.load_params(_meta(base), d)
    _as_from_pretrained(base, d)


@case("loading/keys/full_model_from_a_tied_backbone_checkpoint")
def _full_from_tied_backbone():
    d = _folder(_llama(2, tie=True).model)
    full = _llama(2, tie=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointKeysWarning)  # tied: nothing missing, nothing to report
        params, _ = jaxtorch.load_params(_meta(full), d)
    equal(np.asarray(params["model.embed_tokens.weight"]), full.model.embed_tokens.weight.detach().numpy())
    _as_from_pretrained(full, d)


@case("loading/keys/strict_hf_model_names_the_unused_head")
def _strict_hf():
    d = _folder(_llama(0))
    with pytest.raises(CheckpointError) as e:
        jaxtorch.load_params(_meta(_llama(0, cls="LlamaModel")), d, strict=True)
    clear_error(e.value, "lm_head.weight")


@case("loading/keys/missing_head_on_meta_says_why_and_the_way_out")
def _missing_on_meta():
    d = _folder(_llama(0).model)
    with pytest.raises(CheckpointError) as e:
        jaxtorch.load_params(_meta(_llama(0)), d)
    clear_error(e.value, "meta device")
    assert "lm_head.weight" in str(e.value)


@case("loading/keys/plain_module_strict_false_like_load_state_dict")
def _plain_lenient():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2))
    sd = {"0.weight": torch.ones(2, 3), "2.weight": torch.ones(1)}
    d = _tmp()
    save_file(sd, d / "m.safetensors")
    ref = copy.deepcopy(m)
    result = ref.load_state_dict(sd, strict=False)
    with pytest.warns(CheckpointKeysWarning) as seen:
        params, _ = jaxtorch.load_params(m, d / "m.safetensors", strict=False)
    (w,) = [x.message for x in seen if isinstance(x.message, CheckpointKeysWarning)]
    assert sorted(w.missing) == sorted(result.missing_keys) and w.unexpected == result.unexpected_keys
    for k, v in ref.state_dict().items():
        equal(np.asarray(params[k]), v.numpy())


@case("loading/keys/plain_module_strict_by_default_like_load_state_dict")
def _plain_strict():
    m = nn.Linear(3, 2)
    d = _tmp()
    save_file({"weight": torch.ones(2, 3)}, d / "m.safetensors")
    with pytest.raises(RuntimeError):
        nn.Linear(3, 2).load_state_dict({"weight": torch.ones(2, 3)})
    with pytest.raises(CheckpointError) as e:
        jaxtorch.load_params(m, d / "m.safetensors")
    clear_error(e.value, "bias")


@case("loading/keys/shape_mismatch_raises_even_when_lenient")
def _mismatch_lenient():
    d = _tmp()
    save_file({**_sd(_llama(0)), "model.norm.weight": torch.ones(3)}, d / "model.safetensors")
    _llama(0).config.save_pretrained(d)
    with pytest.raises(CheckpointError) as e:
        jaxtorch.load_params(_meta(_llama(0)), d, strict=False)
    clear_error(e.value, "model.norm.weight")


@case("loading/keys/ddp_module_prefix_refused_naming_the_keys")
def _ddp_prefix():
    """A DDP checkpoint (`module.` on every key) into a plain module: torch's load_state_dict refuses."""
    m = nn.Linear(3, 2)
    d = _tmp()
    save_file({f"module.{k}": v for k, v in _sd(m).items()}, d / "m.safetensors")
    with pytest.raises(CheckpointError) as e:
        jaxtorch.load_params(m, d / "m.safetensors")
    clear_error(e.value, "module.weight")


# ---- tied weights, dtypes, buffers ------------------------------------------------------------------
@case("loading/tied/both_names_with_equal_values_load")
def _tied_equal():
    m = _llama(2, tie=True)
    d = _tmp()
    save_file({**_sd(m), "lm_head.weight": m.model.embed_tokens.weight.detach().clone()}, d / "model.safetensors")
    m.config.save_pretrained(d)
    _as_from_pretrained(m, d)


@case("loading/tied/both_names_with_different_values_refused")
def _tied_differ():
    m = _llama(2, tie=True)
    d = _tmp()
    save_file({**_sd(m), "lm_head.weight": torch.zeros_like(m.lm_head.weight)}, d / "model.safetensors")
    with pytest.raises(CheckpointError) as e:
        jaxtorch.load_params(_meta(m), d / "model.safetensors")
    clear_error(e.value, "tied")


@case("loading/dtype/float16_file_into_bfloat16_model_like_load_state_dict")
def _f16_into_bf16():
    m = nn.Linear(3, 2).to(torch.bfloat16)
    sd = {"weight": torch.randn(2, 3).half(), "bias": torch.randn(2).half()}
    d = _tmp()
    save_file(sd, d / "m.safetensors")
    ref = copy.deepcopy(m)
    ref.load_state_dict(sd)
    params, _ = jaxtorch.load_params(m, d / "m.safetensors")
    for k, v in ref.state_dict().items():
        assert params[k].dtype == jnp.bfloat16
        equal(np.asarray(params[k]).astype(np.float32), v.float().numpy())


@case("loading/dtype/float64_model_without_x64_refused_or_exact")
def _f64_model():
    m = nn.Linear(3, 2).double()
    d = _tmp()
    save_file(_sd(m), d / "m.safetensors")

    def check():
        params, _ = jaxtorch.load_params(m, d / "m.safetensors")
        equal(np.asarray(params["weight"]), m.weight.detach().numpy())

    refuses_or(check, "float64", "x64")


class _Buffers(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.register_buffer("kept", torch.zeros(2))
        self.register_buffer("scratch", torch.full((2,), 7.0), persistent=False)


@case("loading/buffers/persistent_from_the_file_non_persistent_from_the_module")
def _buffers():
    m = _Buffers()
    sd = {**_sd(m), "kept": torch.tensor([1.0, 2.0])}
    assert "scratch" not in sd
    d = _tmp()
    save_file(sd, d / "m.safetensors")
    _, state = jaxtorch.load_params(m, d / "m.safetensors")
    equal(np.asarray(state["kept"]), np.array([1.0, 2.0], np.float32))
    equal(np.asarray(state["scratch"]), np.full(2, 7.0, np.float32))


# ---- saving: round trips --------------------------------------------------------------------------
@case("loading/save/torch_save_of_a_jax_state_dict_round_trips")
def _torch_save_jax():
    m = copy.deepcopy(_llama(0)).to("jax")
    buf = io.BytesIO()
    torch.save(m.state_dict(), buf)
    buf.seek(0)
    back = torch.load(buf, map_location="cpu", weights_only=True)
    for k, v in _llama(0).state_dict().items():
        equal(back[k], v)


@case("loading/save/safetensors_of_a_jax_model_round_trips")
def _safetensors_jax():
    m = copy.deepcopy(_llama(2, tie=True)).to("jax")
    d = _tmp()
    refuses_or(lambda: save_file(_sd(m), d / "m.safetensors"), "shared", "contiguous")  # tied: safetensors refuses
    sd = {k: v for k, v in _sd(m).items() if k != "lm_head.weight"}
    save_file(sd, d / "m.safetensors")
    back = load_file(d / "m.safetensors")
    for k, v in back.items():
        equal(v, _llama(2, tie=True).state_dict()[k])


@case("loading/save/save_pretrained_of_a_jax_model_loads_back")
def _save_pretrained_jax():
    m = copy.deepcopy(_llama(0)).to("jax")
    d = _tmp()
    m.save_pretrained(d)
    _as_from_pretrained(_llama(0), d)


@case("loading/save/interrupted_checkpoint_save_keeps_the_previous_one")
def _interrupted():
    d = _tmp()
    jaxtorch.save_checkpoint({"w": jnp.arange(3.0)}, d / "c.safetensors")
    import safetensors.numpy

    real = safetensors.numpy.save_file

    def crash(tensors, path, metadata=None):
        Path(path).write_bytes(b"partial")
        raise KeyboardInterrupt

    safetensors.numpy.save_file = crash
    try:
        with pytest.raises(KeyboardInterrupt):
            jaxtorch.save_checkpoint({"w": jnp.zeros(3)}, d / "c.safetensors")
    finally:
        safetensors.numpy.save_file = real
    equal(np.asarray(jaxtorch.load_checkpoint(d / "c.safetensors")["w"]), np.arange(3.0, dtype=np.float32))
    assert [p.name for p in d.iterdir()] == ["c.safetensors"]  # no temporary file left behind


@case("loading/save/load_params_then_load_into_meta_then_save_pretrained")
def _params_into_meta_save():
    src = _folder(_llama(0))
    meta = _meta(_llama(0))
    jaxtorch.load_into(meta, *jaxtorch.load_params(meta, src))
    d = _tmp()
    meta.save_pretrained(d)
    _as_from_pretrained(_llama(0), d)


@case("loading/save/bin_saved_from_a_jax_model_loads_with_load_params")
def _bin_from_jax():
    d = _tmp()
    torch.save(copy.deepcopy(_llama(0)).to("jax").state_dict(), d / "pytorch_model.bin")
    _llama(0).config.save_pretrained(d)
    _as_from_pretrained(_llama(0), d)


@case("loading/dtype/bfloat16_model_as_from_pretrained_with_dtype")
def _bf16_model():
    import transformers

    d = _folder(_llama(0))
    ref = transformers.LlamaForCausalLM.from_pretrained(d, dtype=torch.bfloat16)
    with torch.device("meta"):
        meta = transformers.LlamaForCausalLM(_llama(0).config).to(torch.bfloat16)
    params, _ = jaxtorch.load_params(meta, d)
    for name, value in ref.state_dict().items():
        if name in params:
            assert params[name].dtype == jnp.bfloat16, name
            equal(np.asarray(params[name]).astype(np.float32), value.float().numpy())


@case("loading/save/torch_load_map_location_jax_then_load_params_folder_agree")
def _map_location_jax():
    d = _tmp()
    torch.save(_sd(_llama(0)), d / "pytorch_model.bin")
    on_jax = torch.load(d / "pytorch_model.bin", map_location="jax", weights_only=True)
    _llama(0).config.save_pretrained(d)
    params, _ = jaxtorch.load_params(_meta(_llama(0)), d)
    for name, value in params.items():
        equal(np.asarray(value), on_jax[name].cpu().numpy())


# ---- load_into ------------------------------------------------------------------------------------
@case("loading/into/meta_model_forward_matches_the_reference")
def _into_meta_forward():
    ref = _llama(0)
    meta = _meta(ref)
    params, fn = jaxtorch.extract(ref)
    jaxtorch.load_into(meta, params, fn.state)
    ids = torch.tensor([[1, 5, 9, 3]])
    with torch.no_grad():
        equal(meta(ids).logits, ref(ids).logits)


@case("loading/into/meta_model_tied_weights_stay_one_parameter")
def _into_meta_tied():
    ref = _llama(2, tie=True)
    meta = _meta(ref)
    params, fn = jaxtorch.extract(ref)
    jaxtorch.load_into(meta, params, fn.state)
    assert meta.lm_head.weight is meta.model.embed_tokens.weight
    assert isinstance(meta.lm_head.weight, nn.Parameter) and meta.lm_head.weight.requires_grad


@case("loading/into/bfloat16_values_into_a_float32_module_like_copy")
def _into_cast():
    m = nn.Linear(3, 2)
    w = jnp.asarray(np.random.default_rng(0).standard_normal((2, 3)), jnp.bfloat16)
    jaxtorch.load_into(m, {"weight": w, "bias": jnp.zeros(2, jnp.bfloat16)})
    ref = nn.Linear(3, 2)
    with torch.no_grad():
        ref.weight.copy_(torch.from_numpy(np.array(w.astype(jnp.float32))).to(torch.bfloat16))
    equal(m.weight, ref.weight)


# ---- greedy_decoder against generate --------------------------------------------------------------
@functools.cache
def _decoder_model(arch: str):
    import transformers

    sizes = {**TINY_LLAMA, "num_hidden_layers": 1}
    configs = {
        "llama": lambda: transformers.LlamaConfig(**sizes),
        "qwen2": lambda: transformers.Qwen2Config(**sizes),
        "mistral": lambda: transformers.MistralConfig(sliding_window=3, **sizes),
        "gemma": lambda: transformers.GemmaConfig(head_dim=8, **sizes),
        "phi3": lambda: transformers.Phi3Config(pad_token_id=0, **sizes),
        "gpt2": lambda: transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=64, n_positions=64),
    }
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(configs[arch]()).eval()


_PROMPTS = torch.randint(3, 64, (2, 5), generator=torch.Generator().manual_seed(4))


def _same_as_generate(model, ids: torch.Tensor, steps: int, **kw) -> None:
    expected = model.generate(ids, max_new_tokens=steps, do_sample=False, **kw)[:, ids.shape[1] :]
    decode = jaxtorch.generation.greedy_decoder(model, max_cache_len=ids.shape[1] + steps, **kw)
    equal(np.asarray(decode(ids, steps)), expected.numpy().astype(np.asarray(decode(ids, steps)).dtype))


for _arch in ("llama", "qwen2", "mistral", "gemma", "phi3", "gpt2"):

    @case(f"loading/generate/{_arch}_greedy_tokens_as_generate")
    def _arch_case(arch=_arch):
        _same_as_generate(_decoder_model(arch), _PROMPTS, 8, eos_token_id=None)


@case("loading/generate/one_new_token")
def _one_token():
    _same_as_generate(_decoder_model("llama"), _PROMPTS, 1, eos_token_id=None)


@case("loading/generate/zero_new_tokens_refused_like_generate")
def _zero_tokens():
    model = _decoder_model("llama")
    with pytest.raises(ValueError):
        model.generate(_PROMPTS, max_new_tokens=0, do_sample=False)
    decode = jaxtorch.generation.greedy_decoder(model, max_cache_len=8)
    with pytest.raises(ValueError) as e:
        decode(_PROMPTS, 0)
    clear_error(e.value, "max_new_tokens")


@case("loading/generate/one_token_prompt")
def _one_token_prompt():
    _same_as_generate(_decoder_model("qwen2"), _PROMPTS[:, :1], 6, eos_token_id=None)


@case("loading/generate/eos_as_the_first_token_stops_at_once")
def _eos_first():
    model = _decoder_model("llama")
    first = model.generate(_PROMPTS[:1], max_new_tokens=1, do_sample=False, eos_token_id=None)[0, -1].item()
    decode = jaxtorch.generation.greedy_decoder(model, max_cache_len=16, eos_token_id=first)
    assert np.asarray(decode(_PROMPTS[:1], 8)).tolist() == [[first]]
    _same_as_generate(model, _PROMPTS[:1], 8, eos_token_id=first)


@case("loading/generate/batch_rows_decode_as_alone")
def _rows_alone():
    model = _decoder_model("mistral")
    decode = jaxtorch.generation.greedy_decoder(model, max_cache_len=16, eos_token_id=None)
    both = np.asarray(decode(_PROMPTS, 8))
    for row in range(2):
        equal(np.asarray(decode(_PROMPTS[row : row + 1], 8))[0], both[row])


@case("loading/generate/jax_int32_prompt_as_torch_int64")
def _int32_prompt():
    model = _decoder_model("llama")
    decode = jaxtorch.generation.greedy_decoder(model, max_cache_len=16, eos_token_id=None)
    a = np.asarray(decode(_PROMPTS, 6))
    b = np.asarray(decode(jnp.asarray(_PROMPTS.numpy(), jnp.int32), 6))
    equal(b.astype(a.dtype), a)


@case("loading/generate/prompt_filling_the_cache_exactly")
def _fills_cache():
    model = _decoder_model("gemma")
    decode = jaxtorch.generation.greedy_decoder(model, max_cache_len=9, eos_token_id=None)
    assert np.asarray(decode(_PROMPTS, 4)).shape == (2, 4)
    with pytest.raises(ValueError) as e:
        decode(_PROMPTS, 5)
    clear_error(e.value, "max_cache_len")


@case("loading/generate/padded_batch_with_attention_mask_refused")
def _padded():
    """generate takes left padding with an attention mask; the decoder takes none and says so."""
    model = _decoder_model("llama")
    pad = int(_PROMPTS.max()) + 1
    ids = _PROMPTS.clone()
    ids[0, 0] = pad
    decode = jaxtorch.generation.greedy_decoder(model, max_cache_len=16, pad_token_id=pad, eos_token_id=None)
    with pytest.raises(ValueError) as e:
        decode(ids, 4)
    clear_error(e.value, "pad token")


@case("loading/generate/empty_prompt_refused_clearly")
def _empty_prompt():
    decode = jaxtorch.generation.greedy_decoder(_decoder_model("llama"), max_cache_len=8)
    with pytest.raises(ValueError) as e:
        decode(torch.zeros(2, 0, dtype=torch.long), 3)
    clear_error(e.value, "bos_token_id")
