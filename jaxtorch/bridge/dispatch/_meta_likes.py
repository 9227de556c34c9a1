"""Factories "like" a meta tensor onto the jax device: only its shape and dtype are read.

A loader that builds a model on the meta device and then gives it memory on the target device
(`Module.to_empty(device="jax")`, Hugging Face's `from_pretrained(..., device_map="jax")` for the
buffers its checkpoint lacks) calls `torch.empty_like(meta_t, device="jax")` and its relatives.
With the modes on (`enable_globally`), such a call reaches jaxtorch as an op with a tensor
argument that has no data; these ops need none, so each is rewritten to the plain factory of the
same result (`empty_like(t, device=d)` -> `empty(t.shape, dtype=t.dtype, device=d)`), which the
interpreter runs as any factory. Every other op given a meta tensor raises `MetaTensorError`
(in the interpreter, where a torch tensor becomes a JAX value).

Example:
    ```python
    as_factory(aten.zeros_like.default, (torch.empty(2, 3, device="meta"),), {"device": "jax"})
    # (aten.zeros.default, ([2, 3],), {"device": "jax", "dtype": torch.float32})
    ```
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

aten = torch.ops.aten

# like-op -> (factory, the factory's positional arguments from the like-op's tensor and other arguments)
_Args = Callable[[torch.Tensor, tuple], tuple]


def _shape_first(t: torch.Tensor, rest: tuple) -> tuple:
    """`empty_like(t, *rest)` -> `empty(t.shape, *rest)` (`full_like(t, v)` -> `full(t.shape, v)`)."""
    return (list(t.shape), *rest)


def _size_given(t: torch.Tensor, rest: tuple) -> tuple:
    """`new_zeros(t, size, *rest)` -> `zeros(size, *rest)`."""
    return rest


def _shape_last(t: torch.Tensor, rest: tuple) -> tuple:
    """`randint_like(t, low, high)` -> `randint(low, high, t.shape)`."""
    return (*rest, list(t.shape))


_FACTORIES: dict[Any, tuple[Any, _Args]] = {
    aten.empty_like.default: (aten.empty.memory_format, _shape_first),
    aten.zeros_like.default: (aten.zeros.default, _shape_first),
    aten.ones_like.default: (aten.ones.default, _shape_first),
    aten.full_like.default: (aten.full.default, _shape_first),
    aten.rand_like.default: (aten.rand.default, _shape_first),
    aten.rand_like.generator: (aten.rand.generator, _shape_first),
    aten.randn_like.default: (aten.randn.default, _shape_first),
    aten.randn_like.generator: (aten.randn.generator, _shape_first),
    aten.randint_like.default: (aten.randint.default, _shape_last),
    aten.randint_like.generator: (aten.randint.generator, _shape_last),
    aten.randint_like.low_dtype: (aten.randint.low, _shape_last),
    aten.randint_like.low_generator_dtype: (aten.randint.low_generator, _shape_last),
    aten.new_empty.default: (aten.empty.memory_format, _size_given),
    aten.new_zeros.default: (aten.zeros.default, _size_given),
    aten.new_ones.default: (aten.ones.default, _size_given),
    aten.new_full.default: (aten.full.default, _size_given),
    aten.new_empty_strided.default: (aten.empty_strided.default, _size_given),
}


def is_meta(x: Any) -> bool:
    """Whether `x` is a torch tensor on the meta device (a shape and dtype, no data)."""
    return isinstance(x, torch.Tensor) and x.device.type == "meta"


def as_factory(func, args: tuple, kwargs: dict) -> tuple[Any, tuple, dict] | None:
    """`func(*args, **kwargs)` as a call of a plain factory when `func` makes a new tensor "like"
    the meta tensor `args[0]` (`empty_like`, `zeros_like`, `new_empty`, `randn_like`, ...): the
    factory, its arguments (the meta tensor's shape where the like-op took it) and keyword
    arguments (its dtype unless one was given; `memory_format` only where the factory takes it).
    None for any other call, a like-op of a tensor with data included.

    **Example:** `as_factory(aten.new_full.default, (meta_t, [2], 1.5), {"device": "jax"})` is
    `(aten.full.default, ([2], 1.5), {"device": "jax", "dtype": meta_t.dtype})`.
    """
    entry = _FACTORIES.get(func)
    if entry is None or not args or not is_meta(args[0]):
        return None
    factory, positional = entry
    t, rest = args[0], tuple(args[1:])
    accepted = {a.name for a in factory._schema.arguments}
    new_kwargs = {k: v for k, v in kwargs.items() if k in accepted}
    if new_kwargs.get("dtype") is None:
        new_kwargs["dtype"] = (
            t.dtype
        )  # (a like-op's result has its tensor's dtype, also for `full_like`/`randint_like`)
    return factory, positional(t, rest), new_kwargs
