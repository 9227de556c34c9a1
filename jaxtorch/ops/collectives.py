"""torch.distributed's functional collectives (`torch.ops._c10d_functional`) as JAX collectives.

torch code run inside `jax.shard_map` (or `jax.pmap`) may call the collectives of
`torch.distributed._functional_collectives` (and, through jaxtorch's "jax" process group, the
in-place `dist.all_reduce` family): each runs as the JAX collective over mesh axes:

| op                        | JAX                                                         |
|---------------------------|-------------------------------------------------------------|
| `all_reduce`              | `lax.psum` (avg: / n), `pmax`, `pmin` (product: gathered)   |
| `all_gather_into_tensor`  | `lax.all_gather(..., tiled=True)` along dim 0               |
| `reduce_scatter_tensor`   | `lax.psum_scatter(..., tiled=True)` along dim 0             |
| `all_to_all_single`       | `lax.all_to_all(..., tiled=True)` along dim 0 (even splits) |
| `broadcast`               | `lax.psum` of the source's bits (bit-exact)                 |
| `wait_tensor`             | the identity (JAX collectives are complete when they return) |

**The axes.** A collective over the process group `g` runs over the axes bound to `g` by the
innermost `jaxtorch.collectives_axis(axes, group=g)`, else by the innermost
`jaxtorch.collectives_axis(axes)`, else over every axis the enclosing `shard_map` maps manually
(a `pmap`'s axis included), in the mesh's order: rank `r` of the group is the device whose
row-major index along those axes is `r`, as `lax.axis_index(axes)` counts. The group's size
must be the axes' size; otherwise, or outside any map, a `CollectiveError` says why.

Example:
    ```python
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    f = lambda x: jaxtorch.call_torch(lambda t: funcol.all_reduce(t, "sum", "jax-world"), x)
    y = jax.shard_map(f, mesh=mesh, in_specs=P("data"), out_specs=P())(x)
    ```
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from .._compat import import_functional_collectives, resolve_process_group
from ..bridge.core import _tracing
from ..bridge.core._errors import CollectiveError
from ..bridge.core._registry import register

import_functional_collectives()  # (defines `_wrap_tensor_autograd`)

c10d = torch.ops._c10d_functional
Axes = tuple[str, ...]

# The innermost bindings last: (group name or None for every group, axes).
_BOUND: contextvars.ContextVar[tuple[tuple[str | None, Axes], ...]] = contextvars.ContextVar(
    "jaxtorch_collectives_axis", default=()
)


def group_name(group) -> str:
    """The name of a process group given as a `ProcessGroup`, a group name, or anything with a
    `group_name` (the `_c10d_functional` ops get either of the first two).

    **Example:** `group_name(dist.group.WORLD)` is `"0"` after `dist.init_process_group`.
    """
    if isinstance(group, str):
        return group
    name = getattr(group, "group_name", None)
    if isinstance(name, str):
        return name
    raise TypeError(f"jaxtorch: expected a process group or a group name, got {group!r}")


def _as_axes(axis) -> Axes:
    return (axis,) if isinstance(axis, str) else tuple(axis)


@contextlib.contextmanager
def collectives_axis(axis: str | tuple[str, ...], group=None) -> Iterator[None]:
    """Run torch's collectives in the block over the mesh axes `axis`.

    By default a collective runs over every axis the enclosing `jax.shard_map` maps manually (a
    `jax.pmap`'s axis included), in the mesh's order; this names the axes instead, for every
    process group or for one.

    **Arguments:**
    - `axis`: a mesh axis name, or a tuple of them (ranks count row-major over them, as
      `lax.axis_index(axis)` does).
    - `group`: the process group (a `ProcessGroup` or its name) these axes serve; `None`: every
      group not bound otherwise. A group's size must be the axes' size.

    **Returns:** a context manager; bindings nest, the innermost wins.

    **Example:**
        ```python
        import numpy as np
        import torch.distributed as dist
        from jax.sharding import PartitionSpec as P

        if not dist.is_initialized():
            dist.init_process_group("jax", rank=0, world_size=1, store=dist.HashStore())
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))

        def summed(t):
            dist.all_reduce(t)   # a psum over "data"
            return t

        with jaxtorch.collectives_axis("data"):
            f = jax.shard_map(lambda x: jaxtorch.call_torch(summed, x), mesh=mesh, in_specs=P("data"), out_specs=P())
            out = f(jnp.ones(4))
        ```
    """
    with _bindings((*_BOUND.get(), (None if group is None else group_name(group), _as_axes(axis)))):
        yield


@contextlib.contextmanager
def _bindings(bound: tuple[tuple[str | None, Axes], ...]) -> Iterator[None]:
    token = _BOUND.set(bound)
    try:
        yield
    finally:
        _BOUND.reset(token)


@_tracing.carry  # torch's autograd thread runs a backward's collectives over the same axes
def _capture_bindings():
    """This thread's `collectives_axis` bindings, to re-establish on torch's autograd thread."""
    bound = _BOUND.get()
    return (lambda: _bindings(bound)) if bound else None


def _bound_axes(name: str) -> tuple[Axes | None, bool]:
    """The axes bound to the group `name` (innermost first by group, then for every group), or
    the enclosing map's manual axes; and whether they were named by `collectives_axis`."""
    bound = _BOUND.get()
    for key in (name, None):
        for g, axes in reversed(bound):
            if g == key:
                return axes, True
    mesh = jax.sharding.get_abstract_mesh()
    manual = tuple(a for a in mesh.axis_names if a in set(mesh.manual_axes)) if not mesh.empty else ()
    return (manual or None), False


def _registered_size(name: str) -> int | None:
    """The size of the process group registered under `name` in torch.distributed, or None when
    none is (a name the functional API passed through unresolved)."""
    if not torch.distributed.is_available():
        return None
    try:
        return resolve_process_group(name).size()
    except (RuntimeError, ValueError, KeyError, LookupError):
        return None


def axes_for(what: str, group, group_size: int | None = None) -> tuple[Axes, int]:
    """The mesh axes the collective `what` over `group` runs over, and their size.

    **Arguments:**
    - `what`: the op's name, for the errors.
    - `group`: its process group (a `ProcessGroup` or a group name).
    - `group_size`: the size the op was given (`all_gather_into_tensor`), if any.

    **Returns:** `(axes, size)`.

    **Raises:** `CollectiveError` when no axis is bound, an axis is unknown, or the group's size
    (registered, or given) is not the axes' size.
    """
    name = group_name(group)
    axes, named = _bound_axes(name)
    if axes is None:
        raise CollectiveError.no_axis(what)
    try:
        size = int(lax.axis_size(axes))
    except NameError as e:
        raise (CollectiveError.unknown_axis(what, axes) if named else CollectiveError.no_axis(what)) from e
    for expected in (_registered_size(name), group_size):
        if expected is not None and expected != size:
            raise CollectiveError.group_size(what, name, expected, axes, size)
    return axes, size


# ---- reductions --------------------------------------------------------------------------------
_NO_JAX_FORM = {
    "band": "JAX has no bitwise-and collective",
    "bor": "JAX has no bitwise-or collective",
    "bxor": "JAX has no bitwise-xor collective",
    "premul_sum": "its scale factor does not reach the functional op",
}


def _is_integral(x) -> bool:
    return not jnp.issubdtype(x.dtype, jnp.inexact)


def _extremum(collective, x, axes: Axes):
    """`pmax`/`pmin` of `x`, NaN wherever a device holds NaN (as `torch.maximum` and NumPy give;
    XLA's CPU all-reduce drops NaNs)."""
    out = collective(x, axes)
    if _is_integral(x):
        return out
    nan = lax.pmax(jnp.isnan(x).astype(jnp.uint8), axes) > 0
    return jnp.where(nan, jnp.asarray(jnp.nan, x.dtype), out)


def _reduce(what: str, x, op: str, axes: Axes, size: int):
    """`x` reduced with torch's reduce op `op` ('sum', 'avg', ...) over `axes` on every device."""
    op = op.lower()
    if op in _NO_JAX_FORM:
        raise CollectiveError.reduce_op(what, op, _NO_JAX_FORM[op])
    if x.dtype == jnp.bool_ and op != "avg":  # torch keeps bool: SUM and MAX are OR, MIN and PRODUCT are AND
        either = op in ("sum", "max")
        return (lax.pmax if either else lax.pmin)(x.astype(jnp.uint8), axes) > 0
    if op == "sum":
        return lax.psum(x, axes)
    if op == "avg":
        if _is_integral(x):
            raise CollectiveError.reduce_op(
                what,
                op,
                "the average of integers or booleans rounds differently in each torch backend; sum, then divide",
            )
        return (lax.psum(x, axes) / size).astype(x.dtype)
    if op in ("max", "min"):
        return _extremum(lax.pmax if op == "max" else lax.pmin, x, axes)
    if op == "product":
        return jnp.prod(lax.all_gather(x, axes), axis=0, dtype=x.dtype)
    raise CollectiveError.reduce_op(what, op, "torch.distributed has no such reduce op")


@register(c10d.all_reduce)
def all_reduce(x, reduce_op: str, group):
    """`x` reduced over the group's axes (`lax.psum`, `pmean`, `pmax`, `pmin`)."""
    axes, size = axes_for("all_reduce", group)
    return _reduce("all_reduce", x, reduce_op, axes, size)


@register(c10d.all_reduce_coalesced)
def all_reduce_coalesced(xs, reduce_op: str, group):
    """`all_reduce` of each tensor of `xs`."""
    return [all_reduce(x, reduce_op, group) for x in xs]


@register(c10d.all_gather_into_tensor)
def all_gather_into_tensor(x, group_size: int, group):
    """The group's tensors concatenated along dim 0, in rank order (`lax.all_gather`, tiled)."""
    axes, _ = axes_for("all_gather_into_tensor", group, group_size)
    return lax.all_gather(x, axes, axis=0, tiled=x.ndim > 0)


@register(c10d.all_gather_into_tensor_out)
def all_gather_into_tensor_out(x, group_size: int, group, *, out=None):
    """`all_gather_into_tensor`, written into `out` by the interpreter."""
    return all_gather_into_tensor(x, group_size, group)


@register(c10d.all_gather_into_tensor_coalesced)
def all_gather_into_tensor_coalesced(xs, group_size: int, group):
    """`all_gather_into_tensor` of each tensor of `xs`."""
    return [all_gather_into_tensor(x, group_size, group) for x in xs]


def _own_block(x, axes: Axes, size: int):
    """This device's block of `x` split into `size` equal blocks along dim 0."""
    rows = x.shape[0] // size
    return lax.dynamic_slice_in_dim(x, lax.axis_index(axes) * rows, rows, axis=0)


@register(c10d.reduce_scatter_tensor)
def reduce_scatter_tensor(x, reduce_op: str, group_size: int, group):
    """Rank r's block r (dim 0 split into `group_size` blocks) of `x` reduced over the group."""
    what = "reduce_scatter_tensor"
    axes, size = axes_for(what, group, group_size)
    if x.ndim == 0 or x.shape[0] % size:
        raise CollectiveError.uneven_split(what, x.shape[0] if x.ndim else 0, size, "equal blocks")
    op = reduce_op.lower()
    if op == "sum" and x.dtype != jnp.bool_:
        return lax.psum_scatter(x, axes, scatter_dimension=0, tiled=True)
    if op == "avg" and not _is_integral(x):
        return (lax.psum_scatter(x, axes, scatter_dimension=0, tiled=True) / size).astype(x.dtype)
    return _own_block(_reduce(what, x, op, axes, size), axes, size)


@register(c10d.reduce_scatter_tensor_coalesced)
def reduce_scatter_tensor_coalesced(xs, reduce_op: str, group_size: int, group):
    """`reduce_scatter_tensor` of each tensor of `xs`."""
    return [reduce_scatter_tensor(x, reduce_op, group_size, group) for x in xs]


@register(c10d.all_to_all_single)
def all_to_all_single(x, output_split_sizes, input_split_sizes, group):
    """Block j of rank i's dim 0 goes to rank j, at block i (`lax.all_to_all`, tiled); equal blocks only."""
    what = "all_to_all_single"
    axes, size = axes_for(what, group)
    rows = x.shape[0] if x.ndim else 0
    even = rows // size
    for splits in (input_split_sizes, output_split_sizes):
        if x.ndim == 0 or rows % size or (splits and list(splits) != [even] * size):
            raise CollectiveError.uneven_split(what, rows, size, list(splits) or "equal blocks")
    return lax.all_to_all(x, axes, 0, 0, tiled=True)


_BITS = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


@register(c10d.broadcast)
def broadcast(x, src: int, group):
    """Rank `src`'s `x` on every device, bit for bit (a sum of its bits and zeros elsewhere)."""
    axes, size = axes_for("broadcast", group)
    if not 0 <= src < size:
        raise CollectiveError(
            f"`broadcast` from rank {src} of a group of {size} ranks (the axes {axes}): the source must be a "
            f"rank of the group, 0 to {size - 1}."
        )
    mine = lax.axis_index(axes) == src
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        return lax.complex(broadcast(jnp.real(x), src, group), broadcast(jnp.imag(x), src, group))
    if x.dtype == jnp.bool_:
        return lax.psum(jnp.where(mine, x, False).astype(jnp.uint8), axes).astype(jnp.bool_)
    bits = lax.bitcast_convert_type(x, _BITS[np.dtype(x.dtype).itemsize])
    return lax.bitcast_convert_type(lax.psum(jnp.where(mine, bits, jnp.zeros_like(bits)), axes), x.dtype)


@register(c10d.wait_tensor)
def wait_tensor(x):
    """The identity: a JAX collective's result is complete when it is returned."""
    return x


@register(c10d._wrap_tensor_autograd)
def wrap_tensor_autograd(x):
    """The identity: the result stays a `JaxTensor`, no `AsyncCollectiveTensor` wrapper is needed."""
    return x


__all__ = ["axes_for", "collectives_axis", "group_name"]
