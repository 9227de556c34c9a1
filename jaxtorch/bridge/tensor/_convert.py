"""Every conversion between torch values and JAX values happens here.

Two kinds of conversion:
- `jax_view` / `torch_view`: no copy. `torch_view` wraps each `jax.Array` of a nested
  structure in a `JaxTensor`; `jax_view` unwraps each `JaxTensor` back to its array.
- `to_jax` / `to_torch`: plain CPU `torch.Tensor` <-> `jax.Array`, zero copy whenever the
  layout allows (NumPy's buffer protocol one way, DLPack the other); non-contiguous
  tensors are made contiguous first. `to_jax` gives views; `tensor_to_jax` (what
  `.to("jax")`, `copy_` and `extract` use) gives snapshots that never change afterwards.

Both walk arbitrary nesting with the one container registry (`pytrees.py`, i.e. JAX's
`jax.tree_util` with torch tensors as leaves): list, tuple, dict, namedtuple, dataclasses,
`torch.return_types.*`, Hugging Face `ModelOutput` and caches, any type registered with
`jax.tree_util`, None, Python scalars, and dtypes (`torch.float32` <-> `jnp.float32`).

Example:
    ```python
    x = to_jax(torch.arange(4.0))            # jax.Array sharing the tensor's memory
    t = torch_view({"a": x, "b": [x, 2]})    # {"a": JaxTensor, "b": [JaxTensor, 2]}
    ```
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from ..core._dtypes import check_int_range, holds, scalar_jax_dtype, to_jax_dtype, to_torch_dtype, x64_enabled
from ..core._pytrees import tree_map  # the one registry of containers (jax.tree_util, tensors as leaves)
from ._tensor import JaxTensor


def _is_dtype_like(x) -> bool:
    """np.dtype, NumPy scalar types, and JAX scalar types such as `jnp.float32`."""
    if isinstance(x, np.dtype):
        return True
    if isinstance(x, type) and issubclass(x, np.generic):
        return True
    return type(x).__name__ == "_ScalarMeta" and isinstance(getattr(x, "dtype", None), np.dtype)


def _is_jax_array(x) -> bool:
    return isinstance(x, (jax.Array, jax.core.Tracer))


# ---- no-copy views ------------------------------------------------------------------
_INT32 = np.dtype("int32")


def _torch_view_leaf(x):
    if _is_jax_array(x):
        # JAX's default integer (int32 without x64) is torch's (int64): token ids, labels and indices
        # handed to torch code are `long`, as torch code (one_hot, cross_entropy) expects
        if x.dtype == _INT32 and not x64_enabled():
            return JaxTensor(x, dtype=torch.int64)
        return JaxTensor(x)
    if _is_dtype_like(x):
        return to_torch_dtype(getattr(x, "dtype", x))
    return x


def _jax_view_leaf(x):
    if isinstance(x, JaxTensor):
        return x.elem
    if isinstance(x, torch.dtype):
        return to_jax_dtype(x)
    return x


def torch_view(tree: Any) -> Any:
    """Wrap every `jax.Array` in `tree` as a `JaxTensor` (no copy); dtypes become torch dtypes.

    Without x64 an int32 array (JAX's default integer) is viewed as `torch.int64` (torch's), as
    `call_torch` and `extract`'s `fn` hand their inputs to torch code; `to_torch` copies it as int32."""
    return tree_map(_torch_view_leaf, tree)


def jax_view(tree: Any) -> Any:
    """Unwrap every `JaxTensor` in `tree` to its `jax.Array` (no copy); dtypes become NumPy dtypes."""
    return tree_map(_jax_view_leaf, tree)


# ---- real conversions -----------------------------------------------------------------
_SMALL = 1 << 16  # bytes: below this a snapshot is a plain copy (cheaper than copy-on-write)
_BY_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_WIDE_INTS = (torch.int64, torch.uint64)  # held in 32 bits without x64


def _host_view(t: torch.Tensor) -> np.ndarray:
    """A NumPy array sharing the memory of the contiguous CPU tensor `t`, in `t`'s dtype.

    bfloat16 and float8 go through an integer view of the same size (NumPy's `ml_dtypes`).
    """
    want = _np_dtype(t.dtype)
    try:
        host = t.numpy()
    except TypeError:  # no NumPy dtype in torch's own mapping
        host = t.view(_BY_SIZE[t.element_size()]).numpy()
    return host if host.dtype == want else host.view(want)


class _Frozen:
    """NumPy's view of memory that torch's copy-on-write keeps unchanged; holds it alive."""

    def __init__(self, ptr: int, shape: tuple, typestr: str, keep: torch.Tensor):
        self.__array_interface__ = {"data": (ptr, False), "shape": shape, "typestr": typestr, "version": 3}
        self.keep = keep  # the copy-on-write alias that owns the memory while JAX reads it


def _frozen_host(t: torch.Tensor) -> np.ndarray | None:
    """A NumPy view of `t`'s memory that no later torch write can change, or None.

    `torch._lazy_clone` makes the storage copy-on-write: the next write through any tensor
    on it (an optimizer step, BatchNorm statistics, `load_state_dict`, `add_`) first copies
    the data, and the old memory, held by the clone, stays as it was. Reads do not copy.
    Storages torch does not own (`from_numpy`, mmap, DLPack) cannot be made copy-on-write.
    """
    lazy_clone = getattr(torch, "_lazy_clone", None)
    if lazy_clone is None or not hasattr(t, "const_data_ptr"):  # older torch: the caller copies
        return None
    ptr = t.const_data_ptr()  # the read-only accessor: does not trigger a copy-on-write copy
    try:
        keep = lazy_clone(t)
    except RuntimeError:
        return None
    if keep.const_data_ptr() != ptr:  # pragma: no cover - a copy was made after all
        return None
    size = t.element_size()
    base = np.asarray(_Frozen(ptr, tuple(t.shape), np.dtype(f"<u{size}" if size > 1 else "u1").str, keep))
    return base.view(_np_dtype(t.dtype))


