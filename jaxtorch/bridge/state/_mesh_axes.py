"""Explicit-axis meshes: torch code runs with the mesh's axes Auto, GSPMD picks the shardings.

`jax.make_mesh` makes Explicit axes by default: each array's sharding is part of its type
(`float32[2,16,128@model]`) and every op whose result sharding is ambiguous asks for an
`out_sharding=` (a Llama's attention reshape to `(2, 16, 4, 32)`, an embedding gather
with ids split over "data", a row-parallel matmul). Torch programs carry no such
annotations, so a jaxtorch call on explicitly sharded arrays runs the way torch_xla runs
torch code: inside the call the mesh's explicit axes are Auto and XLA's sharding
propagation (GSPMD) chooses every intermediate sharding, exactly as with a hand-built
`Mesh`. At the boundary the arrays are converted with `jax.sharding.reshard`, whose
transpose makes gradients come back with their inputs' types:

- input tensors get back their own sharding (buffers written in place included);
- other results are split along their first axis over the mesh axes that split the
  first axis of a data input of the same length (logits `[B@data, T, V]` for ids
  `[B@data, T]`), and replicated otherwise. Placement only: the values do not depend
  on it; `jax.sharding.reshard` the result to place it otherwise.

Example:
    ```python
    mesh = jax.make_mesh((2, 4), ("data", "model"))          # Explicit axes
    params = jaxtorch.train.shard(params, mesh, rules)
    logits = jax.jit(fn)(params, jaxtorch.train.shard_batch(ids, mesh)).logits  # [B@data, T, V]
    ```
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, cast

import jax
import torch
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec

from ..._compat import Tracer
from ..tensor._tensor import JaxTensor, root, root_data
from ._binding import Binding


def _explicit(x) -> NamedSharding | None:
    """The sharding in `x`'s type when its mesh has an Explicit axis, else None."""
    try:
        sharding = jax.typeof(x).sharding
    except (TypeError, AttributeError):
        return None
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty or not mesh.explicit_axes:
        return None
    return sharding


def _tensors(tree) -> Iterator:
    """The tensors in `tree`, and the parameters and buffers of the modules in it (a module,
    or a bound method of one such as `model.forward`, is a leaf)."""
    for leaf in jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, JaxTensor)):
        module = getattr(leaf, "__self__", leaf)
        if isinstance(module, torch.nn.Module):
            yield from module.parameters()
            yield from module.buffers()
        else:
            yield leaf


def _roots(tree) -> list[JaxTensor]:
    """The distinct root `JaxTensor`s (not views) in `tree`, explicitly sharded ones only."""
    seen: dict[int, JaxTensor] = {}
    for leaf in _tensors(tree):
        if isinstance(leaf, JaxTensor):
            r = root(leaf)
            if id(r) not in seen and _explicit(root_data(r)) is not None:
                seen[id(r)] = r
    return list(seen.values())


def _batch_axes(tree) -> dict[int, Any]:
    """Leading length -> the mesh axes splitting axis 0 of a data input of that length."""
    axes: dict[int, Any] = {}
    for leaf in jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, JaxTensor)):
        elem = leaf.elem if isinstance(leaf, JaxTensor) else leaf
        sharding = _explicit(elem)
        if sharding is not None and elem.ndim and len(sharding.spec) and sharding.spec[0] is not None:
            axes.setdefault(elem.shape[0], sharding.spec[0])
    return axes


class _Region:
    """What `auto_axes` needs to convert the results back (see `finish`)."""

    def __init__(self, mesh, batch: dict[int, Any]):
        self.mesh = mesh
        self.batch = batch

    def finish(self, out):
        """Give each array leaf of `out` (a JAX pytree) an explicit type on the mesh."""
        if self.mesh is None:
            return out

        def place(x):
            if not isinstance(x, jax.Array) and not isinstance(x, Tracer):
                return x
            if _explicit(x) is not None:
                return x
            axes = self.batch.get(x.shape[0]) if x.ndim else None
            return jax.sharding.reshard(x, NamedSharding(self.mesh, PartitionSpec(axes)))

        return jax.tree_util.tree_map(place, out)


@contextlib.contextmanager
def auto_axes(tree, data=None) -> Iterator[_Region]:
    """Run the block with the Explicit axes of the arrays in `tree` made Auto.

    **Arguments:**
    - `tree`: the call's torch-side arguments (`JaxTensor`s in any nesting; the tensors of
      modules in it count too, also of the module behind a bound method). Root tensors
      whose type names Explicit axes are resharded to the Auto mesh for the block and
      back to their own sharding after it (also on an exception).
    - `data`: the part of `tree` that holds data, not parameters (default: all of it);
      its first-axis splits choose how `finish` places the results.

    **Returns:** a region whose `finish(out)` places the results on the explicit mesh
    (a no-op when nothing was explicitly sharded).

    **Example:**
        ```python
        with auto_axes((targs, tkwargs)) as region:
            out = fn(*targs, **tkwargs)
        out = region.finish(jax_view(out))
        ```
    """
    roots = _roots(tree)
    if not roots:
        yield _Region(None, {})
        return
    # `_roots` keeps the explicitly sharded roots only; the mesh in an array's type is abstract
    types = {id(t): cast(NamedSharding, _explicit(root_data(t))) for t in roots}
    mesh = cast(AbstractMesh, next(iter(types.values())).mesh)
    for s in types.values():
        if s.mesh != mesh:
            raise ValueError(
                f"jaxtorch: the arguments lie on different meshes: {mesh} and {s.mesh}; "
                "place them on one (jaxtorch.train.shard / jax.device_put)"
            )
    concrete = next(
        (
            root_data(t).sharding.mesh
            for t in roots
            if isinstance(root_data(t), jax.Array) and not isinstance(root_data(t), Tracer)
        ),
        None,
    )
    target = concrete if concrete is not None else mesh
    region = _Region(target, _batch_axes(tree if data is None else data))
    auto = mesh.update_axis_types({a: AxisType.Auto for a in mesh.explicit_axes})
    binding = Binding(tensors=roots)  # the roots get Auto-typed arrays, then their own sharding back
    with jax.sharding.use_abstract_mesh(auto):
        binding.bind_data([jax.sharding.reshard(root_data(t), PartitionSpec()) for t in binding.roots])
    try:
        with jax.sharding.use_abstract_mesh(auto):
            yield region
    finally:
        binding.carry(lambda t, value: jax.sharding.reshard(value, NamedSharding(target, types[id(t)].spec)))


__all__ = ["auto_axes"]
