"""The torch dtype of an op's result when JAX's dtype does not say it.

With JAX's 64-bit mode off, an int32 array is what JAX gives for both a `torch.int32` and a
`torch.int64` result (and uint32 for `uint32` and `uint64`). For those outputs only, the
result is `torch.int64` (`uint64`) unless something asks for a narrow one (a `torch.int32`/
`uint32` tensor argument, a dtype argument, `out_int32=True`); then the interpreter asks
torch itself: the op runs once on `meta` tensors of the arguments' torch
dtypes (no data, no compute), and the result dtypes are cached by the op and its arguments'
dtype signature (tensor dtypes, whether each tensor is 0-dim, Python scalar types, dtype
arguments), so `int32 + int64` is `torch.int64`, `argmax` of an int32 tensor is
`torch.int64`, `int32 + 1` is `torch.int32`, as on the CPU. Where no meta kernel answers
(data-dependent shapes such as `nonzero`), the result is `torch.int64` (`uint64`), unless
the op is pointwise and its integer tensor inputs are all `torch.int32` (`uint32`).

Example:
    ```python
    result_dtypes(torch.ops.aten.add.Tensor, (a_int32, b_int64), {})   # (torch.int64,)
    ```
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..._compat import disable_current_modes
from ..core._dtypes import x64_enabled
from ..tensor._tensor import JaxTensor

AMBIGUOUS = frozenset({np.dtype("int32"), np.dtype("uint32")})  # int64/uint64 held in 32 bits
_WIDE = {np.dtype("int32"): torch.int64, np.dtype("uint32"): torch.uint64}
_NARROW = {np.dtype("int32"): torch.int32, np.dtype("uint32"): torch.uint32}
_VALUES = (str, torch.dtype, torch.memory_format, torch.layout, type(None))
_cache: dict = {}


def ambiguous(jax_dtype) -> bool:
    """Whether a JAX result of `jax_dtype` may be more than one torch dtype (int32/uint32, x64 off)."""
    return jax_dtype in AMBIGUOUS and not x64_enabled()


def _sig(x) -> Any:
    if isinstance(x, torch.Tensor):
        return (x.dtype, x.dim() == 0)
    if isinstance(x, (list, tuple)):
        return tuple(_sig(y) for y in x)
    if isinstance(x, _VALUES):
        return x
    return type(x)  # Python numbers: their type decides promotion, not their value


def _meta(x) -> Any:
    if isinstance(x, torch.Tensor):
        return torch.empty(tuple(x.shape), dtype=x.dtype, device="meta")
    if isinstance(x, (list, tuple)):
        return type(x)(_meta(y) for y in x)
    if isinstance(x, (torch.device, torch.Generator)):
        return None
    return x


def _flat_dtypes(out) -> list:
    if isinstance(out, torch.Tensor):
        return [out.dtype]
    if isinstance(out, (list, tuple)):
        return [d for o in out for d in _flat_dtypes(o)]
    return []


def _from_meta(func, args, kwargs) -> tuple | None:
    margs = [_meta(a) for a in args]
    mkwargs = {k: ("meta" if k == "device" and v is not None else _meta(v)) for k, v in kwargs.items()}
    try:
        with disable_current_modes():
            out = func(*margs, **mkwargs)
    except Exception:  # no meta kernel, a data-dependent shape, a stricter check than the lowering's
        return None
    return tuple(_flat_dtypes(out))


def _tensors(x) -> list:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in _tensors(y)]
    return []


def _fallback(func, args, kwargs, jax_dtype) -> torch.dtype:
    """No meta answer: torch's integer results are int64 (indices, counts) unless a pointwise op
    keeps its narrow integer inputs' dtype."""
    narrow, wide = _NARROW[jax_dtype], _WIDE[jax_dtype]
    if torch.Tag.pointwise in getattr(func, "tags", ()):
        ints = [t.dtype for t in _tensors([list(args), list(kwargs.values())]) if not t.dtype.is_floating_point]
        ints = [d for d in ints if d not in (torch.bool,) and not d.is_complex]
        if ints and all(d == narrow for d in ints):
            return narrow
    return wide


