"""Saving jax-device tensors (`torch.save`, `safetensors`, `save_pretrained`) and their storage queries.

A `JaxTensor`'s data is a `jax.Array`; torch sees a wrapper with no host memory. Here:

- `reduce` (its `__reduce_ex__`): a jax tensor pickles as the CPU tensor holding its values,
  with torch's own rebuild function, so `torch.save` writes a plain CPU checkpoint: it loads
  in a process without jaxtorch (`weights_only=True` included), and `torch.load` gives CPU
  tensors (`model.load_state_dict` copies them onto the jax device; `.to("jax")` moves them).
  A traced value (inside `jaxtorch.compile`/`jit`) cannot be saved: it raises.
- `storage_of` (its `untyped_storage()`): an identity for the root array a tensor reads: a
  byte range of the tensor's size, reserved (never touched, so no memory is committed) and
  unique while the root lives. Tensors that alias one root (views, `detach()`, tied weights)
  share it, so safetensors' and Hugging Face's shared-tensor checks see true aliasing. Its
  bytes are not the data (as a CUDA pointer is not readable from the host): read values with
  `.cpu()` / `.numpy()`.

Example:
    ```python
    torch.save(model.state_dict(), "m.pt")                  # model on the jax device
    sd = torch.load("m.pt", weights_only=True)             # CPU tensors, with or without jaxtorch
    model.load_state_dict(sd)
    ```
"""

from __future__ import annotations

import collections
import copy
import mmap
import sys
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..._compat import (
    make_wrapper_subclass,
    rebuild_from_type_v2,
    rebuild_parameter,
    rebuild_parameter_with_state,
    rebuild_tensor_code,
    rebuild_tensor_v2,
)
from ..core._dtypes import _TORCH_TO_NP, check_int_range, narrowed_range, to_jax_dtype

_TOKENS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # root tensor -> (nbytes, mmap, storage)


def reduce(t: torch.Tensor, protocol: int) -> tuple:
    """`t.__reduce_ex__(protocol)`: the reduction of its CPU copy (torch's `_rebuild_tensor_v2`;
    a parameter, `_rebuild_parameter` around it, as torch saves `nn.Parameter`s), with the
    Python attributes set on `t` (torch's `_rebuild_*_with_state`; jaxtorch's own fields left out).

    Example: `pickle.loads(pickle.dumps(jax_t))` is a CPU tensor equal to `jax_t.cpu()`.
    """
    with torch.no_grad():
        cpu = t.detach().to("cpu")
    state = {k: v for k, v in vars(t).items() if not k.startswith("_jt_") and k != "_is_param"}
    if getattr(t, "_is_param", False):  # `nn.Parameter(jax_tensor)` keeps the jax tensor's class
        if state:
            return (
                rebuild_parameter_with_state,
                (cpu, t.requires_grad, collections.OrderedDict(), state),
            )
        return (rebuild_parameter, (cpu, t.requires_grad, collections.OrderedDict()))
    args: tuple = (
        cpu._typed_storage(),
        cpu.storage_offset(),
        tuple(cpu.size()),
        cpu.stride(),
        t.requires_grad,
        collections.OrderedDict(),
    )
    if state:
        return (rebuild_from_type_v2, (rebuild_tensor_v2, torch.Tensor, args, state))
    return (rebuild_tensor_v2, args)


def storage_of(root: torch.Tensor) -> torch.UntypedStorage:
    """The identity storage of the root tensor `root` (see the module docstring), made once per
    root and size. Example: `storage_of(root(a)) is storage_of(root(a.detach()))`."""
    nbytes = root.numel() * root.element_size()
    entry = _TOKENS.get(root)
    if entry is None or entry[0] != nbytes:
        reserved = mmap.mmap(-1, max(nbytes, 1))  # anonymous: pages are committed only when written
        storage = torch.frombuffer(reserved, dtype=torch.uint8).untyped_storage() if nbytes else torch.UntypedStorage(0)
        entry = (nbytes, reserved, storage)
        _TOKENS[root] = entry
    return entry[2]


def data_ptr(t: torch.Tensor, root: torch.Tensor) -> int:
    """`t.data_ptr()`: its root's identity address plus its storage offset (0 for empty tensors)."""
    if t.numel() == 0:
        return 0
    return int(storage_of(root).data_ptr() + t.storage_offset() * t.element_size())


def deepcopy(t: Any, memo: dict) -> Any:
    """`copy.deepcopy(t)`, as torch does it: a parameter gives a new `nn.Parameter` (a clone,
    same `requires_grad`; no grad, no attributes: `Parameter.__deepcopy__`); a tensor, a clone
    with its `requires_grad`, grad and attributes deep-copied, and only for a graph leaf
    (torch's error otherwise). Memoized: tied tensors stay tied.

    Example: `copy.deepcopy(model)` of a model on the jax device has tied, independent parameters.
    """
    if id(t) in memo:
        return memo[id(t)]
    if getattr(t, "_is_param", False):
        with torch.no_grad():
            param = torch.nn.Parameter(t.detach().clone(), requires_grad=t.requires_grad)
        memo[id(t)] = param
        return param
    if not t.is_leaf:
        raise RuntimeError(
            "Only Tensors created explicitly by the user (graph leaves) support the deepcopy protocol at the "
            "moment.  If you were attempting to deepcopy a module, this may be because of a "
            "torch.nn.utils.weight_norm usage, see https://github.com/pytorch/pytorch/pull/103001"
        )
    with torch.no_grad():
        new = t.clone()
    if t.requires_grad:
        new.requires_grad_(True)
    if t.grad is not None:
        new.grad = copy.deepcopy(t.grad, memo)
    for k, v in vars(t).items():
        if not k.startswith("_jt_"):
            setattr(new, k, copy.deepcopy(v, memo))
    memo[id(t)] = new
    return new


