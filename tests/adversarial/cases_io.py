"""Weights in and out under hostile inputs (issues 23-24): `load_params`, meta-device modules,
memory-mapped weights, `torch.save`/`safetensors` of jax tensors, jax generators, autocast.

Each case matches eager CPU torch (`load_state_dict`, CPU autocast, CPU generators) or raises
a clear error naming the problem; corrupted files never give values.
"""

from __future__ import annotations

import copy
import io
import json
import pickle
import struct
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import jaxtorch
from jaxtorch.train import CheckpointError

from .harness import case, clear_error, close, equal, refuses_or, scratch_dir


def _tmp() -> Path:
    return scratch_dir("jt-io-")


def _small() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2)).eval()


def _sd(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def _torch_loaded(m: nn.Module, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What CPU torch's `load_state_dict` leaves in a copy of `m` (the reference for load_params)."""
    ref = copy.deepcopy(m)
    ref.load_state_dict(sd)
    return _sd(ref)


def _loaded(m: nn.Module, path, **kw) -> dict[str, np.ndarray]:
    params, state = jaxtorch.load_params(m, path, **kw)
    return {k: np.asarray(v) for k, v in {**params, **state}.items()}


def _same_as_torch(m: nn.Module, path, sd: dict[str, torch.Tensor]) -> None:
    got, expected = _loaded(m, path), _torch_loaded(m, sd)
    assert set(got) == set(expected), (set(got), set(expected))
    for k, v in expected.items():
        assert got[k].dtype == np.dtype(jaxtorch.bridge.core._dtypes.to_jax_dtype(v.dtype)), (k, got[k].dtype)
        np.testing.assert_array_equal(got[k], v.numpy(), err_msg=k)


def _raises_checkpoint_error(check, *words: str) -> None:
    with pytest.raises(CheckpointError) as e:
        check()
    clear_error(e.value, *words)


# ---- load_params: files that disagree with the model ------------------------------------------
@case("io/load/int_file_into_float_model_casts_like_load_state_dict")
def _int_into_float():
    m, d = _small(), _tmp()
    sd = {**_sd(m), "0.weight": torch.arange(6, dtype=torch.int32).reshape(2, 3)}
    save_file(sd, d / "m.safetensors")
    _same_as_torch(m, d / "m.safetensors", sd)


@case("io/load/bf16_file_into_fp32_model")
def _bf16_into_fp32():
    m, d = _small(), _tmp()
    sd = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in _sd(m).items()}
    save_file(sd, d / "m.safetensors")
    _same_as_torch(m, d / "m.safetensors", sd)


@case("io/load/dtype_bf16_converts_floats_only")
def _dtype_bf16():
    m, d = _small(), _tmp()
    sd = _sd(m)
    save_file(sd, d / "m.safetensors")
    got = _loaded(m, d / "m.safetensors", dtype=jnp.bfloat16)
    assert got["1.num_batches_tracked"].dtype == np.dtype(jnp.int32) or got["1.num_batches_tracked"].dtype == np.int64
    for k, v in sd.items():
        if v.is_floating_point():
            assert got[k].dtype == jnp.bfloat16, (k, got[k].dtype)
            np.testing.assert_array_equal(got[k].astype(np.float32), v.to(torch.bfloat16).float().numpy())


@case("io/load/dtype_given_as_torch_dtype")
def _dtype_torch():
    """Before: TypeError 'Cannot interpret torch.bfloat16 as a data type'."""
    m, d = _small(), _tmp()
    save_file(_sd(m), d / "m.safetensors")
    got = _loaded(m, d / "m.safetensors", dtype=torch.bfloat16)
    assert got["0.weight"].dtype == jnp.bfloat16 and got["1.num_batches_tracked"].dtype.kind == "i"


@case("io/load/integer_dtype_refused_like_module_to")
def _dtype_int():
    """`nn.Module.to(torch.int8)` raises; before, load_params turned every weight into int8 zeros."""
    m, d = _small(), _tmp()
    save_file(_sd(m), d / "m.safetensors")
    with pytest.raises(TypeError) as e:
        jaxtorch.load_params(m, d / "m.safetensors", dtype=jnp.int8)
    clear_error(e.value, "floating")


@case("io/load/int64_beyond_int32_never_wraps")
def _int64_wide():
    """torch holds 2**40 in an int64 buffer; without x64 JAX cannot: before, it became 0, silently."""
    m, d = _small(), _tmp()
    sd = {**_sd(m), "1.num_batches_tracked": torch.tensor(2**40)}
    save_file(sd, d / "m.safetensors")
    torch.save(sd, d / "m.pt")
    for path in (d / "m.safetensors", d / "m.pt"):
        refuses_or(lambda path=path: _same_as_torch(m, path, sd), "32 bits", "int64")


@case("io/load/hf_old_checkpoint_keys_ignored_like_from_pretrained")
def _hf_ignored():
    """Old Llama checkpoints hold per-layer `rotary_emb.inv_freq`: from_pretrained ignores them."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2)
    torch.manual_seed(0)
    ref = LlamaForCausalLM(cfg).eval()
    d = _tmp()
    sd = {**_sd(ref), "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(2)}
    save_file(sd, d / "model.safetensors")
    with torch.device("meta"):
        meta = LlamaForCausalLM(cfg).eval()
    params, state = jaxtorch.load_params(meta, d)
    for k, v in ref.state_dict().items():
        np.testing.assert_array_equal(np.asarray(params[k]), v.numpy(), err_msg=k)
    np.testing.assert_array_equal(np.asarray(state["model.rotary_emb.inv_freq"]), ref.model.rotary_emb.inv_freq.numpy())


@case("io/load/plain_module_non_persistent_key_refused_like_load_state_dict")
def _np_key():
    class NP(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.register_buffer("m", torch.ones(2), persistent=False)

    sd = {"lin.weight": torch.ones(2, 2), "lin.bias": torch.ones(2), "m": torch.zeros(2)}
    with pytest.raises(RuntimeError, match="Unexpected"):
        NP().load_state_dict(sd)
    d = _tmp()
    save_file(sd, d / "m.safetensors")
    _raises_checkpoint_error(lambda: jaxtorch.load_params(NP(), d / "m.safetensors"), "'m'")


@case("io/load/float64_and_strided_torch_file")
def _f64_strided_pt():
    m, d = _small(), _tmp()
    w = torch.arange(6, dtype=torch.float64).reshape(3, 2).t()  # non-contiguous, float64
    sd = {**_sd(m), "0.weight": w, "0.bias": torch.arange(1.0, 2.0).expand(2)}  # and an expanded one
    torch.save(sd, d / "m.pt")
    _same_as_torch(m, d / "m.pt", sd)


@case("io/load/0d_and_empty_parameters")
def _0d_empty():
    m = nn.Module()
    m.scale = nn.Parameter(torch.tensor(2.5))
    m.none = nn.Parameter(torch.zeros(0, 3))
    d = _tmp()
    sd = {"scale": torch.tensor(-1.0), "none": torch.zeros(0, 3)}
    save_file(sd, d / "m.safetensors")
    _same_as_torch(m, d / "m.safetensors", sd)


@case("io/load/shape_mismatch_named")
def _shape_mismatch():
    m, d = _small(), _tmp()
    save_file({**_sd(m), "0.weight": torch.zeros(3, 2)}, d / "m.safetensors")
    with pytest.raises(CheckpointError) as e:
        jaxtorch.load_params(m, d / "m.safetensors")
    clear_error(e.value, "0.weight")
    assert "(3, 2)" in str(e.value) and "(2, 3)" in str(e.value)


# ---- load_params: corrupted files raise, never read a neighbour's bytes --------------------------
def _saved_bytes() -> tuple[nn.Module, bytes, dict, int]:
    m = _small()
    buf = _tmp() / "m.safetensors"
    save_file(_sd(m), buf)
    raw = buf.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return m, raw, json.loads(raw[8 : 8 + n]), n


def _with_header(header, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def _write(raw: bytes) -> Path:
    path = _tmp() / "bad.safetensors"
    path.write_bytes(raw)
    return path


@case("io/load/truncated_safetensors")
def _truncated():
    m, raw, _, _ = _saved_bytes()
    _raises_checkpoint_error(lambda: jaxtorch.load_params(m, _write(raw[:-8])), "truncated")


@case("io/load/header_length_beyond_file")
def _huge_header():
    m, raw, _, _ = _saved_bytes()
    path = _write(struct.pack("<Q", 10**12) + raw[8:])  # before: MemoryError (it asked for 1 TB)
    _raises_checkpoint_error(lambda: jaxtorch.load_params(m, path), "safetensors", "truncated")


@case("io/load/header_not_an_object")
def _header_list():
    m = _small()
    path = _write(_with_header([1, 2], b""))  # before: AttributeError
    _raises_checkpoint_error(lambda: jaxtorch.load_params(m, path), "not a safetensors", "header")


@case("io/load/header_entry_without_offsets")
def _no_offsets():
    m, raw, header, n = _saved_bytes()
    header = {**header, "0.weight": {"dtype": "F32", "shape": [2, 3]}}  # before: KeyError
    path = _write(_with_header(header, raw[8 + n :]))
    _raises_checkpoint_error(lambda: jaxtorch.load_params(m, path), "0.weight")


@case("io/load/offsets_disagree_with_shape")
def _bad_offsets():
    """The header says 4 bytes for a (2, 3) float32: the safetensors library refuses; before,
    load_params read 24 bytes from there on, part of the next tensor (a silent wrong weight)."""
    m, raw, header, n = _saved_bytes()
    start = header["0.weight"]["data_offsets"][0]
    header = {**header, "0.weight": {**header["0.weight"], "data_offsets": [start, start + 4]}}
    path = _write(_with_header(header, raw[8 + n :]))
    with pytest.raises(Exception):  # (the reference: the safetensors library refuses too)
        load_file(path)
    _raises_checkpoint_error(lambda: jaxtorch.load_params(m, path), "0.weight")


@case("io/load/offsets_beyond_file")
def _offsets_beyond():
    m, raw, header, n = _saved_bytes()
    a, b = header["1.running_var"]["data_offsets"]
    header = {**header, "1.running_var": {**header["1.running_var"], "data_offsets": [a + 4096, b + 4096]}}
    path = _write(_with_header(header, raw[8 + n :]))
    _raises_checkpoint_error(lambda: jaxtorch.load_params(m, path), "running_var")


@case("io/load/bytes_after_the_last_tensor")
def _trailing():
    """The safetensors library refuses a file its tensors do not cover (appended to, spliced)."""
    m, raw, _, _ = _saved_bytes()
    path = _write(raw + bytes(8))
    with pytest.raises(Exception):
        load_file(path)
    _raises_checkpoint_error(lambda: jaxtorch.load_params(m, path), "corrupted")


@case("io/load/gap_between_tensors")
def _gap():
    m, raw, header, n = _saved_bytes()
    last = max(header.items(), key=lambda kv: kv[1]["data_offsets"][0] if kv[0] != "__metadata__" else -1)[0]
    a, b = header[last]["data_offsets"]
    header = {**header, last: {**header[last], "data_offsets": [a + 8, b + 8]}}
    path = _write(_with_header(header, raw[8 + n : 8 + n + a] + bytes(8) + raw[8 + n + a :]))
    with pytest.raises(Exception):
        load_file(path)
    _raises_checkpoint_error(lambda: jaxtorch.load_params(m, path), last)


@case("io/load/junk_torch_file")
def _junk_pt():
    m, d = _small(), _tmp()
    (d / "m.pt").write_bytes(b"junkjunkjunk")  # before: KeyError 1785425525 (torch.load's own)
    _raises_checkpoint_error(lambda: jaxtorch.load_params(m, d / "m.pt"), "m.pt")


@case("io/load/truncated_torch_file")
def _truncated_pt():
    m, d = _small(), _tmp()
    torch.save(_sd(m), d / "full.pt")
    (d / "m.pt").write_bytes((d / "full.pt").read_bytes()[:300])
    _raises_checkpoint_error(lambda: jaxtorch.load_params(m, d / "m.pt"), "m.pt")


# ---- load_params: sharded directories ---------------------------------------------------------
def _sharded(shards: dict[str, dict[str, torch.Tensor]], weight_map: dict[str, str]) -> Path:
    d = _tmp()
    for f, tensors in shards.items():
        save_file(tensors, d / f)
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return d


@case("io/load/index_names_missing_shard")
def _missing_shard():
    m = _small()
    sd = _sd(m)
    d = _sharded({"a.safetensors": sd}, {**{k: "a.safetensors" for k in sd}, "0.weight": "b.safetensors"})
    _raises_checkpoint_error(lambda: jaxtorch.load_params(m, d), "b.safetensors")


@case("io/load/index_not_json")
def _bad_index():
    m, d = _small(), _tmp()
    save_file(_sd(m), d / "a.safetensors")
    (d / "model.safetensors.index.json").write_text("{not json")  # before: JSONDecodeError
    _raises_checkpoint_error(lambda: jaxtorch.load_params(m, d), "index")


@case("io/load/index_without_weight_map")
def _index_no_map():
    m, d = _small(), _tmp()
    (d / "model.safetensors.index.json").write_text('{"metadata": {}}')  # before: KeyError
    _raises_checkpoint_error(lambda: jaxtorch.load_params(m, d), "weight_map")


@case("io/load/name_in_two_shards_read_where_the_index_says")
def _dup_follows_index():
    """Before: the later shard (sorted by name) won, whatever the index said."""
    m = _small()
    sd = _sd(m)
    rest = {k: v for k, v in sd.items() if k != "0.weight"}
    d = _sharded(
        {"a.safetensors": {"0.weight": sd["0.weight"]}, "b.safetensors": {**rest, "0.weight": torch.zeros(2, 3)}},
        {**{k: "b.safetensors" for k in rest}, "0.weight": "a.safetensors"},
    )
    _same_as_torch(m, d, sd)


@case("io/load/name_in_two_shards_not_in_index")
def _dup_unsettled():
    m = _small()
    sd = _sd(m)
    d = _sharded(
        {"a.safetensors": sd, "b.safetensors": {"0.weight": torch.zeros(2, 3)}},
        {k: "a.safetensors" for k in sd if k != "0.weight"} | {"0.bias": "b.safetensors"},
    )
    (d / "b.safetensors").unlink()
    save_file({"0.weight": torch.zeros(2, 3), "0.bias": sd["0.bias"]}, d / "b.safetensors")
    _raises_checkpoint_error(lambda: jaxtorch.load_params(m, d), "0.weight")


@case("io/load/sharding_for_a_name_the_model_lacks")
def _shardings_typo():
    """Before: a misspelt name in `shardings` left that array unsharded, silently."""
    m, d = _small(), _tmp()
    save_file(_sd(m), d / "m.safetensors")
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    with pytest.raises(ValueError) as e:
        jaxtorch.load_params(m, d / "m.safetensors", shardings={"0.wieght": one})
    clear_error(e.value, "0.wieght")


@case("io/load/shardings_and_mesh_together_refused")
def _shardings_and_mesh():
    """Before: `mesh=` won and `shardings=` was ignored; `rules=` without a mesh were ignored."""
    m, d = _small(), _tmp()
    save_file(_sd(m), d / "m.safetensors")
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    mesh = jax.make_mesh((1,), ("x",))
    rules = [(r"weight$", jax.sharding.PartitionSpec("x"))]
    for kw in ({"shardings": one, "mesh": mesh}, {"rules": rules}):
        with pytest.raises(ValueError) as e:
            jaxtorch.load_params(m, d / "m.safetensors", **kw)
        clear_error(e.value, "mesh")


# ---- load_params: tied weights --------------------------------------------------------------
class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(4, 3)
        self.head = nn.Linear(3, 4, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.emb(ids))


def _tied_file(tensors: dict[str, torch.Tensor]) -> tuple[nn.Module, Path]:
    torch.manual_seed(0)
    m, d = _Tied(), _tmp()
    save_file(tensors, d / "m.safetensors")
    return m, d / "m.safetensors"


@case("io/load/tied_weight_under_the_other_name")
def _tied_other():
    w = torch.randn(4, 3)
    m, path = _tied_file({"head.weight": w})
    got = _loaded(m, path)
    assert set(got) == {"emb.weight"}
    np.testing.assert_array_equal(got["emb.weight"], w.numpy())


@case("io/load/tied_weight_twice_equal")
def _tied_twice():
    w = torch.randn(4, 3)
    m, path = _tied_file({"emb.weight": w, "head.weight": w.clone()})
    np.testing.assert_array_equal(_loaded(m, path)["emb.weight"], w.numpy())


@case("io/load/tied_weight_twice_different_refused")
def _tied_differ():
    """Before: the first name's copy, silently; `load_state_dict` keeps the last one (head.weight)."""
    w = torch.randn(4, 3)
    m, path = _tied_file({"emb.weight": w, "head.weight": w + 1})
    _raises_checkpoint_error(lambda: jaxtorch.load_params(m, path), "tied")


# ---- meta-device modules ----------------------------------------------------------------------
class _Derived(nn.Module):
    """A non-persistent buffer computed from another buffer in `__init__` (no reset_parameters)."""

    def __init__(self, n: int = 4):
        super().__init__()
        self.lin = nn.Linear(n, n)
        self.register_buffer("base", torch.arange(n, dtype=torch.float32))
        self.register_buffer("inv", 1.0 / (10.0 ** (self.base / n)), persistent=False)

    def forward(self, x):
        return self.lin(x) * self.inv + self.base


@case("io/meta/derived_buffer_refused_and_the_way_out_works")
def _derived():
    with torch.device("meta"):
        meta = _Derived()
    with pytest.raises(jaxtorch.JaxtorchError) as e:
        jaxtorch.extract(meta)
    clear_error(e.value, "inv")
    assert "register_buffer" in str(e.value), str(e.value)  # before: it advised `state=`, which extract never reaches
    torch.manual_seed(0)
    ref = _Derived()
    meta.register_buffer("inv", ref.inv.clone(), persistent=False)  # the way out the message gives
    d = _tmp()
    save_file(_sd(ref), d / "m.safetensors")
    params, state = jaxtorch.load_params(meta, d / "m.safetensors")
    _, fn = jaxtorch.extract(meta)
    x = torch.randn(2, 4)
    close(fn(params, x.numpy(), state=state), ref(x))


class _ResetDraws(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("mask", torch.ones(3), persistent=False)
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.normal_(self.lin.weight)
        self.mask.copy_(torch.arange(3.0))

    def forward(self, x):
        return self.lin(x) * self.mask


@case("io/meta/computing_buffers_leaves_torch_rng_alone")
def _rng_alone():
    """Before: extract of a meta module ran its reset_parameters on the global CPU generator."""
    with torch.device("meta"):
        meta = _ResetDraws()
    torch.manual_seed(0)
    expected = torch.randn(3)
    torch.manual_seed(0)
    _, fn = jaxtorch.extract(meta)
    equal(torch.randn(3), expected)
    np.testing.assert_array_equal(np.asarray(fn.state["mask"]), np.arange(3.0, dtype=np.float32))


class _Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("a", torch.ones(3), persistent=False)
        self.register_buffer("b", torch.ones(3), persistent=False)
        self.reset_parameters()

    def reset_parameters(self):
        self.a.copy_(torch.arange(3.0))
        self.b.copy_(self.a * 2)

    def forward(self, x):
        return x * self.b + self.a


@case("io/meta/buffer_from_another_buffer_in_reset_parameters")
def _chain():
    with torch.device("meta"):
        meta = _Chain()
    _, fn = jaxtorch.extract(meta)
    x = torch.randn(3)
    close(fn({}, x.numpy()), _Chain()(x))


class _Scaled(nn.Module):
    """A 0-d non-persistent buffer (Gemma's `embed_scale`)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("scale", torch.tensor(0.0), persistent=False)
        self.reset_parameters()

    def reset_parameters(self):
        self.scale.fill_(3.0**0.5)

    def forward(self, x):
        return self.lin(x) * self.scale


@case("io/meta/0d_non_persistent_buffer_through_load_params")
def _scaled():
    """Before: AttributeError 'numpy.float32' object has no attribute 'ctypes' (Gemma on meta too)."""
    torch.manual_seed(0)
    ref, d = _Scaled(), _tmp()
    save_file(_sd(ref), d / "m.safetensors")
    with torch.device("meta"):
        meta = _Scaled()
    params, state = jaxtorch.load_params(meta, d / "m.safetensors")
    _, fn = jaxtorch.extract(meta)
    x = torch.randn(2, 3)
    close(fn(params, x.numpy(), state=state), ref(x))


class _EmbedScale(nn.Module):
    """A scalar buffer on a module that owns a (potentially huge) weight."""

    seen: list[bool] = []

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1000, 64))
        self.register_buffer("scale", torch.tensor(0.0), persistent=False)
        self.reset_parameters()

    def reset_parameters(self):
        _EmbedScale.seen.append(self.weight.is_meta)
        nn.init.normal_(self.weight)
        self.scale.fill_(8.0)

    def forward(self, ids):
        return self.weight[ids] * self.scale


@case("io/meta/buffer_computed_without_materializing_the_weights")
def _no_materialize():
    """Before: Gemma's scalar `embed_scale` made load_params allocate and initialize the whole
    embedding on the CPU (a 3 GB copy for Gemma-7B) to compute one number."""
    with torch.device("meta"):
        meta = _EmbedScale()
    _EmbedScale.seen.clear()
    _, fn = jaxtorch.extract(meta)
    assert _EmbedScale.seen == [True], _EmbedScale.seen
    np.testing.assert_array_equal(np.asarray(fn.state["scale"]), np.float32(8.0))


class _FromWeight(nn.Module):
    """A buffer computed from a parameter's values: needs real parameters to compute."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("total", torch.tensor(0.0), persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        nn.init.ones_(self.lin.weight)
        self.total.copy_(self.lin.weight.sum())

    def forward(self, x):
        return self.lin(x) * self.total


@case("io/meta/buffer_computed_from_parameter_values")
def _from_weight():
    with torch.device("meta"):
        meta = _FromWeight()
    ref = _FromWeight()
    d = _tmp()
    save_file(_sd(ref), d / "m.safetensors")
    params, state = jaxtorch.load_params(meta, d / "m.safetensors")
    _, fn = jaxtorch.extract(meta)
    x = torch.randn(2, 3)
    close(fn(params, x.numpy(), state=state), ref(x))
    assert meta.lin.weight.is_meta and meta.total.is_meta  # the module is left as found


class _ReadModify(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("idx", torch.zeros(3, dtype=torch.long), persistent=False)
        self.reset_parameters()

    def reset_parameters(self):
        self.idx += 1  # depends on what was there: no value without the constructor's data

    def forward(self, x):
        return x[self.idx]


@case("io/meta/int_buffer_read_modify_write_refused")
def _read_modify():
    with torch.device("meta"):
        meta = _ReadModify()
    with pytest.raises(jaxtorch.JaxtorchError) as e:
        jaxtorch.extract(meta)
    clear_error(e.value, "idx")


class _ParamIsBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))
        self.register_buffer("wb", self.w, persistent=False)

    def forward(self, x):
        return x * self.w + self.wb


@case("io/meta/parameter_tied_to_non_persistent_buffer")
def _param_buffer():
    with torch.device("meta"):
        meta = _ParamIsBuffer()
    d = _tmp()
    save_file({"w": torch.full((3,), 2.0)}, d / "m.safetensors")
    params, state = jaxtorch.load_params(meta, d / "m.safetensors")
    _, fn = jaxtorch.extract(meta)
    ref = _ParamIsBuffer()
    ref.load_state_dict({"w": torch.full((3,), 2.0)})
    x = torch.randn(3)
    close(fn(params, x.numpy(), state=state), ref(x))


@case("io/meta/placeholder_params_called")
def _placeholders():
    """Before: JAX's 'A ShapeDtypeStruct does not have a value ...' TypeError, no way out."""
    with torch.device("meta"):
        meta = nn.Linear(3, 2)
    params, fn = jaxtorch.extract(meta)
    assert all(isinstance(v, jax.ShapeDtypeStruct) for v in params.values())
    assert jax.eval_shape(fn, params, jax.ShapeDtypeStruct((1, 3), jnp.float32)).shape == (1, 2)
    with pytest.raises(jaxtorch.JaxtorchError) as e:
        fn(params, np.ones((1, 3), np.float32))
    clear_error(e.value, "load_params")


@case("io/meta/placeholder_state_when_state_is_not_given")
def _placeholder_state():
    """Loaded params but no `state=`: before, AttributeError 'ShapeDtypeStruct' has no 'astype'."""
    torch.manual_seed(0)
    ref, d = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).eval(), _tmp()
    save_file(_sd(ref), d / "m.safetensors")
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).eval()
    params, state = jaxtorch.load_params(meta, d / "m.safetensors")
    _, fn = jaxtorch.extract(meta)
    x = torch.randn(5, 3)
    with pytest.raises(jaxtorch.JaxtorchError) as e:
        fn(params, x.numpy())
    clear_error(e.value, "running_mean")
    assert "state=state" in str(e.value)
    close(fn(params, x.numpy(), state=state), ref(x))