def result_dtypes(func, args, kwargs) -> tuple | None:
    """The torch dtypes of `func(*args, **kwargs)`'s tensor outputs, flattened, as torch computes
    them (cached by dtype signature); None where torch's meta kernels cannot say.

    Example: `result_dtypes(aten.argmax.default, (x_int32,), {})` is `(torch.int64,)`.
    """
    try:
        key = (func, _sig(args), _sig(tuple(kwargs.items())))
        hit = _cache.get(key, _cache)
    except TypeError:  # an unhashable argument: ask without caching
        return _from_meta(func, args, kwargs)
    if hit is _cache:
        hit = _cache[key] = _from_meta(func, args, kwargs)
    return hit


_NARROW_TORCH = (torch.int32, torch.uint32)


def _narrow_asked(args, kwargs) -> bool:
    """Whether anything could make an int32/uint32 result narrow: a torch.int32/uint32 tensor
    argument, a dtype argument, or `out_int32=True`. Without one, torch's integer result is
    int64/uint64 (the common case, decided without asking torch)."""
    for a in args:
        t = type(a)
        if t is JaxTensor:  # (the common case first)
            if a.dtype in _NARROW_TORCH:
                return True
            continue
        if t is int or t is float or t is bool or a is None:
            continue
        if t is list or t is tuple:
            if _narrow_asked(a, {}):
                return True
        elif isinstance(a, torch.Tensor):
            if a.dtype in _NARROW_TORCH:
                return True
        elif isinstance(a, torch.dtype):
            return True
    if kwargs:
        if kwargs.get("out_int32") or kwargs.get("dtype") is not None:
            return True
        return _narrow_asked(list(kwargs.values()), {})
    return False


_ONE: dict = {}  # (func, JAX result dtype, argument signature) -> the torch dtype: `label_one`'s cache
_SCALAR_TYPES = (int, float, bool)


def _flat_key(func, jax_dtype, args) -> tuple | None:
    """A cheap cache key for the common call: positional `JaxTensor`s and Python numbers only
    (what decides torch's result dtype: each tensor's dtype and whether it is 0-dim, each
    number's type); None for anything else (lists, other tensors, dtype arguments)."""
    key: list = [func, jax_dtype]
    for a in args:
        t = type(a)
        if t is JaxTensor:
            key.append(a.dtype)
            key.append(a.dim() == 0)
        elif t in _SCALAR_TYPES:
            key.append(t)
        else:
            return None
    return tuple(key)


def label_one(func, args, kwargs, out) -> torch.dtype | None:
    """`label(func, args, kwargs, [out])[0]` for a single, ambiguous output, remembered per op and
    argument signature when the call has only tensors and numbers (one dict lookup after the first).

    **Example:** `label_one(aten.add.Tensor, (a_int32, b_int32), {}, out)` is `torch.int32`.
    """
    if not _narrow_asked(args, kwargs):  # int64/uint64 inputs (or none): the wide dtype, no meta run
        return _WIDE[out.dtype]
    key = None if kwargs else _flat_key(func, out.dtype, args)
    if key is not None:
        hit = _ONE.get(key)
        if hit is not None:
            return hit
    dtype = label(func, args, kwargs, [out])[0]
    if key is not None and dtype is not None:
        _ONE[key] = dtype
    return dtype


def label(func, args, kwargs, outs: list) -> list[torch.dtype | None]:
    """The torch dtype of each JAX output in `outs` (None: the array's own), resolving the
    ambiguous ones (see the module docstring); a single output is known to be ambiguous."""
    if not _narrow_asked(args, kwargs):  # int64/uint64 inputs (or none): the wide dtype, no meta run
        return [_WIDE.get(o.dtype) if len(outs) == 1 or ambiguous(o.dtype) else None for o in outs]
    dtypes = result_dtypes(func, args, kwargs)
    labels: list[torch.dtype | None] = []
    for i, o in enumerate(outs):
        jd = getattr(o, "dtype", None)
        if jd is None or not ambiguous(jd):
            labels.append(None)
        elif dtypes is not None and len(dtypes) == len(outs) and dtypes[i] in (_NARROW[jd], _WIDE[jd]):
            labels.append(dtypes[i])
        else:
            labels.append(_fallback(func, args, kwargs, jd))
    return labels