def _host_snapshot(t: torch.Tensor) -> np.ndarray:
    """NumPy data with `t`'s current values that no later torch write can change: the same memory
    made copy-on-write where possible (no copy), else a copy."""
    if t.numel() * t.element_size() >= _SMALL:
        frozen = _frozen_host(t)
        if frozen is not None:
            return frozen
    return np.array(_host_view(t), copy=True)


def tensor_to_jax(t: torch.Tensor, device: jax.Device | None = None, *, share: bool = False) -> jax.Array:
    """A plain torch tensor -> `jax.Array` with the values `t` holds now.

    With `share=False` (the default: `.to("jax")`, `copy_`, `extract`, constants) the result
    never changes afterwards, whatever torch writes to `t`: when JAX's device is the CPU it
    reads `t`'s memory made copy-on-write (no copy; torch's next write to `t` copies first),
    otherwise it gets a copy. With `share=True` (`to_jax`) it is a view: JAX reads `t`'s
    memory as it is (zero copy on the CPU), so later writes to `t` show through.

    Like `jnp.asarray`, the result is uncommitted (JAX may move it to where the computation
    runs) unless `device` is given.
    """
    if isinstance(t, JaxTensor):
        return t.elem
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    # float64 without x64 raises, except a 0-dim scalar (see `dtypes`)
    target = np.dtype(to_jax_dtype(t.dtype) if t.numel() and t.dim() else scalar_jax_dtype(t.dtype))
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()  # new memory nothing else writes: sharing it is a snapshot
        share = True
    if target != _np_dtype(t.dtype):  # int64 stored as int32 without x64: a converted copy
        host = _host_view(t)
        if host.size and t.dtype in _WIDE_INTS:  # never wrap: out-of-range values raise Int64Error
            check_int_range(int(host.min()), int(host.max()), t.dtype, "a tensor converted to JAX")
        host = host.astype(target)
    else:
        host = _host_view(t) if share else _host_snapshot(t)
    return jax.device_put(host, device)


def _np_dtype(dtype: torch.dtype) -> np.dtype:
    from ..core._dtypes import _TORCH_TO_NP

    return _TORCH_TO_NP[dtype]


def array_to_torch(a, *, copy: bool = True, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A `jax.Array` -> plain CPU `torch.Tensor`.

    With `copy=False` the tensor may share the array's memory (DLPack): only for callers
    that read it at once (`dst.copy_(array_to_torch(a, copy=False))`), since a torch write
    to it would change a JAX array, which must never change. torch cannot make memory it
    did not allocate copy-on-write, so the default copies. `dtype` is the torch dtype of the
    tensor the array came from, when the array stores it (a `torch.int64` tensor held as
    int32 without x64 comes back `torch.int64`); by default, the array's own dtype.
    """
    if isinstance(a, jax.core.Tracer):
        from ..core._errors import DataDependentError

        raise DataDependentError("conversion to a CPU torch.Tensor", "A traced value has no data yet.")
    a = jnp.asarray(a)
    want = dtype if dtype is not None and holds(dtype, a.dtype) else to_torch_dtype(a.dtype)
    try:
        if not a.is_fully_addressable or len(a.sharding.device_set) > 1:
            raise ValueError
        t = torch.from_dlpack(a)
        if copy:
            t = t.clone()
    except Exception:
        host = np.asarray(a)
        if host.dtype == np.dtype(jnp.bfloat16):
            t = torch.from_numpy(host.view(np.int16).copy()).view(torch.bfloat16)
        else:
            t = torch.from_numpy(np.array(host, copy=True))
    if t.dtype != want:
        t = t.to(want)
    return t


def _to_jax_leaf(x):
    if isinstance(x, torch.Tensor):
        return tensor_to_jax(x, share=True)
    if isinstance(x, torch.dtype):
        return to_jax_dtype(x)
    return x


def _to_torch_leaf(x):
    if isinstance(x, JaxTensor):
        return array_to_torch(x.elem, dtype=x.dtype)
    if _is_jax_array(x):
        return array_to_torch(x)
    if _is_dtype_like(x):
        return to_torch_dtype(getattr(x, "dtype", x))
    return x


def to_jax(tree: Any) -> Any:
    """Convert every torch tensor in `tree` to a `jax.Array` (zero-copy for contiguous CPU tensors).

    The arrays are views: on the CPU they read the tensors' memory, so a later in-place
    write to a tensor shows in its array. For arrays that never change, take them from a
    module with `extract`, or convert a `.clone()`. Like `jnp.asarray`'s, the arrays are
    not committed to a device, so they mix with other JAX arrays without recompiling.

    **Example:**
        ```python
        t = torch.arange(6.0).reshape(2, 3)
        a = jaxtorch.to_jax(t)         # shares t's memory
        b = jaxtorch.to_jax(t.T)       # non-contiguous: copied into a contiguous array
        ```
    """
    return tree_map(_to_jax_leaf, tree)


def to_torch(tree: Any) -> Any:
    """Convert every `jax.Array` (or `JaxTensor`) in `tree` to a plain CPU `torch.Tensor`.

    The tensors are copies: writing to them in place never changes the JAX arrays.

    **Example:**
        ```python
        t = jaxtorch.to_torch({"w": jnp.ones(3)})   # {"w": tensor([1., 1., 1.])}
        ```
    """
    return tree_map(_to_torch_leaf, tree)


__all__ = ["jax_view", "torch_view", "to_jax", "to_torch", "tensor_to_jax", "array_to_torch", "tree_map", "x64_enabled"]
