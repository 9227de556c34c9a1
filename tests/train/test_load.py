"""`jaxtorch.load_params` and meta-device models (issue 24, items 1-3 and 5).

Each model here is a tiny Llama with random weights, saved locally; numerics are compared
with eager CPU torch on the same weights.
"""

import json
import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.torch
import torch

import jaxtorch
from jaxtorch.train import CheckpointKeysError, load_params
from jaxtorch.train._load import CheckpointKeysWarning
from tests._hf_models import tiny_llama

from ._procs import ROOT, cpu_env, free_port, spawn, wait_all

transformers = pytest.importorskip("transformers")

CONFIG = dict(vocab_size=128, tie_word_embeddings=True)  # over tests/_hf_models.py's tiny Llama


def llama(config: dict, cls=None):
    return tiny_llama(cls, **config).eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A CPU Llama with random weights and its `save_pretrained` directory."""
    torch.manual_seed(0)
    ref = llama(CONFIG)
    path = tmp_path_factory.mktemp("llama")
    ref.save_pretrained(path)
    return ref, path


@pytest.fixture(scope="module")
def meta_model():
    with torch.device("meta"):
        return llama(CONFIG)


IDS = np.arange(12, dtype=np.int32)[None] % 128


def _logits(ref):
    with torch.no_grad():
        return ref(torch.as_tensor(IDS, dtype=torch.long)).logits.numpy()


# ---- item 1: meta-device models ------------------------------------------------------------
def test_extract_of_meta_model_gives_shapes_and_eval_shape(meta_model):
    params, fn = jaxtorch.extract(meta_model)
    w = params["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(w, jax.ShapeDtypeStruct) and w.shape == (32, 32) and w.dtype == jnp.float32
    out = jax.eval_shape(lambda p: fn(p, IDS).logits, params)
    assert out.shape == (1, 12, 128)
    jax.jit(lambda p: fn(p, IDS).logits).lower(params)  # lowers without any weight data


def test_meta_non_persistent_buffers_computed_from_module_code(meta_model, saved):
    ref, _ = saved
    params, fn = jaxtorch.extract(meta_model)
    values = {**params, **fn.state}
    want = ref.model.rotary_emb.inv_freq.numpy()
    got = values["model.rotary_emb.inv_freq"]
    assert isinstance(got, jax.Array)
    np.testing.assert_array_equal(np.asarray(got), want)
    assert meta_model.model.rotary_emb.inv_freq.is_meta  # the module is left as found


def test_torch_module_to_jax_of_meta_model(meta_model):
    m = jaxtorch.torch_module_to_jax(meta_model)
    assert isinstance(m.params["model.norm.weight"], jax.ShapeDtypeStruct)


def test_meta_buffer_nobody_computes_raises():
    from jaxtorch.bridge.state._meta import MetaBufferError

    class Table(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(3))
            self.register_buffer("table", torch.arange(3.0) * 2, persistent=False)

        def forward(self, x):
            return x * self.w + self.table

    with torch.device("meta"):
        m = Table()
    with pytest.raises(MetaBufferError, match="table"):
        jaxtorch.extract(m)

    class Mask(torch.nn.Module):  # a boolean buffer (a causal mask): no NaN to detect it with
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(3))
            self.register_buffer("mask", torch.ones(3, 3).tril().bool(), persistent=False)

    with torch.device("meta"):
        m = Mask()
    with pytest.raises(MetaBufferError, match="mask"):
        jaxtorch.extract(m)


# ---- item 2: load_params ---------------------------------------------------------------------
def test_load_safetensors_dir_into_meta_model_matches_torch(saved, meta_model):
    ref, path = saved
    params, state = load_params(meta_model, path)
    _, fn = jaxtorch.extract(meta_model)
    assert "lm_head.weight" not in params  # tied: one entry, the first name
    logits = jax.jit(lambda p, s: fn(p, IDS, state=s).logits)(params, state)
    np.testing.assert_allclose(np.asarray(logits), _logits(ref), rtol=1e-5, atol=1e-5)


def test_load_sharded_index_and_bin_and_file(saved, meta_model, tmp_path):
    ref, path = saved
    ref.save_pretrained(tmp_path / "shards", max_shard_size="20KB")
    assert (tmp_path / "shards" / "model.safetensors.index.json").exists()
    torch.save(ref.state_dict(), tmp_path / "sd.pt")
    want = {k: v.numpy() for k, v in ref.state_dict().items()}
    for source in (tmp_path / "shards", tmp_path / "sd.pt", path / "model.safetensors"):
        params, state = load_params(meta_model, source)
        for name, value in {**params, **state}.items():
            if name in want:
                np.testing.assert_array_equal(np.asarray(value), want[name], err_msg=f"{source}: {name}")


def test_dtype_converted_per_array_like_torch(saved, meta_model):
    ref, path = saved
    params, _ = load_params(meta_model, path, dtype=jnp.bfloat16)
    w = params["model.layers.1.mlp.up_proj.weight"]
    assert w.dtype == jnp.bfloat16
    want = ref.model.layers[1].mlp.up_proj.weight.detach().to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(np.asarray(w.astype(jnp.float32)), want)


def test_bf16_checkpoint_into_float32_model(saved, meta_model, tmp_path):
    ref, _ = saved
    sd = {k: v.to(torch.bfloat16).contiguous() for k, v in ref.state_dict().items() if k != "lm_head.weight"}
    safetensors.torch.save_file(sd, tmp_path / "bf16.safetensors")
    params, _ = load_params(meta_model, tmp_path / "bf16.safetensors")  # the model's dtype, as load_state_dict
    w = params["model.embed_tokens.weight"]
    assert w.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(w), sd["model.embed_tokens.weight"].float().numpy())


def test_hf_prefix_renames_both_ways(saved, tmp_path):
    ref, path = saved
    with torch.device("meta"):
        base = llama(CONFIG, transformers.LlamaModel)
    params, _ = load_params(base, path)  # a LlamaForCausalLM checkpoint into LlamaModel: "model." stripped
    np.testing.assert_array_equal(np.asarray(params["norm.weight"]), ref.model.norm.weight.detach().numpy())
    ref.model.save_pretrained(tmp_path / "base")  # and a LlamaModel checkpoint into LlamaForCausalLM
    with torch.device("meta"):
        full = llama(CONFIG)
    params, _ = load_params(full, tmp_path / "base")
    np.testing.assert_array_equal(
        np.asarray(params["model.embed_tokens.weight"]), ref.model.embed_tokens.weight.detach().numpy()
    )


def _bin_shards(sd: dict, directory: Path) -> None:
    """`sd` as two `pytorch_model-*.bin` shards with their `pytorch_model.bin.index.json`."""
    names = sorted(sd)
    halves = {"pytorch_model-00001-of-00002.bin": names[::2], "pytorch_model-00002-of-00002.bin": names[1::2]}
    for f, keys in halves.items():
        torch.save({k: sd[k].clone() for k in keys}, directory / f)
    weight_map = {k: f for f, keys in halves.items() for k in keys}
    (directory / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _assert_as_from_pretrained(params: dict, hf_model) -> None:
    for name, value in hf_model.state_dict().items():
        if name in params:
            np.testing.assert_array_equal(np.asarray(params[name]), value.numpy(), err_msg=name)


def test_directory_read_as_from_pretrained_reads_it(saved, meta_model, tmp_path):
    """Issue 30 item 2: `model.safetensors` wins over `.bin` shards (other weights) and over a stale
    safetensors index whose shard is gone, as in transformers' `_get_resolved_checkpoint_files`."""
    ref, _ = saved
    ref.save_pretrained(tmp_path)
    torch.manual_seed(1)
    _bin_shards(llama(CONFIG).state_dict(), tmp_path)  # different weights
    stale = {"metadata": {}, "weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(stale))
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    params, _ = load_params(meta_model, tmp_path)
    _assert_as_from_pretrained(params, hf)
    (tmp_path / "model.safetensors").unlink()  # then the .bin shards, as from_pretrained: not the stale index
    (tmp_path / "model.safetensors.index.json").unlink()
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    params, _ = load_params(meta_model, tmp_path)
    _assert_as_from_pretrained(params, hf)
    first = np.asarray(params["model.embed_tokens.weight"])
    assert not np.array_equal(first, ref.model.embed_tokens.weight.detach().numpy())  # the .bin's weights


def _recorded(fn):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = fn()
    return out, [w.message for w in seen if isinstance(w.message, CheckpointKeysWarning)]


def test_backbone_from_full_checkpoint_reports_the_unused_head(tmp_path):
    """Issue 30 item 2: `LlamaModel.from_pretrained` of a `LlamaForCausalLM` folder skips `lm_head`
    and reports it; load_params does the same (a warning naming it), and `strict=True` raises."""
    torch.manual_seed(0)
    llama(dict(CONFIG, tie_word_embeddings=False)).save_pretrained(tmp_path)
    with torch.device("meta"):
        base = llama(dict(CONFIG, tie_word_embeddings=False), transformers.LlamaModel)
    (params, _), seen = _recorded(lambda: load_params(base, tmp_path))
    assert [w.unexpected for w in seen] == [["lm_head.weight"]] and "lm_head.weight" in str(seen[0])
    _assert_as_from_pretrained(params, transformers.LlamaModel.from_pretrained(tmp_path))
    with pytest.raises(CheckpointKeysError, match="lm_head.weight") as info:
        load_params(base, tmp_path, strict=True)
    assert info.value.unexpected == ["lm_head.weight"]


def test_full_model_from_backbone_checkpoint_keeps_or_refuses_the_missing_head(tmp_path):
    """The reverse: the head is missing. A model with values keeps its own (reported), a meta model
    has none and raises naming it and the way out; `strict=True` raises."""
    cfg = dict(CONFIG, tie_word_embeddings=False)
    torch.manual_seed(0)
    llama(cfg).model.save_pretrained(tmp_path)
    full = llama(cfg)
    (params, _), seen = _recorded(lambda: load_params(full, tmp_path))
    assert [w.missing for w in seen] == [["lm_head.weight"]]
    np.testing.assert_array_equal(np.asarray(params["lm_head.weight"]), full.lm_head.weight.detach().numpy())
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    _assert_as_from_pretrained({k: v for k, v in params.items() if k != "lm_head.weight"}, loaded)
    with pytest.raises(CheckpointKeysError, match="lm_head.weight") as info:
        load_params(full, tmp_path, strict=True)
    assert info.value.missing == ["lm_head.weight"]
    with torch.device("meta"):
        meta = llama(cfg)
    with pytest.raises(CheckpointKeysError, match="meta device"):
        load_params(meta, tmp_path)


def test_plain_module_is_strict_like_load_state_dict_unless_told(tmp_path):
    m = torch.nn.Linear(3, 2)
    safetensors.torch.save_file({"weight": m.weight.detach(), "extra": torch.ones(1)}, tmp_path / "m.safetensors")
    with pytest.raises(CheckpointKeysError, match="bias") as info:
        load_params(m, tmp_path / "m.safetensors")
    assert info.value.unexpected == ["extra"] and info.value.missing == ["bias"]
    (params, _), seen = _recorded(lambda: load_params(m, tmp_path / "m.safetensors", strict=False))
    assert [(w.missing, w.unexpected) for w in seen] == [(["bias"], ["extra"])]
    np.testing.assert_array_equal(np.asarray(params["bias"]), m.bias.detach().numpy())


def test_legacy_layernorm_gamma_beta_renamed(tmp_path):
    cfg = transformers.BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    )
    torch.manual_seed(0)
    ref = transformers.BertModel(cfg).eval()
    sd = {
        k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
        for k, v in ref.state_dict().items()
    }
    safetensors.torch.save_file(sd, tmp_path / "old.safetensors")
    with torch.device("meta"):
        m = transformers.BertModel(cfg).eval()
    params, state = load_params(m, tmp_path / "old.safetensors")
    np.testing.assert_array_equal(
        np.asarray(params["embeddings.LayerNorm.weight"]), ref.embeddings.LayerNorm.weight.detach().numpy()
    )


