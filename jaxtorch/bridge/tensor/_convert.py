"""Every conversion between torch values and JAX values happens here.

Two kinds of conversion:
- `jax_view` / `torch_view`: no copy. `torch_view` wraps each `jax.Array` of a nested
  structure in a `JaxTensor`; `jax_view` unwraps each `JaxTensor` back to its array.
- `to_jax` / `to_torch`: plain CPU `torch.Tensor` <-> `jax.Array`. Every torch tensor
  jaxtorch reads (`to_jax`, `.to("jax")`, `copy_`, `extract`, train-step batches,
  `shard_batch`/`DeviceLoader`, `jaxtorch.compile` inputs, tensors a `call_torch` function
  closes over) is read as a snapshot by `tensor_to_jax`: a write the caller makes after the
  call returns never changes the array, even while JAX's asynchronous dispatch still reads
  it. Large tensors are made copy-on-write (no copy), small ones copied. `to_torch` copies.

Both walk arbitrary nesting with the one container registry (`pytrees.py`, i.e. JAX's
`jax.tree_util` with torch tensors as leaves): list, tuple, dict, namedtuple, dataclasses,
`torch.return_types.*`, Hugging Face `ModelOutput` and caches, any type registered with
`jax.tree_util`, None, Python scalars, and dtypes (`torch.float32` <-> `jnp.float32`).

Example:
    ```python
    x = to_jax(torch.arange(4.0))            # jax.Array with the tensor's values now
    t = torch_view({"a": x, "b": [x, 2]})    # {"a": JaxTensor, "b": [JaxTensor, 2]}
    ```
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from ..._compat import ShapedArray, Tracer, lazy_clone, pytype_aval_mappings, register_canonicalize_value_handler
from ..core._dtypes import check_int_range, holds, scalar_jax_dtype, to_jax_dtype, to_torch_dtype, x64_enabled
from ..core._errors import MetaTensorError
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
    return isinstance(x, (jax.Array, Tracer))


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
    `call_torch` and `extract`'s `fn` hand their inputs to torch code; `to_torch` copies it as int32.

    **Arguments:**
    - `tree`: a pytree whose `jax.Array`s are wrapped; other leaves are kept.

    **Returns:** `tree` with each `jax.Array` replaced by a `JaxTensor` on the `jax` device sharing its memory.

    **Example:**
        ```python
        t = jaxtorch.torch_view(jnp.arange(3))
        assert t.device.type == "jax" and t.dtype == torch.int64   # JAX's int32 seen as torch's int64
        ```
    """
    return tree_map(_torch_view_leaf, tree)


def jax_view(tree: Any) -> Any:
    """Unwrap every `JaxTensor` in `tree` to its `jax.Array` (no copy); dtypes become NumPy dtypes.

    **Arguments:**
    - `tree`: a pytree whose `JaxTensor`s are unwrapped; other leaves are kept.

    **Returns:** `tree` with each `JaxTensor` replaced by the `jax.Array` (or tracer) it holds.

    **Example:**
        ```python
        t = torch.ones(2, 3, device="jax")
        a = jaxtorch.jax_view(t)               # the very array the tensor holds
        assert isinstance(a, jax.Array) and a.shape == (2, 3)
        ```
    """
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


