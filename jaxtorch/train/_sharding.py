"""GSPMD placement: `shard` (parameters by name rules), `shard_batch` and `DeviceLoader`.

Rules are `[(regex, PartitionSpec), ...]`; each array's key path as a dotted name
(`"fc1.weight"` in a params dict, `"opt_state.0.mu.fc1.weight"` in a `TrainState`) is
searched with each regex in turn and the first match wins; arrays no rule matches are
replicated. Because optimizer moments carry their parameter's name in their path,
sharding a whole `TrainState` places each moment like its parameter.

Megatron-style tensor parallelism of a two-layer MLP on a `("data", "model")` mesh
(torch's Linear weight is `(out, in)`):
    ```python
    rules = [(r"fc1\\.weight$", P("model", None)), (r"fc1\\.bias$", P("model")),   # column split
             (r"fc2\\.weight$", P(None, "model"))]                                # row split
    state = shard(init(), mesh, rules)
    x = shard_batch(x, mesh)                                  # batch split over "data"
    ```
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import torch
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..bridge.tensor._convert import tensor_to_jax, torch_view, tree_map

Rules = Sequence[tuple[str, PartitionSpec]]


def _key_name(k: Any) -> str:
    if isinstance(k, jax.tree_util.DictKey):
        return str(k.key)
    if isinstance(k, jax.tree_util.GetAttrKey):
        return k.name
    if isinstance(k, jax.tree_util.SequenceKey):
        return str(k.idx)
    return str(k)


def path_name(path: Any) -> str:
    """A key path as a dotted name: `("params", "fc1.weight")` -> `"params.fc1.weight"`."""
    return ".".join(_key_name(k) for k in path)


def spec_for(name: str, rules: Rules) -> PartitionSpec:
    """The PartitionSpec of the first rule whose regex matches `name` (re.search), else replicated."""
    for pattern, spec in rules:
        if re.search(pattern, name):
            return spec
    return PartitionSpec()


def shardings(tree: Any, mesh: Mesh, rules: Rules) -> Any:
    """A pytree of `NamedSharding`s, one per array leaf of `tree`, chosen by `rules`.

    **Arguments:**
    - `tree`: a pytree of arrays (parameters, by torch name when a dict).
    - `mesh`: the mesh.
    - `rules`: `(regex, PartitionSpec)` pairs; the first regex matching a leaf's path gives its spec; other
      leaves are replicated.

    **Returns:** a pytree of `jax.sharding.NamedSharding`s with `tree`'s structure.

    **Example:**
        ```python
        from jax.sharding import PartitionSpec as P

        mesh = jaxtorch.train.data_mesh(axis="model")
        params = {"fc.weight": jnp.ones((4, 2)), "fc.bias": jnp.ones(4)}
        s = jaxtorch.train.shardings(params, mesh, [(r"weight$", P("model"))])
        assert s["fc.weight"].spec == P("model") and s["fc.bias"].spec == P()
        ```
    """
    return jax.tree_util.tree_map_with_path(lambda p, x: NamedSharding(mesh, spec_for(path_name(p), rules)), tree)


def shard(tree: Any, mesh: Mesh, rules: Rules = ()) -> Any:
    """Place every array of `tree` (params dict, `TrainState`, ...) on `mesh` by name rules.

    **Arguments:**
    - `tree`: a pytree of arrays; non-array leaves (Python scalars) pass through.
    - `mesh`: a `jax.sharding.Mesh`.
    - `rules`: `[(regex, PartitionSpec), ...]`, first match wins; unmatched arrays are
      replicated. A spec longer than an array's rank is an error naming the array.

    **Returns:** the same tree with arrays placed (`jax.device_put`, or assembled from
    each process's data in a multi-process run).

    **Example:**
        ```python
        from jax.sharding import PartitionSpec as P

        mesh = jaxtorch.train.data_mesh(axis="model")
        params, fn = jaxtorch.extract(torch.nn.Linear(2, 4))
        params = jaxtorch.train.shard(params, mesh, [(r"weight$", P("model", None))])   # rows split over "model"
        ```
    """

    def place(path: Any, x: Any) -> Any:
        if not isinstance(x, (jax.Array, np.ndarray)):
            return x
        name = path_name(path)
        spec = spec_for(name, rules)
        if len(spec) > np.ndim(x):
            raise ValueError(f"shard: rule spec {spec} has more axes than {name} (shape {np.shape(x)})")
        sharding = NamedSharding(mesh, spec)
        if jax.process_count() > 1:  # every process holds the full value: assemble its shards
            host = np.asarray(x)
            return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])
        return jax.device_put(x, sharding)

    return jax.tree_util.tree_map_with_path(place, tree)


def _as_array(x: Any) -> Any:
    """A torch tensor as a `jax.Array` snapshot (`tensor_to_jax`): a loader refilling the same
    buffer after the call never changes the batch placed from it; other leaves as they are."""
    if isinstance(x, torch.Tensor):
        return tensor_to_jax(x)
    return x


def shard_batch(batch: Any, mesh: Mesh, axis: str | Sequence[str] | None = "data") -> Any:
    """Place a batch (any pytree of arrays / CPU torch tensors) split along axis 0 over `axis`.

    Torch tensors are read as snapshots (see `jaxtorch.to_jax`): writing to them after the
    call (a loader reusing its buffer) never changes the placed arrays. A batch that is a
    mapping but not a dict (Hugging Face's `BatchEncoding`, what its collators return) comes
    back as a dict (which `make_train_step`'s `step` takes as keyword arguments). Every array
    with a leading dimension is split along it: its rows must divide over the mesh axis.

    In a multi-process run each process passes its own part of the global batch (its
    local rows) and gets the global array back (`jax.make_array_from_process_local_data`).

    **Arguments:**
    - `batch`: a pytree of arrays or CPU torch tensors, each with the batch along axis 0.
    - `mesh`: the mesh.
    - `axis`: the mesh axis (or axes) to split the batch over; None: replicate.

    **Returns:** `batch` with each leaf a `jax.Array` placed on `mesh`.

    **Example:**
        ```python
        mesh = jaxtorch.train.data_mesh()
        x, y = jaxtorch.train.shard_batch((torch.ones(8, 3), torch.zeros(8)), mesh)   # rows spread over "data"
        assert isinstance(x, jax.Array) and x.shape == (8, 3)
        ```
    """
    if isinstance(batch, Mapping) and not isinstance(batch, dict):  # HF's BatchEncoding (a UserDict)
        batch = dict(batch)  # a dict: the containers JAX walks, and `step` takes it as keyword arguments
    sharding = NamedSharding(mesh, PartitionSpec(axis))
    names = (axis,) if isinstance(axis, str) else () if axis is None else tuple(axis)
    parts = int(np.prod([mesh.shape[a] for a in names]))

    def place(x: Any) -> Any:
        x = _as_array(x)
        if not isinstance(x, (jax.Array, np.ndarray)) or np.ndim(x) == 0:
            return x
        if jax.process_count() > 1:
            return jax.make_array_from_process_local_data(sharding, np.asarray(x))
        if np.shape(x)[0] % parts:
            raise ValueError(
                f"shard_batch: a batch of {np.shape(x)[0]} rows (shape {tuple(np.shape(x))}) does not split evenly "
                f"over the {parts} devices of mesh axis {axis!r}: use a batch size they divide, "
                "`DataLoader(..., drop_last=True)` for a short last batch, or pad it"
            )
        return jax.device_put(x, sharding)

    return tree_map(place, batch)


def data_mesh(devices: Sequence[jax.Device] | None = None, axis: str = "data") -> Mesh:
    """A one-axis mesh over `devices` (default: every device of every process).

    **Arguments:**
    - `devices`: the devices (default: `jax.devices()`).
    - `axis`: the axis name.

    **Returns:** a `jax.sharding.Mesh` of shape `(len(devices),)`.

    **Example:**
        ```python
        mesh = jaxtorch.train.data_mesh()
        assert mesh.axis_names == ("data",) and mesh.size == len(jax.devices())
        ```
    """
    devices = jax.devices() if devices is None else list(devices)
    return Mesh(np.array(devices), (axis,))


class DeviceLoader:
    """Wrap an iterable of batches (a torch `DataLoader`, a generator, ...): each batch comes
    out placed on `mesh`, split along axis 0 over `axis`, like torch_xla's `ParallelLoader`.

    **Arguments:**
    - `loader`: yields pytrees of CPU torch tensors or arrays; tensors are read as snapshots
      when the batch is drawn, so a loader may refill the same buffer for the next batch.
    - `mesh`: defaults to a one-axis `"data"` mesh over all devices.
    - `axis`: the mesh axis (or axes) the batch dimension is split over.
    - `as_torch`: yield `JaxTensor`s (for PyTorch-first loops) instead of `jax.Array`s.
    - `prefetch`: batches placed ahead of the one being used (transfers overlap compute).

    `len()` is the wrapped loader's; each `for` draws a new pass over it (epochs, a sampler's
    `set_epoch`), and the last, short batch of a `drop_last=False` loader is placed like the
    others (its rows must divide over the mesh axis: use `drop_last=True` or a batch size they
    divide).

    **Returns:** an iterable of the placed batches (`len()` is the loader's when it has one).

    **Example:**
        ```python
        import optax

        model = torch.nn.Linear(3, 1)
        init, step = jaxtorch.train.make_train_step(model, lambda out, y: jnp.mean((out - y) ** 2), optax.adam(1e-3))
        batches = [(torch.ones(4, 3), torch.zeros(4, 1)) for _ in range(2)]   # e.g. a torch DataLoader
        state = init()
        for x, y in jaxtorch.train.DeviceLoader(batches, jaxtorch.train.data_mesh()):
            state, loss = step(state, x, y)
        ```
    """

    def __init__(
        self,
        loader: Iterable,
        mesh: Mesh | None = None,
        axis: str | Sequence[str] | None = "data",
        *,
        as_torch: bool = False,
        prefetch: int = 1,
    ):
        self.loader = loader
        self.mesh = mesh if mesh is not None else data_mesh()
        self.axis = axis
        self.as_torch = as_torch
        self.prefetch = max(0, int(prefetch))

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def _place(self, batch: Any) -> Any:
        placed = shard_batch(batch, self.mesh, self.axis)
        return torch_view(placed) if self.as_torch else placed

    def __iter__(self) -> Iterator:
        it = iter(self.loader)
        queue: list = []
        for batch in it:
            queue.append(self._place(batch))  # device_put is asynchronous: this overlaps
            if len(queue) > self.prefetch:
                yield queue.pop(0)
        yield from queue


__all__ = ["DeviceLoader", "data_mesh", "path_name", "shard", "shard_batch", "shardings", "spec_for"]