def test_missing_unexpected_and_shapes_in_one_error(saved, meta_model, tmp_path):
    ref, _ = saved
    sd = {k: v.clone() for k, v in ref.state_dict().items() if k != "lm_head.weight"}
    del sd["model.norm.weight"], sd["model.layers.0.mlp.up_proj.weight"]
    sd["model.layers.0.extra.weight"] = torch.zeros(2)
    sd["model.layers.1.mlp.down_proj.weight"] = torch.zeros(3, 3)
    safetensors.torch.save_file(sd, tmp_path / "bad.safetensors")
    with pytest.raises(CheckpointKeysError) as info:
        load_params(meta_model, tmp_path / "bad.safetensors", strict=True)
    e = info.value
    assert e.missing == ["model.layers.0.mlp.up_proj.weight", "model.norm.weight"]
    assert e.unexpected == ["model.layers.0.extra.weight"]
    assert list(e.mismatched) == ["model.layers.1.mlp.down_proj.weight"]
    assert "model.norm.weight" in str(e) and "extra" in str(e) and "(3, 3)" in str(e)


def test_torch_file_is_never_unpickled_beyond_weights(tmp_path, meta_model):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    with open(tmp_path / "evil.pt", "wb") as f:
        pickle.dump({"model.norm.weight": Evil()}, f)
    with pytest.raises(Exception):
        load_params(meta_model, tmp_path / "evil.pt")
    assert not marker.exists()