@case("io/meta/like_factories_of_meta_tensors_onto_jax")
def _like_meta():
    """`torch.empty_like(meta, device=...)` reads only shape and dtype: what from_pretrained(...,
    device_map=...) does for non-persistent buffers. CPU torch's result is the reference."""
    meta = torch.empty(2, 3, device="meta")
    for factory in (torch.zeros_like, torch.ones_like):
        expected = factory(meta, device="cpu")
        with jaxtorch.default_env():
            got = factory(meta, device="jax")
            assert got.device.type == "jax"
            equal(got.cpu(), expected)
    with jaxtorch.default_env():
        assert torch.empty_like(meta, device="jax").shape == (2, 3)


@case("io/meta/load_into_meta_model_not_silent")
def _load_into_meta():
    """torch's `load_state_dict` into meta parameters warns that it is a no-op (`assign=True`)."""
    with torch.device("meta"):
        meta = nn.Linear(3, 2)
    params = {"weight": jnp.ones((2, 3)), "bias": jnp.ones(2)}

    def check():
        jaxtorch.load_into(meta, params)
        assert meta.weight.device.type != "meta", "load_into left the weights on the meta device, silently"

    refuses_or(check, "meta")


# ---- extract of memory-mapped weights: the file changing afterwards changes nothing -------------
def _overwrite_in_place(path: Path, keep: int) -> None:
    data = bytearray(path.read_bytes())
    data[keep:] = bytes(len(data) - keep)
    with open(path, "r+b") as f:  # same inode: a private map of it sees the new bytes
        f.write(data)


