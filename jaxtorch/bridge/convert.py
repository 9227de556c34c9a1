"""Every conversion between torch values and JAX values happens here.

Two kinds of conversion:
- `jax_view` / `torch_view`: no copy. `torch_view` wraps each `jax.Array` of a nested
  structure in a `JaxTensor`; `jax_view` unwraps each `JaxTensor` back to its array.
- `to_jax` / `to_torch`: plain CPU `torch.Tensor` <-> `jax.Array`, through DLPack (zero
  copy) whenever the layout allows; non-contiguous tensors are made contiguous first.

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

from .pytrees import tree_map  # the one registry of containers (jax.tree_util, tensors as leaves)
from .dtypes import to_jax_dtype, to_torch_dtype, x64_enabled
from .errors import Float64Error
from .tensor import JaxTensor


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
def _torch_view_leaf(x):
    if _is_jax_array(x):
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
    """Wrap every `jax.Array` in `tree` as a `JaxTensor` (no copy); dtypes become torch dtypes."""
    return tree_map(_torch_view_leaf, tree)


def jax_view(tree: Any) -> Any:
    """Unwrap every `JaxTensor` in `tree` to its `jax.Array` (no copy); dtypes become NumPy dtypes."""
    return tree_map(_jax_view_leaf, tree)


# ---- real conversions -----------------------------------------------------------------
def tensor_to_jax(t: torch.Tensor, device: jax.Device | None = None) -> jax.Array:
    """A plain torch tensor -> `jax.Array`, zero-copy through DLPack when possible."""
    if isinstance(t, JaxTensor):
        return t.elem
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.dtype in (torch.float64, torch.complex128) and t.numel() > 1 and not x64_enabled():
        raise Float64Error(t.dtype)  # user data: never narrowed silently
    target = to_jax_dtype(t.dtype)
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if t.dtype == torch.bool or np.dtype(target) != _np_dtype(t.dtype):
        arr = jnp.asarray(t.numpy() if t.dtype != torch.bfloat16 else t.view(torch.int16).numpy().view(target))
        arr = arr.astype(target)
    else:
        if not t.is_contiguous():
            t = t.contiguous()
        try:
            arr = jax.dlpack.from_dlpack(t)
        except Exception:  # layouts DLPack refuses (e.g. zero-size, odd strides)
            arr = jnp.asarray(t.numpy())
    if device is not None:
        arr = jax.device_put(arr, device)
    return arr


def _np_dtype(dtype: torch.dtype) -> np.dtype:
    from .dtypes import _TORCH_TO_NP

    return _TORCH_TO_NP[dtype]


def array_to_torch(a) -> torch.Tensor:
    """A `jax.Array` -> plain CPU `torch.Tensor`, zero-copy through DLPack when possible."""
    if isinstance(a, jax.core.Tracer):
        from .errors import DataDependentError

        raise DataDependentError("conversion to a CPU torch.Tensor", "A traced value has no data yet.")
    a = jnp.asarray(a)
    want = to_torch_dtype(a.dtype)
    try:
        if not a.is_fully_addressable or len(a.sharding.device_set) > 1:
            raise ValueError
        t = torch.from_dlpack(a)
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
        return tensor_to_jax(x)
    if isinstance(x, torch.dtype):
        return to_jax_dtype(x)
    return x


def _to_torch_leaf(x):
    if isinstance(x, JaxTensor):
        return array_to_torch(x.elem)
    if _is_jax_array(x):
        return array_to_torch(x)
    if _is_dtype_like(x):
        return to_torch_dtype(getattr(x, "dtype", x))
    return x


def to_jax(tree: Any) -> Any:
    """Convert every torch tensor in `tree` to a `jax.Array` (zero-copy for contiguous CPU tensors).

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

    **Example:**
        ```python
        t = jaxtorch.to_torch({"w": jnp.ones(3)})   # {"w": tensor([1., 1., 1.])}
        ```
    """
    return tree_map(_to_torch_leaf, tree)


__all__ = ["jax_view", "torch_view", "to_jax", "to_torch", "tensor_to_jax", "array_to_torch", "tree_map", "x64_enabled"]