def test_not_a_checkpoint_raises(tmp_path, meta_model):
    (tmp_path / "x.safetensors").write_bytes(b"\x03")
    with pytest.raises(jaxtorch.train.CheckpointError, match="not a safetensors"):
        load_params(meta_model, tmp_path / "x.safetensors")
    with pytest.raises(jaxtorch.train.CheckpointError, match="Hugging Face model directory"):
        load_params(meta_model, tmp_path)


def test_read_slice_reads_exactly_the_box(tmp_path):
    from jaxtorch.train._load import checkpoint_entries, read_slice

    x = np.arange(2 * 6 * 8, dtype=np.float32).reshape(2, 6, 8)
    safetensors.torch.save_file({"x": torch.from_numpy(x)}, tmp_path / "x.safetensors")
    entry = checkpoint_entries(tmp_path / "x.safetensors")["x"]
    for index in [
        (slice(None), slice(2, 5), slice(4, 8)),
        (slice(1, 2),),
        (slice(None), slice(None), slice(0, 1)),
        (slice(0, 0),),
    ]:
        got = read_slice(entry, index)
        np.testing.assert_array_equal(got, x[index])


# ---- items 2-3 on several devices (subprocesses) ----------------------------------------------
def _ok_line(out: str) -> list[str]:
    return next(line for line in out.splitlines() if line.startswith("OK")).split()