@case("io/mmap/from_pretrained_file_rewritten_after_extract")
def _hf_mmap():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    torch.manual_seed(0)
    d = _tmp()
    LlamaForCausalLM(cfg).save_pretrained(d)
    model = LlamaForCausalLM.from_pretrained(d).eval()
    params, fn = jaxtorch.extract(model)
    before = {k: np.asarray(v).copy() for k, v in params.items()}
    ids = np.arange(5, dtype=np.int32)[None]
    out = np.asarray(fn(params, ids).logits)
    _overwrite_in_place(d / "model.safetensors", 4096)
    assert not torch.equal(model.model.embed_tokens.weight, torch.as_tensor(before["model.embed_tokens.weight"]))
    for k, v in params.items():
        np.testing.assert_array_equal(np.asarray(v), before[k], err_msg=k)
    np.testing.assert_array_equal(np.asarray(fn(params, ids).logits), out)


@case("io/mmap/torch_load_mmap_rewritten_after_extract")
def _pt_mmap():
    torch.manual_seed(0)
    d = _tmp()
    torch.save(nn.Linear(128, 128).state_dict(), d / "m.pt")
    with torch.device("meta"):
        m = nn.Linear(128, 128)
    m.load_state_dict(torch.load(d / "m.pt", mmap=True, weights_only=True), assign=True)
    params, fn = jaxtorch.extract(m)
    before = np.asarray(params["weight"]).copy()
    _overwrite_in_place(d / "m.pt", 2048)
    np.testing.assert_array_equal(np.asarray(params["weight"]), before)