def _file_mapping(ptr: int) -> tuple[int, int] | None:
    """The address range of the private memory map of a file that `ptr` lies in
    (`from_pretrained`'s safetensors weights, `torch.load(mmap=True)`), from `/proc/self/maps`;
    None for other memory (or where there is no such file)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split()
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                if lo <= ptr < hi:
                    private_file = fields[1].endswith("p") and fields[4] != "0" and fields[5:6] != []
                    return (lo, hi) if private_file and fields[5].startswith("/") else None
    except OSError:
        pass
    return None


def _page_out(t: torch.Tensor, region: tuple[int, int]) -> None:
    """Tell the kernel the pages of `t`'s file-mapped memory can be reclaimed now
    (`madvise(MADV_PAGEOUT)`): clean pages are dropped (reread from the file if torch reads
    them again), written ones are kept. A hint only: no value changes."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        # whole 2 MiB blocks: the page cache may hold the file in large folios, which are only
        # reclaimed when the range covers them (neighbouring weights are reread if used)
        block = 1 << 21
        start = max(t.data_ptr() // block * block, region[0])  # within the file's map only
        end = min(-(-(t.data_ptr() + t.numel() * t.element_size()) // block) * block, region[1])
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), 21)  # MADV_PAGEOUT (Linux 5.4+)
    except (OSError, AttributeError):  # pragma: no cover - no libc / no madvise: only memory is at stake
        pass


def _aligned_copy(host: np.ndarray) -> np.ndarray:
    """A copy of `host` in 64-byte-aligned memory, which JAX's CPU client adopts without a second copy."""
    raw = np.empty(host.nbytes + 64, np.uint8)
    start = (-raw.ctypes.data) % 64
    out = raw[start : start + host.nbytes].view(host.dtype).reshape(host.shape)
    np.copyto(out, host)
    return out


def _host_snapshot(t: torch.Tensor) -> np.ndarray:
    """NumPy data with `t`'s current values that no later torch write can change: the same memory
    made copy-on-write where possible (no copy), else a copy.

    Memory torch does not own cannot be made copy-on-write. When it is a private map of a file
    (`from_pretrained`'s weights), the copy is made once, aligned so that JAX adopts it, and the
    mapped pages are then paged out, so the process does not hold the weights twice (torch
    rereads them from the file if it uses them again)."""
    if t.numel() * t.element_size() >= _SMALL:
        frozen = _frozen_host(t)
        if frozen is not None:
            return frozen
        region = _file_mapping(t.data_ptr())
        if region is not None:
            copy = _aligned_copy(_host_view(t))
            _page_out(t, region)
            return copy
    return np.array(_host_view(t), copy=True)


def cast_on_host(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t.to(dtype)` for a CPU tensor: torch's cast (its rounding), on the host. When `t` lies in a
    private map of a file (`from_pretrained(..., dtype=)`'s weights), its pages are paged out after
    the cast, as `tensor_to_jax` does after its copy: the process never holds the weights in both
    dtypes. `t` itself when it has the dtype already.

    **Example:** `cast_on_host(torch.ones(2), torch.bfloat16)` is `tensor([1., 1.], dtype=torch.bfloat16)`.
    """
    if t.dtype == dtype or t.device.type != "cpu":
        return t if t.dtype == dtype else t.to(dtype)
    out = t.to(dtype)
    if t.numel() * t.element_size() >= _SMALL and t.layout is torch.strided:
        region = _file_mapping(t.data_ptr())
        if region is not None:
            _page_out(t, region)
    return out


def tensor_to_jax(t: torch.Tensor, device: jax.Device | None = None, *, share: bool = False) -> jax.Array:
    """A plain torch tensor -> `jax.Array` with the values `t` holds now.

    With `share=False` (the default: `.to("jax")`, `copy_`, `extract`, constants) the result
    never changes afterwards, whatever torch writes to `t`: when JAX's device is the CPU it
    reads `t`'s memory made copy-on-write (no copy; torch's next write to `t` copies first),
    otherwise it gets a copy. With `share=True` (`to_jax`) it is a view: JAX reads `t`'s
    memory as it is (zero copy on the CPU), so later writes to `t` show through (for callers
    that read the array at once; `to_jax` gives snapshots).

    Tensors with no dense data JAX could hold (sparse, quantized, nested, MKL-DNN) raise a
    `TypeError` naming the layout and the conversion to make first; a meta tensor raises
    `MetaTensorError` (a `ValueError`) naming the ways to give it values.

    Like `jnp.asarray`, the result is uncommitted (JAX may move it to where the computation
    runs) unless `device` is given.
    """
    if isinstance(t, JaxTensor):
        return t.elem
    if t.device.type == "meta":
        raise MetaTensorError("jaxtorch's conversion to a jax.Array", tuple(t.shape), t.dtype)
    _check_dense(t)
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


def _unreadable(t: torch.Tensor) -> str | None:
    """Why `t` has no dense data to give JAX (and what to do), or None."""
    if t.is_nested:
        return f"a nested (jagged) tensor of dtype {t.dtype} has no one shape: pad it first (`t.to_padded_tensor(0.0)`)"
    what = f"a torch.Tensor of shape {tuple(t.shape)} and dtype {t.dtype}"
    if t.layout is not torch.strided:
        name = str(t.layout).removeprefix("torch.")
        return f"{what} has the {name} layout; JAX arrays are dense: convert `t.to_dense()` first"
    if t.is_quantized:
        return f"{what} is quantized; JAX has no quantized arrays: convert `t.dequantize()` first"
    if t.device.type == "meta":
        return f"{what} is on the meta device: it has a shape but no data; create it on the CPU"
    return None


def _check_dense(t: torch.Tensor) -> None:
    """Raise a `TypeError` naming the problem when `t` cannot become a `jax.Array`.

    **Example:** `_check_dense(torch.eye(3).to_sparse())` raises: "... sparse_coo layout ...".
    """
    if t.layout is torch.strided and t.device.type != "meta" and not t.is_quantized and not t.is_nested:
        return
    why = _unreadable(t)
    if why is not None:
        raise TypeError(f"jaxtorch: cannot convert to a jax.Array: {why}.")


def module_tensor_to_jax(t: torch.Tensor) -> Any:
    """A module's parameter or buffer as `extract` gives it: `tensor_to_jax(t)`, or, for a
    tensor on the meta device (a model built under `torch.device("meta")`, which has no data),
    a `jax.ShapeDtypeStruct` of its shape and dtype: enough for `jax.eval_shape` and
    `jax.jit(fn).lower`, and a placeholder for the arrays `jaxtorch.load_params` reads.

    **Example:**
        ```python
        with torch.device("meta"):
            w = torch.nn.Linear(4, 2).weight
        module_tensor_to_jax(w)    # ShapeDtypeStruct(shape=(2, 4), dtype=float32)
        ```
    """
    if isinstance(t, torch.Tensor) and not isinstance(t, JaxTensor) and t.device.type == "meta":
        return jax.ShapeDtypeStruct(tuple(t.shape), np.dtype(to_jax_dtype(t.dtype)))
    return tensor_to_jax(t)


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
    if isinstance(a, Tracer):
        from ..core._errors import DataDependentError

        raise DataDependentError("conversion to a CPU torch.Tensor", "A traced value has no data yet.")
    _check_not_key(a)
    a = jnp.asarray(a)
    want = dtype if dtype is not None and holds(dtype, a.dtype) else to_torch_dtype(a.dtype)
    try:
        devices = a.sharding.device_set
        if not a.is_fully_addressable or len(devices) > 1 or next(iter(devices)).platform != "cpu":
            raise ValueError  # (DLPack of a GPU array would give a CUDA tensor: this returns CPU tensors)
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


def _check_not_key(a) -> None:
    """Typed PRNG keys (`jax.random.key(0)`) have no torch dtype: raise a `TypeError` saying so."""
    dtype = getattr(a, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        raise TypeError(
            f"jaxtorch: cannot convert a JAX PRNG key array ({dtype}, shape {tuple(a.shape)}) to a torch.Tensor: "
            "keys are opaque to torch. Pass the key to jaxtorch where randomness is drawn (`rng=key` of "
            "`call_torch`, `extract`'s function, a train step), or convert its bits with "
            "`jaxtorch.to_torch(jax.random.key_data(key))`."
        )


def _to_jax_leaf(x):
    if isinstance(x, torch.Tensor):
        return tensor_to_jax(x)  # a snapshot: see `_host_snapshot`
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
    """Convert every torch tensor in `tree` to a `jax.Array` holding the tensor's values now.

    The arrays are snapshots: a write to a tensor after the call (a data loader refilling
    its buffer, `t.fill_(0)`) never changes its array, even while JAX's asynchronous
    dispatch is still reading it. A contiguous CPU tensor of 64 KiB or more is not copied:
    its memory is made copy-on-write (torch's next write to it copies it first, and only
    if the array is still alive); smaller tensors are copied. Writes that bypass torch (a
    NumPy array over the tensor's memory taken before the call) are not seen by
    copy-on-write: convert a `.clone()` for those. Like `jnp.asarray`'s, the arrays are not
    committed to a device, so they mix with other JAX arrays without recompiling.

    **Arguments:**
    - `tree`: a pytree (dicts, lists, tuples, ...) whose torch tensors (CPU or `jax` device) are converted; other
      leaves are kept.

    **Returns:** `tree` with each tensor replaced by a `jax.Array` of its dtype.

    **Example:**
        ```python
        t = torch.arange(6.0).reshape(2, 3)
        a = jaxtorch.to_jax(t)         # t's values now
        t.fill_(0)                     # `a` still holds 0..5
        b = jaxtorch.to_jax(t.T)       # non-contiguous: copied into a contiguous array
        ```
    """
    return tree_map(_to_jax_leaf, tree)


def to_torch(tree: Any) -> Any:
    """Convert every `jax.Array` (or `JaxTensor`) in `tree` to a plain CPU `torch.Tensor`.

    The tensors are copies: writing to them in place never changes the JAX arrays.

    **Arguments:**
    - `tree`: a pytree whose `jax.Array`s and `JaxTensor`s are converted; other leaves are kept.

    **Returns:** `tree` with each array replaced by a CPU `torch.Tensor` (a copy).

    **Example:**
        ```python
        t = jaxtorch.to_torch({"w": jnp.ones(3)})
        assert t["w"].device.type == "cpu" and t["w"].tolist() == [1.0, 1.0, 1.0]
        ```
    """
    return tree_map(_to_torch_leaf, tree)


__all__ = [
    "jax_view",
    "torch_view",
    "to_jax",
    "to_torch",
    "tensor_to_jax",
    "module_tensor_to_jax",
    "array_to_torch",
    "tree_map",
    "x64_enabled",
]


# ---- torch tensors as JAX inputs ----------------------------------------------------------------
def _aval_of_tensor(t: torch.Tensor):
    """The abstract value JAX gives a torch tensor argument: its shape, its dtype as `to_jax` converts it."""
    _check_dense(t)
    return ShapedArray(tuple(t.shape), to_jax_dtype(t.dtype))


def _register_tensors_as_jax_inputs() -> bool:
    """Let JAX take torch tensors where it takes NumPy arrays (`jax.jit`/`grad`/`vmap` arguments,
    `jnp` functions, `jax.device_put`), converted by `tensor_to_jax`: a snapshot, as `to_jax` reads.

    JAX 0.10 refuses `__jax_array__` while abstracting arguments (it raises before calling it),
    and registering `torch.Tensor` as a pytree would change what `jax.tree_util` gives for every
    tensor; these two handlers (looked up along the type's MRO, so `nn.Parameter` and `JaxTensor`
    too) only turn JAX's "not a valid JAX type" into the conversion. Returns False (JAX's own error
    stays) when this JAX has no such tables.

    **Example:** after it, `jax.jit(lambda x: x * 2)(torch.ones(3))` is `Array([2., 2., 2.])`.
    """
    avals, register = pytype_aval_mappings, register_canonicalize_value_handler
    if avals is None or register is None:  # pragma: no cover - another JAX
        return False
    if torch.Tensor not in avals:
        avals[torch.Tensor] = _aval_of_tensor
        register(torch.Tensor, tensor_to_jax)
    return True


TENSORS_ARE_JAX_INPUTS = False  # whether `install` registered torch tensors as JAX inputs


def install() -> None:
    """Let JAX take torch tensors as inputs (`_register_tensors_as_jax_inputs`; idempotent;
    `jaxtorch._install` calls it) and note whether this JAX allowed it (`TENSORS_ARE_JAX_INPUTS`).

    **Example:** `install(); jax.numpy.sin(torch.ones(2))`.
    """
    global TENSORS_ARE_JAX_INPUTS
    TENSORS_ARE_JAX_INPUTS = _register_tensors_as_jax_inputs()
