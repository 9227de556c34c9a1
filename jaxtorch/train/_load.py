"""`load_params`: a torch / Hugging Face checkpoint straight into (sharded) JAX arrays.

Reads a `.safetensors` file, a Hugging Face directory (the one file `from_pretrained` reads
there, in its order: `model.safetensors`, `model.safetensors.index.json` and its shards,
`pytorch_model.bin`, `pytorch_model.bin.index.json`), or a torch `.bin`/`.pt` state dict
(`torch.load(weights_only=True)` only: nothing in the file is executed). Each array is built
with `jax.make_array_from_callback`: for every device of this process the callback reads only
that device's slice (safetensors: `os.preadv` of exactly the slice's bytes, no memory map),
converts its dtype and hands it to JAX, so the host never holds more than the arrays this
process's devices hold plus one slice in flight.

Names map as the model's `load_state_dict` (and `from_pretrained`) would: tied weights are
one entry (under the first name `named_parameters` gives; a file holding either name fills
it), Hugging Face's key renames (`LayerNorm.gamma`, `_checkpoint_conversion_mapping`,
`model.` / `base_model_prefix` added or stripped) apply, and non-persistent buffers (rotary
`inv_freq`), which checkpoints never hold, are computed from the module's own code
(`bridge/state/_meta.py`). Shape mismatches raise one `CheckpointKeysError` listing them all;
names missing from or unexpected in the file too when strict (`strict=`; by default as the
model's own loader: lenient for a Hugging Face model, as `from_pretrained`, which reports
them: a `CheckpointKeysWarning`; strict for other modules, as `load_state_dict`).

Example:
    ```python
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    mesh = jax.make_mesh((8,), ("model",))
    params, state = jaxtorch.load_params(model, "llama/", mesh=mesh, rules=[(r"q_proj\\.weight$", P("model"))])
    _, fn = jaxtorch.extract(model)
    logits = jax.jit(fn)(params, ids, state=state)
    ```
"""

from __future__ import annotations

import json
import os
import re
import struct
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import torch
from jax.sharding import Mesh, NamedSharding, Sharding, SingleDeviceSharding

from ..bridge.core._dtypes import check_int_range, narrowed_range, to_jax_dtype
from ..bridge.core._errors import CheckpointError, CheckpointKeysError
from ..bridge.state._binding import aliases, named_state, split_state
from ..bridge.state._meta import computed_buffers, non_persistent_names
from ..bridge.tensor._convert import tensor_to_jax
from ._sharding import Rules, spec_for

ShardingsLike = None | Sharding | Mapping[str, Sharding] | Callable[[str, jax.ShapeDtypeStruct], Sharding | None]

_SAFETENSORS_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64),
    "U32": np.dtype(np.uint32),
    "U16": np.dtype(np.uint16),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}


# ---- reading: one entry per tensor of the file(s) ---------------------------------------
Index = tuple[slice, ...]


@dataclass(frozen=True)
class _SafetensorsEntry:
    """One tensor of a safetensors file: where its bytes are. `read` preads one slice."""

    path: str
    start: int  # absolute byte offset of the tensor's data in the file
    shape: tuple[int, ...]
    dtype: np.dtype

    def read(self, index: Index) -> np.ndarray:
        return read_slice(self, index)


@dataclass(frozen=True)
class _TorchEntry:
    """One tensor of a torch state dict (memory-mapped by `torch.load(mmap=True)` when it can)."""

    tensor: torch.Tensor
    shape: tuple[int, ...]
    dtype: np.dtype

    def read(self, index: Index) -> np.ndarray:
        return read_slice(self, index)


Entry = _SafetensorsEntry | _TorchEntry


def _bounds(index: Index, shape: tuple[int, ...]) -> list[tuple[int, int]]:
    out = []
    for s, n in zip(index, shape, strict=False):
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"load_params: strided slice {s} (a sharding JAX never asks for)")
        out.append((start, stop))
    out += [(0, n) for n in shape[len(out) :]]
    return out