# ---- torch.save / safetensors of jax tensors ---------------------------------------------------
VIEWS = {
    "transpose": lambda x: x.t(),
    "slice": lambda x: x[1:, ::2],
    "expand": lambda x: x[:1].expand(5, 4),
    "0d": lambda x: x[1, 2],
    "empty": lambda x: x[:0],
    "bf16": lambda x: x.to(torch.bfloat16),
    "int32": lambda x: x.to(torch.int32),
    "bool": lambda x: x > 3,
    "complex": lambda x: torch.complex(x, x),
    "uint8": lambda x: x.to(torch.uint8),
}


def _round_trip(obj, **kw):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True, **kw)


for _name, _view in VIEWS.items():

    @case(f"io/save/torch_save/{_name}")
    def _torch_save(view=_view):
        base = torch.arange(12.0).reshape(3, 4)
        with jaxtorch.default_env():
            saved = view(base.to("jax"))
        equal(_round_trip(saved), view(base))

    @case(f"io/save/torch_load_map_location_jax/{_name}")
    def _torch_load_jax(view=_view):
        base = torch.arange(12.0).reshape(3, 4)
        with jaxtorch.default_env():
            back = _round_trip(view(base.to("jax")), map_location="jax")
            assert back.device.type == "jax"
            equal(back.cpu(), view(base))

    @case(f"io/save/safetensors/{_name}")
    def _st_save(view=_view):
        base = torch.arange(12.0).reshape(3, 4)
        path = _tmp() / "t.safetensors"
        with jaxtorch.default_env():
            save_file({"x": view(base.to("jax"))}, path)
        equal(load_file(path)["x"], view(base).contiguous())