def test_tensor_parallel_on_8_devices_reads_each_slice_once(saved):
    _, path = saved
    cmd = [sys.executable, "-m", "tests.train._load_worker", "tp", str(path / "model.safetensors")]
    p = subprocess.run(cmd, cwd=ROOT, env=cpu_env(8), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    _, _, read, expected = _ok_line(p.stdout)
    assert int(read) == int(expected)


def test_sharding_rule_that_does_not_divide_names_the_parameter(tmp_path):
    """Issue 30 item 16: before, JAX's IndivisibleError named no parameter and no rule."""
    cmd = [sys.executable, "-m", "tests.train._load_worker", "indivisible", str(tmp_path)]
    p = subprocess.run(cmd, cwd=ROOT, env=cpu_env(8), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    line = next(line for line in p.stdout.splitlines() if line.startswith("OK"))
    for words in ("ValueError", "weight (shape (12, 6))", "'model': 8", "'weight$'"):
        assert words in line, line


def test_two_processes_each_read_their_half(saved):
    _, path = saved
    port = free_port()
    args = ["tests.train._load_worker", "multi", str(path / "model.safetensors")]
    for out in wait_all([spawn(args + [str(i), str(port)], 4) for i in range(2)]):
        _, _, read, expected = _ok_line(out)
        assert int(read) == int(expected) > 0


def test_read_slice_short_runs_in_blocks(tmp_path, monkeypatch):
    from jaxtorch.train import _load

    x = np.arange(3 * 40 * 24, dtype=np.float32).reshape(3, 40, 24)
    safetensors.torch.save_file({"x": torch.from_numpy(x)}, tmp_path / "x.safetensors")
    entry = _load.checkpoint_entries(tmp_path / "x.safetensors")["x"]
    monkeypatch.setattr(_load, "_BLOCK", 200)  # several blocks per slice, runs of 12..40 bytes
    for index in [
        (slice(None), slice(None), slice(3, 6)),
        (slice(1, 3), slice(5, 30), slice(0, 10)),
        (slice(None), slice(7, 8)),
    ]:
        np.testing.assert_array_equal(_load.read_slice(entry, index), x[index])


# ---- item 5: extract of memory-mapped weights -------------------------------------------------
def _resident_of(path: Path) -> int:
    """Bytes of `path`'s memory maps resident in this process (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if "-" in line.split()[0] and len(line.split()) >= 5:
                inside = line.rstrip().endswith(str(path))
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux's /proc")
def test_extract_of_mmapped_from_pretrained_keeps_no_second_copy(tmp_path):
    cfg = dict(CONFIG, hidden_size=256, intermediate_size=512, vocab_size=2048)  # most tensors >= 64 KiB
    torch.manual_seed(0)
    llama(cfg).save_pretrained(tmp_path)
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    file = tmp_path / "model.safetensors"
    before = {k: v.detach().clone().numpy() for k, v in model.state_dict().items()}
    for p in model.parameters():  # every weight page resident, as after a forward
        p.detach().sum()
    mapped = _resident_of(file)
    assert mapped > 0.9 * file.stat().st_size  # the weights live in the file's memory map
    params, fn = jaxtorch.extract(model)
    assert _resident_of(file) < 0.1 * file.stat().st_size  # paged out: JAX's copy is the only one
    for name in params.keys() & before.keys():
        np.testing.assert_array_equal(np.asarray(params[name]), before[name])
    ids = torch.as_tensor(IDS, dtype=torch.long)
    with torch.no_grad():
        want = model(ids).logits.numpy()  # torch still reads its weights (reread from the file)
        model.model.norm.weight.add_(1.0)  # a torch write after extract does not reach params
    np.testing.assert_array_equal(np.asarray(params["model.norm.weight"]), before["model.norm.weight"])
    got = fn(params, IDS, state=fn.state).logits
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_make_train_step_of_meta_model_with_loaded_weights(saved, meta_model):

    import optax

    from jaxtorch.train import make_train_step

    ref, path = saved
    init, step = make_train_step(
        meta_model, lambda out, y: optax.softmax_cross_entropy_with_integer_labels(out.logits, y).mean(), optax.sgd(0.1)
    )
    params, state = load_params(meta_model, path)
    ts = init(params, state)
    ids = jnp.asarray(IDS)
    ts, loss = step(ts, ids, ids)
    with torch.no_grad():
        logits = ref(torch.as_tensor(IDS, dtype=torch.long)).logits
        want = torch.nn.functional.cross_entropy(logits[0], torch.as_tensor(IDS[0], dtype=torch.long))
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)


def test_meta_tensor_conversion_says_where_the_weights_come_from(meta_model):
    with pytest.raises(ValueError, match="load_params"):
        jaxtorch.to_jax(meta_model.model.norm.weight)


def test_shardings_as_one_sharding_a_dict_or_a_function(saved, meta_model):
    from jax.sharding import SingleDeviceSharding

    _, path = saved
    device = jax.local_devices()[-1]
    one = SingleDeviceSharding(device)
    params, _ = load_params(meta_model, path, shardings=one)
    assert all(a.sharding == one for a in params.values())
    params, _ = load_params(meta_model, path, shardings={"model.norm.weight": one})
    assert params["model.norm.weight"].sharding == one
    seen = []

    def choose(name, struct):
        seen.append((name, struct.shape))
        return one if name.endswith("up_proj.weight") else None

    params, _ = load_params(meta_model, path, shardings=choose)
    assert params["model.layers.0.mlp.up_proj.weight"].sharding == one
    assert ("model.layers.0.mlp.up_proj.weight", (64, 32)) in seen