def read_slice(entry: Entry, index: Index) -> np.ndarray:
    """The slice `index` of one checkpoint tensor, in the file's dtype: the single place
    bytes are read (the tests count them here)."""
    bounds = _bounds(index, entry.shape)
    if isinstance(entry, _TorchEntry):
        t = entry.tensor[tuple(slice(a, b) for a, b in bounds)]
        host = t.contiguous().reshape(-1).view(torch.uint8).numpy() if t.numel() else np.empty(0, np.uint8)
        out = _aligned_empty([b - a for a, b in bounds], entry.dtype)
        out.reshape(-1).view(np.uint8)[...] = host.reshape(-1)
        return out
    return _pread(entry, bounds)


_RUN = 1 << 16  # bytes: runs at least this long are read one by one (exactly their bytes)
_BLOCK = 1 << 23  # bytes: shorter runs are read in blocks of up to this many (their gaps included)


def _aligned_empty(shape: list[int] | tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialized array whose data is 64-byte aligned: JAX's CPU client then uses it
    as the device buffer without a copy (and replicas on several CPU devices share it)."""
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(n + 64, np.uint8)
    start = (-raw.ctypes.data) % 64
    return raw[start : start + n].view(dtype).reshape(shape)


def _converted(host: np.ndarray, target: np.dtype) -> np.ndarray:
    """`host` in `target` dtype, in an aligned buffer (see `_aligned_empty`)."""
    host = np.asarray(host)  # (indexing a 0-d array with `()` gives a NumPy scalar)
    if host.dtype == target and host.ctypes.data % 64 == 0:
        return host
    out = _aligned_empty(host.shape, target)
    np.copyto(out, host, casting="unsafe")
    return out


def _preadinto(fd: int, buf: memoryview, offset: int, path: str) -> None:
    got = 0
    while got < len(buf):  # preadv may return short
        n = os.preadv(fd, [buf[got:]], offset + got)
        if n <= 0:
            raise CheckpointError(f"load_params: {path} is truncated (tensor data ends early)")
        got += n


def _run_offsets(entry: _SafetensorsEntry, bounds: list[tuple[int, int]]) -> tuple[np.ndarray, int]:
    """The file offsets of the contiguous runs of the box `bounds` (row-major order) and their length."""
    shape, item = entry.shape, entry.dtype.itemsize
    # the last axis k whose range is partial: the axes after it are whole, so each run is contiguous
    k = max((i for i, (a, b) in enumerate(bounds) if (a, b) != (0, shape[i])), default=0)
    strides = [int(np.prod(shape[i + 1 :], dtype=np.int64)) * item for i in range(len(shape))]
    run = (bounds[k][1] - bounds[k][0]) * strides[k] if shape else item
    offsets = np.array([entry.start + (bounds[k][0] * strides[k] if shape else 0)], dtype=np.int64)
    for i in reversed(range(k)):  # add each leading axis's positions (outer axes vary slowest)
        steps = (np.arange(bounds[i][0], bounds[i][1], dtype=np.int64) * strides[i])[:, None]
        offsets = (steps + offsets[None, :]).reshape(-1)
    return offsets, run


def _pread(entry: _SafetensorsEntry, bounds: list[tuple[int, int]]) -> np.ndarray:
    """Read the box `bounds` of a row-major tensor from the file, without a memory map: one
    `preadv` per contiguous run when runs are long; short runs (a column split) in blocks of
    at most `_BLOCK` bytes, from which the runs are copied out."""
    out = _aligned_empty([b - a for a, b in bounds], entry.dtype)
    if out.size == 0:
        return out
    offsets, run = _run_offsets(entry, bounds)
    flat = out.reshape(-1).view(np.uint8)
    fd = os.open(entry.path, os.O_RDONLY)
    try:
        if run >= _RUN or len(offsets) == 1:
            for n, offset in enumerate(offsets.tolist()):
                _preadinto(fd, memoryview(flat[n * run : (n + 1) * run]), offset, entry.path)  # type: ignore[arg-type]
            return out
        rows = flat.reshape(len(offsets), run)
        start = 0
        while start < len(offsets):
            stop = int(np.searchsorted(offsets, offsets[start] + _BLOCK - run, side="right"))
            stop = max(stop, start + 1)
            first, span = int(offsets[start]), int(offsets[stop - 1]) - int(offsets[start]) + run
            block = np.empty(span, np.uint8)
            _preadinto(fd, memoryview(block), first, entry.path)  # type: ignore[arg-type]
            rel = offsets[start:stop] - first
            gaps = np.diff(rel)
            if len(gaps) and np.all(gaps == gaps[0]):  # evenly spaced: one strided copy
                rows[start:stop] = np.lib.stride_tricks.as_strided(block, (stop - start, run), (int(gaps[0]), 1))
            else:
                for n, r in enumerate(rel.tolist()):
                    rows[start + n] = block[r : r + run]
            start = stop
    finally:
        os.close(fd)
    return out


def _safetensors_entries(path: Path) -> dict[str, Entry]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"load_params: {path} is not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:  # (a corrupted length would otherwise ask for terabytes)
            raise CheckpointError(
                f"load_params: {path} is not a safetensors file or is truncated (its header claims {n} bytes, "
                f"the file has {size})"
            )
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise CheckpointError(f"load_params: {path} is not a safetensors file (bad header)") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"load_params: {path} is not a safetensors file (its header is not a JSON object)")
    base = 8 + n
    entries: dict[str, Entry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        entries[name] = _checked_entry(path, name, info, base, size)
    _check_covered(path, entries, base, size)
    return entries


def _check_covered(path: Path, entries: dict[str, Entry], base: int, size: int) -> None:
    """Raise unless the tensors' bytes tile the data section exactly, one after another (as the
    safetensors library requires: a gap or trailing bytes mean a damaged or spliced file)."""
    end = base
    for name, e in sorted(entries.items(), key=lambda kv: kv[1].start):  # type: ignore[union-attr]
        assert isinstance(e, _SafetensorsEntry)
        if e.start != end:
            raise CheckpointError(
                f"load_params: {path} is corrupted: {name!r} starts at byte {e.start - base} of the data, "
                f"where the tensor before it ends at {end - base} (the safetensors library refuses it too)"
            )
        end = e.start + int(np.prod(e.shape, dtype=np.int64)) * e.dtype.itemsize
    if end != size:
        raise CheckpointError(
            f"load_params: {path} is corrupted or was appended to: its tensors end at byte {end} and the "
            f"file at {size} (the safetensors library refuses it too)"
        )


def _checked_entry(path: Path, name: str, info: Any, base: int, size: int) -> _SafetensorsEntry:
    """The entry of one header item, after checking it as the safetensors library does: a
    known dtype, and data offsets that span exactly `shape` x the dtype's size inside the file
    (a corrupted header must raise, never read a neighbour's bytes)."""
    try:
        dtype_name, shape, (start, stop) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
        start, stop = int(start), int(stop)
    except (TypeError, KeyError, ValueError) as e:
        raise CheckpointError(
            f"load_params: {path} is corrupted: the header entry of {name!r} lacks a dtype, shape or "
            f"data_offsets ({info!r})"
        ) from e
    if dtype_name not in _SAFETENSORS_DTYPES:
        raise CheckpointError(f"load_params: {path}: {name} has dtype {dtype_name}, which load_params cannot read")
    dtype = _SAFETENSORS_DTYPES[dtype_name]
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if min((start, *shape), default=0) < 0 or stop - start != nbytes or base + stop > size:
        raise CheckpointError(
            f"load_params: {path} is corrupted or truncated: {name!r} ({dtype_name}, shape {list(shape)}: "
            f"{nbytes} bytes) has data_offsets [{start}, {stop}] in a data section of {size - base} bytes"
        )
    return _SafetensorsEntry(str(path), base + start, shape, dtype)


def _torch_entries(path: Path) -> dict[str, Entry]:
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # legacy (non-zip) format cannot be memory-mapped
        try:
            sd = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # (torch raises KeyError, UnpicklingError, EOFError, ...)
            raise CheckpointError(
                f"load_params: {path} is not a torch checkpoint that `torch.load(weights_only=True)` can read "
                f"({type(e).__name__}: {e}); it may be corrupted or truncated"
            ) from e
    if not isinstance(sd, Mapping) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise CheckpointError(
            f"load_params: {path} is not a flat state dict (name -> tensor); pass the state dict's file "
            "(`torch.save(model.state_dict(), path)`)"
        )
    from ..bridge.core._dtypes import _TORCH_TO_NP

    return {k: _TorchEntry(v.detach(), tuple(v.shape), np.dtype(_TORCH_TO_NP[v.dtype])) for k, v in sd.items()}


def _sharded_entries(directory: Path, index_name: str) -> dict[str, Entry]:
    """The entries of a sharded checkpoint: each name read from the shard its index's
    `weight_map` names; a name held by several shards and not settled by the index raises."""
    try:
        weight_map = json.loads((directory / index_name).read_text())["weight_map"]
        if not all(isinstance(f, str) for f in weight_map.values()):
            raise TypeError("a shard file name is not a string")
        files = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(
            f"load_params: {directory / index_name} is not a Hugging Face index (a JSON object whose "
            f"'weight_map' maps each name to its shard file): {type(e).__name__}: {e}"
        ) from e
    out: dict[str, Entry] = {}
    twice: set[str] = set()
    for f in files:
        for key, entry in checkpoint_entries(directory / f).items():
            if weight_map.get(key, f) != f:
                continue  # the index puts `key` in another shard
            if key in out:
                twice.add(key)
            out[key] = entry
    if twice:
        raise CheckpointError(
            f"load_params: {directory}: {sorted(twice)} are in several shards and the index names none of "
            f"them: which copy is meant is ambiguous; add them to {index_name}'s weight_map or remove the copies"
        )
    return out


# the files `from_pretrained` reads in a model directory, in its order of preference
# (transformers' `_get_resolved_checkpoint_files`): the first that exists is read, the others ignored
HF_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def hf_weights_file(directory: str | os.PathLike) -> Path:
    """The one file of a Hugging Face model directory that `from_pretrained` reads.

    `config.json`'s `transformers_weights` when it names a file inside the directory, else the
    first of `HF_WEIGHT_FILES` that exists: a single `model.safetensors` wins over a (stale)
    `model.safetensors.index.json`, and any safetensors file over `.bin` files.

    Example:
        ```python
        hf_weights_file("llama/")  # Path("llama/model.safetensors") even beside pytorch_model.bin.index.json
        ```
    """
    d = Path(directory)
    explicit = _explicit_weights_name(d)
    if explicit is not None:
        return d / explicit
    for name in HF_WEIGHT_FILES:
        if (d / name).is_file():
            return d / name
    raise CheckpointError(
        f"load_params: {d} holds none of {', '.join(HF_WEIGHT_FILES)} (a Hugging Face model directory); "
        "pass the checkpoint file itself"
    )


def _explicit_weights_name(directory: Path) -> str | None:
    """`config.json`'s `transformers_weights` (the file `from_pretrained` then reads), checked as
    transformers checks it: a safetensors file or index inside the directory."""
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return None
    name = config.get("transformers_weights") if isinstance(config, dict) else None
    if name is None:
        return None
    safetensors_name = isinstance(name, str) and name.endswith((".safetensors", ".safetensors.index.json"))
    if not safetensors_name or not Path(os.path.abspath(directory / name)).is_relative_to(os.path.abspath(directory)):
        raise CheckpointError(
            f"load_params: {directory / 'config.json'} names transformers_weights={name!r}, which is not a "
            "safetensors file or index inside the directory (from_pretrained refuses it too)"
        )
    return name


def checkpoint_entries(path: str | os.PathLike) -> dict[str, Entry]:
    """Every tensor of a checkpoint (file, `.index.json` of shards, or Hugging Face directory:
    the file `from_pretrained` reads, `hf_weights_file`) by its name in the file; reads headers
    only (safetensors) or memory-maps (torch)."""
    p = Path(path)
    if p.is_dir():
        p = hf_weights_file(p)
    if not p.exists():
        raise CheckpointError(f"load_params: no such file or directory: {p}")
    if p.name.endswith(".index.json"):
        return _sharded_entries(p.parent, p.name)
    if p.suffix == ".safetensors":
        return _safetensors_entries(p)
    if p.suffix in (".bin", ".pt", ".pth"):
        return _torch_entries(p)
    raise CheckpointError(
        f"load_params: {p}: expected a .safetensors, .bin, .pt, .pth or .index.json file, or a directory"
    )


# ---- names: the file's keys -> the model's names ----------------------------------------
def _hf_renamer(model: torch.nn.Module, model_names: Mapping[str, Any]) -> Callable[[str], str]:
    """Hugging Face's own key mapping for `model` (renamings, `_checkpoint_conversion_mapping`,
    `base_model_prefix` added or stripped); identity for other modules."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import WeightRenaming, get_model_conversion_mapping
        from transformers.core_model_loading import rename_source_key
    except ImportError:  # pragma: no cover - transformers absent
        return lambda k: k
    if not isinstance(model, PreTrainedModel):
        return lambda k: k
    key_mapping = getattr(model, "_checkpoint_conversion_mapping", None) or None
    transforms = get_model_conversion_mapping(model, key_mapping=key_mapping)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if not isinstance(t, WeightRenaming)]
    prefix = getattr(model, "base_model_prefix", None) or None

    def rename(key: str) -> str:
        new, converter = rename_source_key(key, renamings, converters, prefix, dict(model_names))  # type: ignore[arg-type]
        if converter is not None:
            raise CheckpointError(
                f"load_params: the key {key!r} needs transformers' weight conversion {converter!r} (tensors "
                "merged or split), which load_params does not do; load with `from_pretrained` and `extract`"
            )
        return new

    return rename


def _ignored_unexpected(model: torch.nn.Module, key: str) -> bool:
    """Whether `from_pretrained` ignores the file key `key` that `model` lacks: the patterns of
    `_keys_to_ignore_on_load_unexpected`, and old checkpoints' `rotary_emb.inv_freq` and
    `position_ids` (now non-persistent buffers, computed) when the model has such buffers.
    Never for other modules (their `load_state_dict` reports every unexpected key)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers absent
        return False
    if not isinstance(model, PreTrainedModel):
        return False
    patterns: set[str] = set()
    for sub in model.modules():
        if isinstance(sub, PreTrainedModel):
            patterns.update(sub._keys_to_ignore_on_load_unexpected or ())
    buffers = [n for n, _ in model.named_buffers()]
    if any(b.endswith("rotary_emb.inv_freq") for b in buffers):
        patterns.add(r"rotary_emb\.inv_freq")
    if any(b.endswith("position_ids") for b in buffers):
        patterns.add(r"(^|\.)position_ids$")
    return any(re.search(p, key) for p in patterns)


def _all_names(module: torch.nn.Module) -> dict[str, str]:
    """Every name `state_dict` would give (tied aliases included) -> the `named_state` name."""
    return {**{n: n for n in named_state(module)}, **aliases(module)}


# ---- placement ---------------------------------------------------------------------------
def _check_placement(shardings: ShardingsLike, mesh: Mesh | None, rules: Rules, tensors: Mapping[str, Any]) -> None:
    """Refuse placements that would be ignored silently: `shardings` with `mesh`/`rules`, rules
    without a mesh, and a `shardings` dict naming what the model lacks (a typo would leave it unsharded)."""
    if shardings is not None and (mesh is not None or rules):
        raise ValueError("load_params: give either `shardings=` or `mesh=` with `rules=`, not both")
    if rules and mesh is None:
        raise ValueError("load_params: `rules=` place arrays on a mesh: pass `mesh=` too")
    if isinstance(shardings, Mapping):
        unknown = sorted(set(shardings) - set(tensors))
        if unknown:
            raise ValueError(
                f"load_params: shardings names {unknown}, which the model does not have; its names are "
                f"those of `extract` (e.g. {sorted(tensors)[:4]})"
            )


def _resolve_sharding(
    shardings: ShardingsLike, mesh: Mesh | None, rules: Rules, name: str, struct_: jax.ShapeDtypeStruct
) -> Sharding:
    if mesh is not None:
        spec = spec_for(name, rules)
        if len(spec) > len(struct_.shape):
            raise ValueError(f"load_params: rule spec {spec} has more axes than {name} (shape {struct_.shape})")
        return NamedSharding(mesh, spec)
    chosen: Sharding | None
    if shardings is None:
        chosen = None
    elif isinstance(shardings, Sharding):
        chosen = shardings
    elif isinstance(shardings, Mapping):
        chosen = shardings.get(name)
    else:
        chosen = shardings(name, struct_)
    return chosen if chosen is not None else SingleDeviceSharding(jax.local_devices()[0])


def _divides(name: str, shape: tuple[int, ...], sharding: Sharding, rules: Rules) -> Sharding:
    """`sharding`, after checking that it splits every dimension of the tensor `name` evenly;
    else a `ValueError` naming the tensor, its shape, the mesh's axis sizes and the rule.

    Example:
        ```python
        _divides("lm_head.weight", (50257, 64), NamedSharding(mesh8, P("model")), rules)  # ValueError: 50257 by 8
        ```
    """
    try:
        sharding.shard_shape(shape)
    except ValueError as e:
        spec = getattr(sharding, "spec", None)
        mesh_ = getattr(sharding, "mesh", None)
        axes = dict(mesh_.shape) if mesh_ is not None else None
        rule = next(((p, s) for p, s in rules if re.search(p, name)), None)
        source = f"the rule {rule[0]!r} -> {rule[1]}" if rule else f"the sharding {sharding}"
        raise ValueError(
            f"load_params: {source} splits {name} (shape {tuple(shape)}) as {spec} over mesh axes {axes}, "
            f"which does not divide its dimensions evenly ({e}). Use a rule whose mesh axes divide "
            f"{name}'s dimensions, or a rule for {name} before it that replicates it (PartitionSpec())."
        ) from None
    return sharding


def _build(
    shape: tuple[int, ...],
    read: Callable[[Index], np.ndarray],
    target: np.dtype,
    sharding: Sharding,
    check: Callable[[np.ndarray], None] | None = None,
) -> jax.Array:
    """The global array of one tensor: each distinct slice this process's devices hold is
    read once (`read(index)`), checked (`check`), converted, and handed to JAX (replicas of it reuse it)."""
    cache: dict[tuple, np.ndarray] = {}

    def slice_for(index: Any) -> np.ndarray:
        key = tuple(_bounds(index, shape))
        host = cache.get(key)
        if host is None:
            raw = read(index)
            if check is not None:
                check(raw)
            host = cache[key] = _converted(raw, target)
        return host

    # drop the slices once every local device has its copy
    try:
        return jax.make_array_from_callback(shape, sharding, slice_for, dtype=target)
    finally:
        cache.clear()


def _check_same_values(path: str, a: Entry, b: Entry, key_a: str, key_b: str) -> None:
    """Raise unless the file's tensors `key_a` and `key_b` (two names of one tied model tensor)
    hold the same values: `load_state_dict` would keep the last one it copies, `from_pretrained`
    the tie's source, so differing copies have no one meaning. Compared in blocks of rows."""
    same = a.shape == b.shape and a.dtype == b.dtype
    rows = a.shape[0] if a.shape else 1
    step = max(1, (1 << 24) // max(1, int(np.prod(a.shape[1:], dtype=np.int64)) * a.dtype.itemsize))
    for start in range(0, rows, step) if same else ():
        index = (slice(start, min(rows, start + step)),) if a.shape else ()
        if a.read(index).tobytes() != b.read(index).tobytes():
            same = False
            break
    if not same:
        raise CheckpointError(
            f"load_params({path!r}): the file holds {key_a!r} and {key_b!r}, which are one tied tensor in "
            "the model, with different values: which one is meant is ambiguous (`load_state_dict` keeps the "
            "last it copies, `from_pretrained` the tie's source). Remove one of them from the file, or untie "
            "the weights in the model."
        )


def _range_check(name: str, dtype: torch.dtype) -> Callable[[np.ndarray], None] | None:
    """For a model tensor whose torch dtype JAX holds narrower (int64 as int32 with x64 off): a
    check that raises `Int64Error` for a slice whose values would wrap (torch would hold them)."""
    if narrowed_range(dtype) is None:
        return None

    def check(host: np.ndarray) -> None:
        if host.size:
            check_int_range(host.min(), host.max(), dtype, f"load_params: {name}")

    return check


def _requested_dtype(dtype: Any) -> np.dtype:
    """`dtype=` as a NumPy dtype (a torch dtype, a JAX/NumPy dtype or its name); only floating
    or complex dtypes, as `nn.Module.to(dtype)` accepts."""
    out = np.dtype(to_jax_dtype(dtype)) if isinstance(dtype, torch.dtype) else np.dtype(dtype)
    if not (jnp.issubdtype(out, jnp.floating) or jnp.issubdtype(out, jnp.complexfloating)):
        raise TypeError(
            f"load_params: dtype={dtype!r} is not a floating point or complex dtype; it converts the floating "
            "arrays (like `nn.Module.to(dtype)`): e.g. `dtype=jnp.bfloat16` or `dtype=torch.bfloat16`"
        )
    return out


def _target_dtype(t: torch.Tensor, dtype: Any) -> np.dtype:
    model_dtype = np.dtype(to_jax_dtype(t.dtype))
    if dtype is not None and (t.dtype.is_floating_point or t.dtype.is_complex):
        return _requested_dtype(dtype)
    return model_dtype


class CheckpointKeysWarning(UserWarning):
    """A lenient `load_params` (`strict=False`, Hugging Face models' default) skipped or kept names.

    Attributes: `missing` (model names the file lacks: they keep the module's values) and
    `unexpected` (file names the model does not use).

    **Example:**
        ```python
        import os, tempfile, warnings
        from safetensors.torch import save_file

        path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
        save_file({"weight": torch.ones(1, 3)}, path)                      # no "bias"
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            jaxtorch.load_params(torch.nn.Linear(3, 1), path, strict=False)   # "bias" keeps the module's value
        caught = next(w.message for w in seen if isinstance(w.message, jaxtorch.train.CheckpointKeysWarning))
        assert caught.missing == ["bias"]
        ```
    """

    def __init__(self, path: str, missing: list[str], unexpected: list[str]):
        self.missing, self.unexpected = missing, unexpected
        parts = []
        if unexpected:
            parts.append(f"{len(unexpected)} names in the file are not used by the model: {unexpected}")
        if missing:
            parts.append(f"{len(missing)} model tensors are not in the file and keep the module's values: {missing}")
        super().__init__(
            f"load_params({path!r}): " + "; ".join(parts) + " (as `from_pretrained` reports them); "
            "pass strict=True to raise instead"
        )


def _is_hf(model: torch.nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers absent
        return False
    return isinstance(model, PreTrainedModel)


def _match_names(
    model: torch.nn.Module, path: str, entries: Mapping[str, Entry], wanted: set[str]
) -> tuple[dict[str, str], list[str], list[str]]:
    """`({model name: file key}, missing model names, unexpected file keys)`, names mapped as
    `load_state_dict` / `from_pretrained` map them; a tied tensor found under two names must
    hold the same values in both."""
    names = _all_names(model)
    rename = _hf_renamer(model, {n: True for n in names})
    found: dict[str, str] = {}  # model name -> file key
    unexpected: list[str] = []
    for key in entries:
        name = names.get(key) or names.get(rename(key))
        if name is None or name not in wanted:
            unexpected.append(key)
        elif name not in found:
            found[name] = key
        else:  # a tied tensor under two of its names: fine when both hold the same values
            _check_same_values(path, entries[found[name]], entries[key], found[name], key)
    unexpected = sorted(k for k in unexpected if not _ignored_unexpected(model, k))
    return found, sorted(wanted - set(found)), unexpected


def _kept_values(
    path: str,
    missing: dict[str, torch.Tensor],
    unexpected: list[str],
    mismatched: dict[str, tuple],
    strict: bool,
) -> dict[str, torch.Tensor]:
    """The module's own tensors for the names the file lacks, after the strictness rules: raise
    one `CheckpointKeysError` for shape mismatches (always), for missing or unexpected names
    when `strict`, and for missing names on the meta device (no values to keep); else warn."""
    on_meta = sorted(n for n, t in missing.items() if t.is_meta)
    if mismatched or (strict and (missing or unexpected)) or on_meta:
        lenient_meta = not strict and bool(on_meta)
        raise CheckpointKeysError(path, sorted(missing), unexpected if strict else [], mismatched, on_meta=lenient_meta)
    if missing or unexpected:
        warnings.warn(CheckpointKeysWarning(path, sorted(missing), unexpected), stacklevel=3)
    return missing


def load_params(
    model: torch.nn.Module,
    path: str | os.PathLike,
    *,
    shardings: ShardingsLike = None,
    mesh: Mesh | None = None,
    rules: Rules = (),
    dtype: Any = None,
    strict: bool | None = None,
) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
    """Read a checkpoint into JAX arrays for `model`, each placed (and sharded) as it is read.

    **Arguments:**
    - `model`: the torch module the checkpoint is for, on any device, the meta device
      included (only its names, shapes, dtypes and non-persistent buffers are used).
    - `path`: a `.safetensors` file, a torch `.bin`/`.pt`/`.pth` state dict, or a Hugging Face
      model directory (single file or shards with their `.index.json`).
    - `shardings`: where each array goes: one `jax.sharding.Sharding` for all, a dict
      name -> `Sharding`, or a function `(name, jax.ShapeDtypeStruct) -> Sharding | None`;
      arrays left out go to this process's first device.
    - `mesh`, `rules`: instead of `shardings`, `jaxtorch.train.shard`'s name rules
      (`[(regex, PartitionSpec), ...]`, first match wins, unmatched replicated) on `mesh`.
    - `dtype`: the dtype floating arrays get (e.g. `jnp.bfloat16`), converted slice by
      slice; by default each array gets the model's dtype for it (as `load_state_dict` copies).
    - `strict`: whether names missing from or unexpected in the file raise. By default as the
      model's own loader: `from_pretrained`'s leniency for a Hugging Face model (a `LlamaModel`
      from a `LlamaForCausalLM` checkpoint: its `lm_head` unused), `load_state_dict`'s
      strictness for other modules. When not strict, unused file names are skipped and model
      tensors the file lacks keep the module's own values (a module on the meta device has
      none: that raises), both named in one `CheckpointKeysWarning`.

    **Returns:** `(params, state)` split as `jaxtorch.extract` splits them: the trainable
    parameters, and everything else (buffers, frozen parameters); non-persistent buffers are
    the module's own values, or computed from its code when they are on the meta device.
    Pass them as `fn(params, *args, state=state)` to the function of `extract(model)`.

    Each process reads only the slices its own devices hold (in a multi-process run, its part).
    Shapes that differ, and (when strict) names missing from or unexpected in the file, raise
    one `CheckpointKeysError` listing all of them. A directory is read as `from_pretrained`
    reads it (`hf_weights_file`: `model.safetensors`, then its index, then the `.bin` files).

    **Example:**
        ```python
        import os, tempfile
        from safetensors.torch import save_file

        path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
        save_file(torch.nn.Linear(3, 2).state_dict(), path)
        model = torch.nn.Linear(3, 2)
        params, state = jaxtorch.load_params(model, path)      # or mesh=, rules=: placed as they load
        jaxtorch.load_into(model, params, state)
        ```
    """
    entries = checkpoint_entries(path)
    params_t, state_t = split_state(model)
    tensors = {**params_t, **state_t}
    _check_placement(shardings, mesh, rules, tensors)
    skip = non_persistent_names(model)
    found, missing, unexpected = _match_names(model, str(path), entries, {n for n in tensors if n not in skip})
    mismatched = {
        n: (entries[k].shape, tuple(tensors[n].shape))
        for n, k in found.items()
        if tuple(entries[k].shape) != tuple(tensors[n].shape)
    }
    strict = not _is_hf(model) if strict is None else strict
    kept = _kept_values(str(path), {n: tensors[n] for n in missing}, unexpected, mismatched, strict)

    def _resolve(name: str, struct_: jax.ShapeDtypeStruct) -> Sharding:
        return _divides(name, struct_.shape, _resolve_sharding(shardings, mesh, rules, name, struct_), rules)

    arrays: dict[str, jax.Array] = {}
    for name, key in found.items():
        target = _target_dtype(tensors[name], dtype)
        struct_ = jax.ShapeDtypeStruct(entries[key].shape, target)
        check = _range_check(name, tensors[name].dtype)
        arrays[name] = _build(entries[key].shape, entries[key].read, target, _resolve(name, struct_), check)
    computed = computed_buffers(model, [n for n in tensors if n in skip])
    for name, t in {**kept, **computed}.items():
        target = _target_dtype(t, dtype)
        struct_ = jax.ShapeDtypeStruct(tuple(t.shape), target)
        host = np.asarray(tensor_to_jax(t))  # the module's own, not read: never counted as file bytes
        arrays[name] = _build(struct_.shape, host.__getitem__, target, _resolve(name, struct_))
    return {n: arrays[n] for n in params_t}, {n: arrays[n] for n in state_t}


__all__ = [
    "HF_WEIGHT_FILES",
    "CheckpointKeysError",
    "CheckpointKeysWarning",
    "checkpoint_entries",
    "hf_weights_file",
    "load_params",
    "read_slice",
]