LOAD_DTYPES = {
    "bool": torch.tensor([True, False]),
    "uint8": torch.tensor([0, 255], dtype=torch.uint8),
    "int16": torch.tensor([-300, 7], dtype=torch.int16),
    "uint16": torch.tensor([65535, 1], dtype=torch.uint16),
    "uint32": torch.tensor([2**31 + 5, 1], dtype=torch.uint32),
    "int64_small": torch.tensor([-3, 5]),
    "int64_wide": torch.tensor([2**40, 5]),
    "uint64_small": torch.tensor([5, 6], dtype=torch.uint64),
    "uint64_wide": torch.tensor([2**40], dtype=torch.uint64),
    "float16": torch.tensor([1.5, -2.0], dtype=torch.float16),
    "float64": torch.tensor([1.0, 2.5], dtype=torch.float64),
    "float64_0d": torch.tensor(1.5, dtype=torch.float64),
    "complex128": torch.tensor([1 + 2j], dtype=torch.complex128),
    "float8_e4m3fn": torch.tensor([1.0, -0.5]).to(torch.float8_e4m3fn),
}

for _name, _t in LOAD_DTYPES.items():

    @case(f"io/save/map_location_jax_is_to_jax/{_name}")
    def _load_is_to(t=_t):
        """`torch.load(f, map_location="jax")` gives what `.to("jax")` of the CPU tensor gives, or the
        same refusal (Float64Error / Int64Error without 64-bit mode). Before: float64 and complex128
        bytes read as float32 (garbage), int64/uint64 wrapped, uint64 doubled in length."""
        with jaxtorch.default_env():
            try:
                expected = t.to("jax").cpu()
            except jaxtorch.JaxtorchError as e:
                with pytest.raises(type(e)):
                    _round_trip(t, map_location="jax")
                return
            got = _round_trip(t, map_location="jax")
            assert got.device.type == "jax" and got.dtype == t.dtype, (got.device, got.dtype)
            got = got.cpu()
        if t.element_size() == 1 and t.is_floating_point():  # (NumPy has no float8: compare the bits)
            got, expected, t = got.view(torch.uint8), expected.view(torch.uint8), t.view(torch.uint8)
        equal(got, expected)
        equal(expected, t)