# ---- loading onto the jax device: `torch.load(f, map_location="jax")` ----------------------
# torch restores each storage by its location (`torch.serialization.register_package`), then
# rebuilds tensors with `torch.empty(0, device=storage.device).set_(storage, offset, size, stride)`.
# For "jax" the restored storage is a handle (a jax tensor's own, empty, storage) standing for
# the loaded CPU bytes; `JaxTensor.set_` (`set_from_storage`) turns those bytes into its array.
_PENDING: dict[int, torch.UntypedStorage] = {}  # handle's StorageImpl address -> the CPU bytes


def _jax_tag(obj) -> str | None:
    return None  # (saved jax tensors are CPU tensors in the file: see `reduce`)


def _jax_deserialize(obj, location: str):
    """Restore a storage loaded from the file for `map_location="jax"` (or "jax:N")."""
    if not location.startswith("jax") or _HOLDER_TYPE is None:
        return None
    if getattr(obj, "_torch_load_uninitialized", False):
        # torch's legacy (non-zip) format reads the bytes into the restored storage afterwards,
        # which a jax storage cannot take (it would write past an empty storage: a crash)
        raise RuntimeError(
            "jaxtorch: torch.load(..., map_location='jax') cannot read a file in torch's legacy format "
            "(saved with `_use_new_zipfile_serialization=False` or by torch < 1.6). Load it to the CPU and "
            "move it: `sd = torch.load(f, map_location='cpu')`, then `model.load_state_dict(sd)` or "
            "`{k: v.to('jax') for k, v in sd.items()}` (or re-save it with `torch.save`)."
        )
    cpu = obj if obj.device.type == "cpu" else obj.cpu()
    # an empty storage on the jax device (a wrapper's own, with no bytes): torch reads its device
    holder: torch.Tensor = make_wrapper_subclass(
        _HOLDER_TYPE, (0,), dtype=torch.uint8, device=torch.device("jax", 0), storage_size=0
    )
    handle = torch.Tensor.untyped_storage(holder)
    key = handle._cdata
    _PENDING[key] = cpu
    weakref.finalize(handle, _PENDING.pop, key, None)
    return handle


def pending_bytes(source) -> torch.UntypedStorage | None:
    """The CPU bytes a storage handle from `_jax_deserialize` stands for (None: not such a handle)."""
    if isinstance(source, torch.TypedStorage):
        source = source._untyped_storage
    if not isinstance(source, torch.UntypedStorage):
        return None
    return _PENDING.get(source._cdata)


def loaded_array(cpu_bytes: torch.UntypedStorage, dtype: torch.dtype, offset: int, size, stride) -> jax.Array:
    """The jax array of the tensor `(dtype, offset, size, stride)` over the loaded bytes.

    The bytes are read in the dtype the file holds (`_file_dtype`), and never narrowed
    silently: float64 without JAX's 64-bit mode raises `Float64Error`, int64 values outside
    the int32 range `Int64Error`, as `.to("jax")` of the same CPU tensor does."""
    dtype = _file_dtype(dtype)
    host = torch.empty((0,), dtype=dtype).set_(cpu_bytes, offset, size, stride).contiguous()
    jax_dtype = to_jax_dtype(dtype)
    if dtype in _NUMPY_DTYPES:
        values = host.numpy()
    else:  # (bfloat16, float8s, uint16-64: their bits, read as the same NumPy/ml_dtypes type)
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[host.element_size()]
        values = host.view(bits).numpy().view(_TORCH_TO_NP[dtype])
    if values.size and narrowed_range(dtype) is not None:
        check_int_range(values.min(), values.max(), dtype, "torch.load(..., map_location='jax')")
    return jnp.asarray(values, dtype=jax_dtype)


def _file_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the storage torch is rebuilding a tensor from (`torch._utils._rebuild_tensor`'s
    `storage.dtype`): `dtype` unless the jax placeholder torch made for it was narrowed (a
    zero-element float64 placeholder is float32 without 64-bit mode), whose bytes are still float64."""
    frame = sys._getframe(1)
    for _ in range(8):
        if frame is None:
            break
        if frame.f_code is rebuild_tensor_code:
            storage = frame.f_locals.get("storage")
            return getattr(storage, "dtype", dtype)
        frame = frame.f_back  # type: ignore[assignment]
    return dtype


_NUMPY_DTYPES = frozenset(
    {
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.float32,
        torch.float64,
        torch.complex64,
        torch.complex128,
    }
)
_HOLDER_TYPE: type | None = None  # the jax tensor class (its wrappers carry the jax device)


def install(tensor_type: type) -> None:
    """Let `torch.load(..., map_location="jax")` restore storages (called once by `_tensor`)."""
    global _HOLDER_TYPE
    if _HOLDER_TYPE is None:
        _HOLDER_TYPE = tensor_type
        torch.serialization.register_package(5, _jax_tag, _jax_deserialize)
