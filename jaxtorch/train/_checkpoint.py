"""Checkpoints of training state: `save_checkpoint` / `load_checkpoint`, on safetensors.

One checkpoint is one `.safetensors` file. Its arrays are the tensors (named `"0"`,
`"1"`, ...); the pytree that held them is a JSON description in the header metadata:
dicts, lists, tuples, namedtuples (optax states, `TrainState`), `None`, and Python
scalars (int, float, bool, str). Nothing in the file is ever executed on load: no pickle,
no imports; a namedtuple comes back as the class of that name if it is already imported
and has the same fields, otherwise as an equivalent `collections.namedtuple`.

Saving writes a temporary file beside the target and renames it over the target only
when it is complete, so a save that fails midway leaves the previous checkpoint intact.
A SHA-256 of the tensor bytes is stored in the header, so a truncated or corrupted file
raises `CheckpointError` naming the path instead of loading garbage.

Example:
    ```python
    save_checkpoint(state, "run/ckpt.safetensors")
    state = load_checkpoint("run/ckpt.safetensors")
    ```
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, NoReturn

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import safetensors
import safetensors.numpy

from ..bridge.core._errors import CheckpointError

FORMAT = "jaxtorch.checkpoint/1"

# NumPy dtypes safetensors.numpy cannot read back: stored as same-width unsigned views.
_VIEWED = {
    np.dtype(ml_dtypes.bfloat16): np.uint16,
    np.dtype(ml_dtypes.float8_e4m3fn): np.uint8,
    np.dtype(ml_dtypes.float8_e5m2): np.uint8,
}
_NAMED_DTYPES = {str(d): d for d in _VIEWED}


# ---- tree <-> JSON ---------------------------------------------------------------------
def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def _encode(node: Any, path: str, arrays: list) -> dict:
    """JSON description of `node`; array leaves are appended to `arrays` (as host NumPy)."""
    if node is None:
        return {"t": "none"}
    if isinstance(node, bool):
        return {"t": "bool", "v": node}
    if isinstance(node, int):
        return {"t": "int", "v": node}
    if isinstance(node, float):
        return {"t": "float", "v": repr(node)}
    if isinstance(node, str):
        return {"t": "str", "v": node}
    if isinstance(node, (jax.Array, np.ndarray, np.generic)):
        return _encode_array(node, path, arrays)
    if _is_namedtuple(node):
        cls = type(node)
        return {
            "t": "namedtuple",
            "cls": f"{cls.__module__}:{cls.__qualname__}",
            "fields": list(cls._fields),
            "c": [_encode(v, f"{path}.{f}", arrays) for f, v in zip(cls._fields, node)],
        }
    if type(node) in (list, tuple):
        return {"t": type(node).__name__, "c": [_encode(v, f"{path}[{i}]", arrays) for i, v in enumerate(node)]}
    if type(node) is dict:
        keys = list(node)
        for k in keys:
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise TypeError(f"save_checkpoint: dict key {k!r} at {path or 'the root'} is not a str or int.")
        return {
            "t": "dict",
            "k": [[type(k).__name__, k] for k in keys],
            "c": [_encode(node[k], f"{path}[{k!r}]", arrays) for k in keys],
        }
    return _bad(node, path)


def _bad(node: Any, path: str) -> NoReturn:
    raise TypeError(
        f"save_checkpoint: cannot store a {type(node).__qualname__} at {path or 'the root'}; supported: dict, list, "
        "tuple, namedtuple (optax states included), None, int, float, bool, str, jax/NumPy arrays, PRNG keys."
    )


def _encode_array(x: Any, path: str, arrays: list) -> dict:
    node: dict = {"t": "array", "i": len(arrays), "np": isinstance(x, (np.ndarray, np.generic))}
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        node["key_impl"] = str(jax.random.key_impl(x))
        x = jax.random.key_data(x)
    host = _gather(x)
    node["shape"] = list(host.shape)  # safetensors stores 0-d tensors as shape (1,)
    if host.dtype in _VIEWED:
        node["dtype"] = str(host.dtype)
        host = host.view(_VIEWED[host.dtype])
    arrays.append(np.ascontiguousarray(host))
    return node


def _gather(x: Any) -> np.ndarray:
    """The whole value of a (possibly sharded, possibly multi-process) array on the host."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def _decode(node: dict, arrays: dict, shardings: Any, path: str) -> Any:
    t = node["t"]
    if t == "none":
        return None
    if t in ("bool", "int", "str"):
        return node["v"]
    if t == "float":
        return float(node["v"])
    if t == "array":
        return _decode_array(node, arrays, shardings, path)
    if t in ("list", "tuple"):
        kids = [_decode(c, arrays, _sub(shardings, i), f"{path}[{i}]") for i, c in enumerate(node["c"])]
        return kids if t == "list" else tuple(kids)
    if t == "namedtuple":
        cls = _namedtuple_class(node["cls"], node["fields"])
        return cls(
            *[
                _decode(c, arrays, _sub(shardings, i), f"{path}.{f}")
                for i, (f, c) in enumerate(zip(node["fields"], node["c"]))
            ]
        )
    if t == "dict":
        keys = [int(v) if kind == "int" else str(v) for kind, v in node["k"]]
        return {k: _decode(c, arrays, _sub(shardings, k), f"{path}[{k!r}]") for k, c in zip(keys, node["c"])}
    raise CheckpointError(f"unknown node type {t!r} at {path or 'the root'}")