@case("io/save/torch_save_keeps_storage_sharing")
def _sharing():
    """torch.save writes a view and its base once: after load they still share memory."""
    with jaxtorch.default_env():
        a = torch.arange(6.0).to("jax")
        back = _round_trip({"a": a, "v": a[2:]})
    back["a"].add_(1)
    equal(back["v"], torch.arange(3.0, 7.0))


@case("io/save/map_location_jax_keeps_storage_sharing")
def _sharing_jax():
    """A CPU file's view and base, loaded onto the jax device, share as they do on CUDA."""
    a = torch.arange(6.0)
    with jaxtorch.default_env():
        back = _round_trip({"a": a, "v": a[2:]}, map_location="jax")
        back["a"].add_(1)
        got = back["v"].cpu()
    equal(got, torch.arange(3.0, 7.0))


@case("io/save/legacy_format_map_location_jax_refused")
def _legacy_jax():
    """Before: a segmentation fault (torch wrote the file's bytes past an empty jax storage)."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import io, torch, jaxtorch
        buf = io.BytesIO()
        a = torch.arange(6.0)
        torch.save({"a": a, "v": a[2:]}, buf, _use_new_zipfile_serialization=False)
        buf.seek(0)
        try:
            torch.load(buf, map_location="jax", weights_only=True)
        except RuntimeError as e:
            print("REFUSED", e)
        buf.seek(0)
        sd = torch.load(buf, map_location="cpu", weights_only=True)
        assert torch.equal(sd["v"].to("jax").cpu(), a[2:])
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "REFUSED" in done.stdout and "legacy" in done.stdout and "map_location='cpu'" in done.stdout, done.stdout


@case("io/save/safetensors_refuses_shared_like_cpu")
def _st_shared():
    with jaxtorch.default_env():
        a = torch.arange(6.0).to("jax")
        with pytest.raises(RuntimeError, match="share memory"):
            save_file({"a": a, "v": a[2:]}, _tmp() / "t.safetensors")


@case("io/save/parameter_pickle_keeps_class_and_requires_grad")
def _param_pickle():
    with jaxtorch.default_env():
        p = nn.Parameter(torch.ones(2, device="jax"))
        back = pickle.loads(pickle.dumps(p))
        frozen = _round_trip(nn.Parameter(torch.ones(2, device="jax"), requires_grad=False))
    assert type(back) is nn.Parameter and back.requires_grad
    assert type(frozen) is nn.Parameter and not frozen.requires_grad
    equal(back.detach(), torch.ones(2))


@case("io/save/python_attributes_kept_like_cpu")
def _attrs():
    """torch.save keeps attributes set on a tensor or parameter (`_rebuild_*_with_state`);
    before, a jax tensor's were dropped."""
    cpu_p, cpu_t = nn.Parameter(torch.ones(2)), torch.ones(2)
    cpu_p.flag, cpu_t.flag = 3, 4
    with jaxtorch.default_env():
        jax_p, jax_t = nn.Parameter(torch.ones(2, device="jax")), torch.ones(2, device="jax")
        jax_p.flag, jax_t.flag = 3, 4
        for (p, t), where in (((cpu_p, cpu_t), "cpu"), ((jax_p, jax_t), "jax")):
            back_p, back_t = _round_trip(p), _round_trip(t)
            assert getattr(back_p, "flag", None) == 3 and getattr(back_t, "flag", None) == 4, where
            assert type(back_p) is nn.Parameter and back_p.requires_grad
            assert not hasattr(back_t, "_jt_elem") and not hasattr(back_p, "_is_param")
        equal(_round_trip(jax_t), torch.ones(2))


@case("io/save/deepcopy_of_model_keeps_parameters_like_cpu")
def _deepcopy_model():
    """Before: `copy.deepcopy(model)` on the jax device gave weights that were not
    `nn.Parameter`s (plain tensors in `_parameters`), carried their grads and lost their
    attributes, and a non-leaf tensor deep-copied where torch refuses."""

    def probe(dev):
        torch.manual_seed(0)
        m = _Tied().to(dev)
        m.emb.weight.flag = 1
        m(torch.tensor([1, 2], device=dev)).sum().backward()
        c = copy.deepcopy(m)
        t = torch.ones(2, device=dev)
        t.flag = 2
        with pytest.raises(RuntimeError, match="graph leaves"):
            copy.deepcopy(torch.ones(2, device=dev, requires_grad=True) * 2)
        return (
            type(c.emb.weight) is nn.Parameter or isinstance(c.emb.weight, nn.Parameter),
            c.head.weight is c.emb.weight,
            c.emb.weight.grad is None,
            getattr(c.emb.weight, "flag", None),
            getattr(copy.deepcopy(t), "flag", None),
        )

    with jaxtorch.default_env():
        assert probe("jax") == probe("cpu"), (probe("jax"), probe("cpu"))


@case("io/save/interrupted_save_does_not_load")
def _interrupted():
    class Boom:
        def __reduce__(self):
            raise RuntimeError("boom")

    path = _tmp() / "m.pt"
    with jaxtorch.default_env():
        with pytest.raises(RuntimeError, match="boom"):
            torch.save({"a": torch.ones(3, device="jax"), "b": Boom()}, path)
    if path.exists():  # (torch leaves the partial file too; it must not load as a checkpoint)
        with pytest.raises(Exception):
            torch.load(path, weights_only=True)