def _sub(shardings: Any, key: Any) -> Any:
    """The part of a `shardings` tree under `key` (a single Sharding applies everywhere)."""
    if shardings is None or isinstance(shardings, jax.sharding.Sharding):
        return shardings
    try:
        return shardings[key]
    except (KeyError, IndexError, TypeError):
        return None


def _decode_array(node: Any, arrays: Any, sharding: Any, path: Any) -> Any:
    host = arrays[str(node["i"])].reshape(node["shape"])
    if "dtype" in node:
        host = host.view(_NAMED_DTYPES[node["dtype"]])
    if node.get("np"):
        return host.copy()
    if isinstance(sharding, jax.Array):
        sharding = sharding.sharding
    if isinstance(sharding, jax.sharding.Sharding):
        out = jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])
    else:  # committed, like jit outputs: a resumed step reuses the compiled step
        out = jax.device_put(host, jax.local_devices()[0])
    if "key_impl" in node:
        out = jax.random.wrap_key_data(out, impl=node["key_impl"])
    return out


_synthesized: dict = {}


def _namedtuple_class(qualified: str, fields: list[str]) -> type:
    """The already-imported namedtuple class `module:qualname` with these fields, else a stand-in."""
    module_name, _, qualname = qualified.partition(":")
    obj = sys.modules.get(module_name)  # never imports: loading runs no code from the file
    for part in qualname.split("."):
        obj = getattr(obj, part, None) if obj is not None else None
    if isinstance(obj, type) and issubclass(obj, tuple) and list(getattr(obj, "_fields", ())) == list(fields):
        return obj
    key = (qualified, tuple(fields))
    if key not in _synthesized:
        name = qualname.split(".")[-1]
        _synthesized[key] = collections.namedtuple(name if name.isidentifier() else "Record", fields, rename=True)
    return _synthesized[key]


def _digest(arrays: list[np.ndarray] | dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    items = arrays if isinstance(arrays, list) else [arrays[str(i)] for i in range(len(arrays))]
    for a in items:
        h.update(str((a.dtype.str, a.shape)).encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


# ---- public API --------------------------------------------------------------------------
def save_checkpoint(state: Any, path: str | os.PathLike) -> None:
    """Save a pytree of arrays and Python scalars to `path` (one safetensors file), atomically.

    Sharded arrays are gathered first; in a multi-process run every process must call
    this (the gather is collective) and process 0 writes the file.

    **Arguments:**
    - `state`: dicts, lists, tuples, namedtuples (a `TrainState`, optax states), `None`,
      Python scalars, jax/NumPy arrays, typed PRNG keys.
    - `path`: the file to write; its directory is created if needed. An existing file
      there is replaced only once the new one is completely written.

    **Returns:** None.

    **Example:**
        ```python
        import os, tempfile, optax

        params = {"w": jnp.ones((2, 3))}
        path = os.path.join(tempfile.mkdtemp(), "ckpt.safetensors")
        jaxtorch.save_checkpoint({"params": params, "opt": optax.adam(1e-3).init(params), "epoch": 3}, path)
        restored = jaxtorch.load_checkpoint(path)
        assert restored["epoch"] == 3 and (restored["params"]["w"] == 1).all()
        ```
    """
    path = Path(path)
    arrays: list[np.ndarray] = []
    tree = _encode(state, "", arrays)  # validates everything before touching the disk
    if jax.process_index() != 0:
        return
    meta = {"format": FORMAT, "tree": json.dumps(tree), "sha256": _digest(arrays)}
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.close(fd)
        safetensors.numpy.save_file({str(i): a for i, a in enumerate(arrays)}, tmp, metadata=meta)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def load_checkpoint(path: str | os.PathLike, *, shardings: Any = None) -> Any:
    """Load a checkpoint written by `save_checkpoint`.

    **Arguments:**
    - `path`: the checkpoint file.
    - `shardings`: where to place the arrays: one `jax.sharding.Sharding` for all, or a
      pytree shaped like the saved state whose leaves are shardings or arrays (their
      sharding is used, e.g. a freshly sharded state); `None` leaves arrays on the
      default device.

    **Returns:** the saved pytree, arrays as `jax.Array`s (NumPy arrays stay NumPy).

    **Raises:** `CheckpointError` (naming `path`) for a missing, truncated, corrupted
    or foreign file.

    **Example:**
        ```python
        import os, tempfile

        path = os.path.join(tempfile.mkdtemp(), "ckpt.safetensors")
        jaxtorch.save_checkpoint({"w": jnp.arange(4.0), "step": 7}, path)
        state = jaxtorch.load_checkpoint(path)              # or shardings=: a pytree of shardings
        assert state["step"] == 7 and state["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
        ```
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    try:
        with safetensors.safe_open(str(path), framework="np") as f:
            meta = f.metadata() or {}
            arrays = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:
        raise CheckpointError(f"{path} is not a readable safetensors checkpoint (truncated or corrupted?): {e}") from e
    if meta.get("format") != FORMAT:
        raise CheckpointError(
            f"{path} is a safetensors file but not a jaxtorch checkpoint (format {meta.get('format')!r})"
        )
    if _digest(arrays) != meta.get("sha256"):
        raise CheckpointError(f"{path} is corrupted: its tensor data does not match the checksum in its header")
    try:
        tree = json.loads(meta["tree"])
        return _decode(tree, arrays, shardings, "")
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from e
    except (KeyError, ValueError, TypeError) as e:
        raise CheckpointError(f"{path} has a malformed tree description: {e}") from e


__all__ = ["CheckpointError", "load_checkpoint", "save_checkpoint"]