@case("io/save/traced_value_refused_by_both_savers")
def _traced():
    path = _tmp() / "t.safetensors"

    @jaxtorch.jit
    def f(x):
        save_file({"x": x}, path)
        return x

    with pytest.raises(Exception) as e:
        f(torch.ones(2))
    clear_error(e.value, "trace", "traced")
    assert not path.exists()


# ---- torch.Generator(device="jax") ----------------------------------------------------------
def _draw(g: torch.Generator) -> torch.Tensor:
    with jaxtorch.default_env():
        return torch.randn(4, generator=g, device="jax").cpu()


@case("io/generator/clone_state_is_a_jax_generator")
def _clone_state():
    """CUDA torch's clone_state gives a CUDA generator; before, a jax one's gave a CPU one."""
    g = torch.Generator(device="jax").manual_seed(3)
    c = g.clone_state()
    assert c.device.type == "jax", c.device
    equal(_draw(c), _draw(g))


@case("io/generator/pickle_deepcopy_and_saved_state")
def _gen_copies():
    g = torch.Generator(device="jax").manual_seed(5)
    p, d = pickle.loads(pickle.dumps(g)), copy.deepcopy(g)
    state = _round_trip(g.get_state())
    a = _draw(g)
    equal(_draw(p), a)
    equal(_draw(d), a)
    g.set_state(state)
    equal(_draw(g), a)
    assert p.device.type == "jax" and p.initial_seed() == 5


@case("io/generator/two_interleaved")
def _interleaved():
    g1, g2 = torch.Generator(device="jax").manual_seed(1), torch.Generator(device="jax").manual_seed(1)
    a = [_draw(g1), _draw(g1)]
    b0 = _draw(g2)
    _draw(torch.Generator(device="jax").manual_seed(1))  # a third one moves neither
    equal(b0, a[0])
    equal(_draw(g2), a[1])


@case("io/generator/two_threads_no_repeated_draws")
def _gen_threads():
    g = torch.Generator(device="jax").manual_seed(0)
    out: list[tuple] = []
    lock = threading.Lock()

    def work():
        draws = [tuple(_draw(g).tolist()) for _ in range(10)]
        with lock:
            out.extend(draws)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(out)) == len(out) == 20, "two threads drew the same numbers from one generator"


class _NamedGenerator(torch.Generator):
    def name(self) -> str:
        return "mine"


@case("io/generator/user_subclass_keeps_its_class")
def _gen_subclass():
    """Before: `MyGen()` gave a plain generator (no `MyGen` methods) and every generator passed
    `isinstance(g, MyGen)`."""
    g = _NamedGenerator()
    assert type(g) is _NamedGenerator and g.name() == "mine"
    assert isinstance(g, torch.Generator) and not isinstance(torch.Generator(), _NamedGenerator)
    assert isinstance(torch.Generator(device="jax"), torch.Generator)
    g.manual_seed(4)
    equal(torch.randn(3, generator=g), torch.randn(3, generator=torch.Generator().manual_seed(4)))


@case("io/generator/foreign_state_refused")
def _bad_state():
    g = torch.Generator(device="jax")
    with pytest.raises(RuntimeError) as e:
        g.set_state(torch.zeros(3, dtype=torch.uint8))
    clear_error(e.value, "state")


@case("io/generator/device_rng_state_foreign_refused")
def _bad_device_state():
    """Before: NumPy's 'When changing to a larger dtype ...' ValueError, or a state read from
    the wrong bytes (a float tensor's values taken as bytes)."""
    good = torch.jax.get_rng_state()
    for bad in (torch.zeros(3, dtype=torch.uint8), torch.get_rng_state(), good.float()):
        with pytest.raises(RuntimeError) as e:
            torch.jax.set_rng_state(bad)
        clear_error(e.value, "get_rng_state")
    torch.jax.set_rng_state(good)
    with jaxtorch.default_env():
        a = torch.randn(3, device="jax").cpu()
        torch.jax.set_rng_state(good)
        equal(torch.randn(3, device="jax").cpu(), a)


# ---- torch.autocast("jax") ---------------------------------------------------------------------
def _both(fn, dtype=torch.bfloat16, tol=2e-2):
    """`fn(device)` under CPU autocast and jax autocast: same dtypes, close values."""
    torch.manual_seed(0)
    try:
        with torch.autocast("cpu", dtype=dtype):
            expected = fn("cpu")
    except RuntimeError as e:  # CPU torch itself cannot run it on this processor: there is no reference here
        if "could not create a primitive descriptor" not in str(e):
            raise
        pytest.skip(f"CPU torch's oneDNN has no {dtype} kernel for this op on this processor: {str(e)[:80]}")
    with jaxtorch.default_env(), torch.autocast("jax", dtype=dtype):
        got = fn("jax")
    e_leaves = [t for t in torch.utils._pytree.tree_leaves(expected) if isinstance(t, torch.Tensor)]
    g_leaves = [t for t in torch.utils._pytree.tree_leaves(got) if isinstance(t, torch.Tensor)]
    assert [t.dtype for t in g_leaves] == [t.dtype for t in e_leaves], (
        [t.dtype for t in g_leaves],
        [t.dtype for t in e_leaves],
    )
    for g, e in zip(g_leaves, e_leaves):
        if e.is_floating_point():
            close(g.float(), e.float(), rtol=tol, atol=tol)


_A, _B = torch.randn(4, 4, generator=torch.Generator().manual_seed(0)), torch.randn(4, 4)


@case("io/autocast/nested_enabled_false")
def _nested_off():
    def fn(dev):
        a, b = _A.to(dev), _B.to(dev)
        with torch.autocast(dev, enabled=False):
            x = torch.mm(a, b)
        return x, torch.mm(a, b)

    _both(fn)


@case("io/autocast/nested_other_dtype")
def _nested_other():
    def fn(dev):
        a, b = _A.to(dev), _B.to(dev)
        with torch.autocast(dev, dtype=torch.float16):
            x = torch.mm(a, b)
        return x, torch.mm(a, b)

    _both(fn)


@case("io/autocast/no_grad_and_queries")
def _queries():
    def fn(dev):
        with torch.no_grad():
            y = torch.mm(_A.to(dev), _B.to(dev))
        assert torch.is_autocast_enabled(dev) and torch.get_autocast_dtype(dev) == torch.bfloat16
        return y

    _both(fn)
    assert not torch.is_autocast_enabled("jax")


@case("io/autocast/fp16_fp32_list")
def _fp16_fp32():
    import torch.nn.functional as F

    _both(
        lambda dev: (
            torch.prod(_A.to(dev)),
            F.mse_loss(_A.to(dev), _B.to(dev)),
            F.log_softmax(torch.mm(_A.to(dev), _B.to(dev)), -1),
        ),
        torch.float16,
    )


@case("io/autocast/promote_two_low_dtypes_refused_like_cpu")
def _promote_refused():
    for dev in ("cpu", "jax"):
        with jaxtorch.default_env(), torch.autocast(dev, dtype=torch.bfloat16):
            with pytest.raises(RuntimeError) as e:
                torch.cat([_A.to(dev).bfloat16(), _B.to(dev).half()])
        clear_error(e.value, "ScalarType", "float16")


@case("io/autocast/unsupported_dtype_disables_like_cpu")
def _fp32_autocast():
    with pytest.warns(UserWarning, match="only supports"):
        _both(lambda dev: torch.mm(_A.to(dev), _B.to(dev)), torch.float32)


@case("io/autocast/jit_retraces_on_autocast_change")
def _jit_retrace():
    @jaxtorch.jit
    def mm(x, y):
        return torch.mm(x, y)

    with jaxtorch.default_env():
        a, b = _A.to("jax"), _B.to("jax")
        d1 = mm(a, b).dtype
        with torch.autocast("jax", dtype=torch.bfloat16):
            d2 = mm(a, b).dtype
        d3 = mm(a, b).dtype
    assert (d1, d2, d3) == (torch.float32, torch.bfloat16, torch.float32), (d1, d2, d3)


@case("io/autocast/jax_jit_of_extract_fn_follows_autocast")
def _jax_jit_autocast():
    """Eagerly, `fn` under `torch.autocast("jax")` runs its linear in bfloat16; a `jax.jit(fn)`
    traced outside autocast and then called inside it must not silently stay float32."""
    torch.manual_seed(0)
    params, fn = jaxtorch.extract(nn.Linear(4, 4))
    x = jnp.ones((2, 4))
    with torch.autocast("jax", dtype=torch.bfloat16):
        eager = fn(params, x).dtype
    jitted = jax.jit(lambda p, x: fn(p, x))
    jitted(params, x)

    def check():
        with torch.autocast("jax", dtype=torch.bfloat16):
            assert jitted(params, x).dtype == eager, "jax.jit reused the float32 program under autocast"

    refuses_or(check, "autocast")


@case("io/autocast/grad_scaler_fp16_steps_like_cpu")
def _grad_scaler():
    """fp16 autocast's companion: `torch.amp.GradScaler` skips the step with an inf gradient and
    halves its scale, as on the CPU."""

    def run(dev):
        torch.manual_seed(0)
        m = nn.Linear(4, 2).to(dev)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler(dev, init_scale=16.0)
        x = torch.randn(8, 4).to(dev)
        for i in range(3):
            opt.zero_grad()
            with torch.autocast(dev, dtype=torch.float16):
                loss = m(x).float().pow(2).mean()
            scaler.scale(loss).backward()
            if i == 1:
                m.weight.grad[0, 0] = float("inf")
            scaler.step(opt)
            scaler.update()
        return m.weight.detach().cpu(), scaler.get_scale()

    expected = run("cpu")
    with jaxtorch.default_env():
        got = run("jax")
    close(got[0], expected[0], rtol=1e-3, atol=1e-3)
    assert got[1] == expected[1], (got[1], expected[1])


_X = torch.randn(5, 2, 4, generator=torch.Generator().manual_seed(1))
RECURRENT = {
    "lstm": (lambda: nn.LSTM(4, 4), lambda x: x),
    "lstm_proj": (lambda: nn.LSTM(4, 4, proj_size=2), lambda x: x),
    "gru": (lambda: nn.GRU(4, 4), lambda x: x),
    "rnn_tanh": (lambda: nn.RNN(4, 4), lambda x: x),
    "rnn_relu_packed": (lambda: nn.RNN(4, 4, nonlinearity="relu"), "packed"),
    "rnn_cell": (lambda: nn.RNNCell(4, 4), lambda x: x[0]),
    "lstm_cell": (lambda: nn.LSTMCell(4, 4), lambda x: x[0]),
    "gru_cell": (lambda: nn.GRUCell(4, 4), lambda x: x[0]),
}


def _packed(x):
    from torch.nn.utils.rnn import pack_padded_sequence

    return pack_padded_sequence(x, torch.tensor([5, 3]))


for _name, (_ctor, _inp) in RECURRENT.items():

    @case(f"io/autocast/recurrent/{_name}")
    def _recurrent(ctor=_ctor, inp=_inp):
        """CPU torch decomposes these into `linear` / `mkldnn_rnn_layer`, whose casts decide the
        results' dtypes; jaxtorch runs them whole (before: float32 where CPU gives bfloat16)."""
        torch.manual_seed(0)
        ref = ctor()
        sd = ref.state_dict()

        def fn(dev):
            m = ref if dev == "cpu" else ctor()
            if dev == "jax":
                m.load_state_dict(sd)
                m.to("jax")
            x = _X.to(dev)
            out = m(_packed(x) if inp == "packed" else inp(x))
            return out.data if hasattr(out, "batch_sizes") else out

        _both(fn)


@case("io/autocast/recurrent_grads_reach_fp32_weights")
def _rnn_grads():
    torch.manual_seed(0)
    ref = nn.RNN(4, 4)
    sd = ref.state_dict()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ref(_X[:2])[0]
    out.float().sum().backward()
    with jaxtorch.default_env():
        m = nn.RNN(4, 4)
        m.load_state_dict(sd)
        m.to("jax")
        with torch.autocast("jax", dtype=torch.bfloat16):
            got = m(_X[:2].to("jax"))[0]
        assert got.dtype == out.dtype
        got.float().sum().backward()
        grads = {k: p.grad.cpu() for k, p in m.named_parameters()}
    for k, p in ref.named_parameters():
        assert grads[k].dtype == torch.float32
        close(grads[k], p.grad, rtol=5e-2, atol=5e-2)
