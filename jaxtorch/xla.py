"""torch_xla-style helpers for PyTorch-first training on the `jax` device.

Familiar names, each doing the JAX-native thing. As in torch_xla, the device is lazy:
`xla_device()` turns on jaxtorch's lazy mode (`jaxtorch.bridge.core._lazy`), so ops are
recorded and each step runs as one cached XLA program at `mark_step()` (which
`optimizer_step(barrier=True)` and `ParallelLoader` call for you); `metrics_report()`
shows compilations, cache hits and what forced unplanned executions. One JAX process drives all of its local
devices (SPMD), so "ordinal" and "world size" count processes (`jax.process_index()`,
`jax.process_count()`), not devices; gradients computed on sharded data are already
global, so `optimizer_step` needs no all-reduce.

Example:
    ```python
    import jaxtorch.xla as xm
    device = xm.xla_device()
    model = xm.send_to_device(model)                   # bfloat16 if JAXTORCH_USE_BF16=1
    for x, y in xm.ParallelLoader(train_loader):       # batches sharded over all devices
        loss = loss_fn(model(x), y); loss.backward()
        xm.optimizer_step(opt); opt.zero_grad()
        xm.mark_step()                                 # (ParallelLoader also calls it)
    xm.master_print("done"); print(xm.metrics_report())
    ```
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import jax
import torch

from .bridge.core import _lazy
from .bridge.core._lazy import LazyGraphWarning, LazyMetrics, clear_metrics, metrics, metrics_report
from .bridge.tensor._device import DEVICE_TYPE
from .bridge.tensor._tensor import JaxTensor
from .train._sharding import DeviceLoader, data_mesh

BF16_ENV = "JAXTORCH_USE_BF16"


def xla_device(n: int | None = None, *, lazy: bool = True) -> torch.device:
    """The `jax` device; `xla_device(n)` is `"jax:n"`, which places data on `jax.devices()[n]`.

    Like torch_xla's device it is lazy: this turns lazy mode on (`lazy=False` leaves the
    mode as it is; `jaxtorch.disable_globally()` or `jaxtorch.bridge.core._lazy.set_enabled(False)`
    turns it off).
    """
    if lazy:
        _lazy.set_enabled(True)
    return torch.device(DEVICE_TYPE) if n is None else torch.device(DEVICE_TYPE, n)


def is_xla_tensor(t: Any) -> bool:
    """Whether `t` is a torch tensor on the `jax` device."""
    return isinstance(t, JaxTensor) or (isinstance(t, torch.Tensor) and t.device.type == DEVICE_TYPE)


def get_ordinal() -> int:
    """This process's index among the processes of the run (`jax.process_index()`)."""
    return jax.process_index()


def world_size() -> int:
    """How many processes take part (`jax.process_count()`); each drives its local devices."""
    return jax.process_count()


def is_master_ordinal() -> bool:
    """Whether this is process 0."""
    return jax.process_index() == 0


def master_print(*args: Any, **kwargs: Any) -> None:
    """`print`, on process 0 only."""
    if is_master_ordinal():
        print(*args, **kwargs)


def use_bf16() -> bool:
    """Whether the `JAXTORCH_USE_BF16` switch is on (like torch_xla's `XLA_USE_BF16`)."""
    return os.environ.get(BF16_ENV, "0").lower() not in ("", "0", "false", "no", "off")


def send_to_device(obj: Any, device: torch.device | str | None = None) -> Any:
    """Move a module, tensor or nested structure of tensors to the `jax` device.

    With `JAXTORCH_USE_BF16=1`, float32 parameters and tensors become bfloat16 on the way
    (the model then computes in bfloat16, as torch_xla does with `XLA_USE_BF16=1`).
    """
    device = xla_device() if device is None else torch.device(device)
    dtype = torch.bfloat16 if use_bf16() else None
    if isinstance(obj, torch.nn.Module):
        obj = obj.to(device)
        if dtype is not None:
            obj = obj.to(dtype)
        return obj
    if isinstance(obj, torch.Tensor):
        out = obj.to(device)
        return out.to(dtype) if dtype is not None and out.dtype == torch.float32 else out
    if isinstance(obj, (list, tuple)):
        return type(obj)(send_to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: send_to_device(v, device) for k, v in obj.items()}
    return obj


def mark_step(wait: bool = False) -> None:
    """Execute everything recorded for all live tensors as one XLA program (lazy mode).

    Compiled once per graph structure and cached, so a steady loop compiles nothing
    after its second step. Outside lazy mode there is nothing pending: a no-op.

    **Arguments:**
    - `wait`: block until the program has finished.
    """
    _lazy.sync()
    if wait:
        wait_device_ops()


def wait_device_ops() -> None:
    """Block until queued device work is finished."""
    jax.effects_barrier()


def optimizer_step(optimizer: torch.optim.Optimizer, barrier: bool = False, optimizer_args: dict | None = None) -> Any:
    """`optimizer.step(**optimizer_args)`; returns its result.

    Under SPMD a gradient computed from a sharded batch is already the global gradient,
    so no cross-replica reduction is needed; `barrier=True` calls `mark_step` and waits
    (as torch_xla's does).
    """
    out = optimizer.step(**(optimizer_args or {}))
    if barrier:
        mark_step(wait=True)
    return out


class ParallelLoader(DeviceLoader):
    """Yield each batch of `loader` as `jax`-device tensors sharded along the batch axis.

    **Arguments:**
    - `loader`: a torch `DataLoader` (or any iterable of tensor batches).
    - `devices`: the devices to spread over (default: all; the `jax` device without an
      index, torch_xla's `[xm.xla_device()]`, means all too); or pass `mesh`/`axis`.
    - torch_xla's keywords: `batches_per_execution` (batches recorded per `mark_step` in lazy
      mode; default 1), `device_prefetch_size` (batches placed ahead, as `prefetch`),
      `loader_prefetch_size` and `host_to_device_transfer_threads` (accepted: placement is
      asynchronous, there is no host queue or thread to size), `batchdim` (0 only) and
      `input_sharding` (None only: give `mesh`/`axis`); others raise `TypeError`.

    **Example:**
        ```python
        for x, y in ParallelLoader(loader):       # torch_xla: pl.MpDeviceLoader(loader, device)
            ...
        ```
    """

    def __init__(
        self,
        loader: Iterable,
        devices: Sequence[Any] | None = None,
        *,
        mesh: jax.sharding.Mesh | None = None,
        axis: str = "data",
        prefetch: int = 1,
        batchdim: int = 0,
        batches_per_execution: int = 1,
        loader_prefetch_size: int = 16,
        device_prefetch_size: int | None = None,
        host_to_device_transfer_threads: int = 1,
        input_sharding: Any = None,
    ) -> None:
        if batchdim != 0:
            raise NotImplementedError(
                f"ParallelLoader: batchdim={batchdim}: batches are split along dimension 0 only; "
                "move the batch dimension first (`x.movedim(batchdim, 0)`) in the loader's collate_fn"
            )
        if input_sharding is not None:
            raise NotImplementedError(
                "ParallelLoader: torch_xla's input_sharding (a ShardingSpec) is not supported; give "
                "`mesh=` (a jax.sharding.Mesh) and `axis=` (the mesh axis the batch is split over)"
            )
        if batches_per_execution < 1:
            raise ValueError(f"ParallelLoader: batches_per_execution must be >= 1, got {batches_per_execution}")
        if mesh is None:
            jdevs = None
            if devices is not None and not any(_all_devices(d) for d in devices):
                jdevs = [d if isinstance(d, jax.Device) else _jax_device(d) for d in devices]
            mesh = data_mesh(jdevs, axis)
        if device_prefetch_size is not None:
            prefetch = device_prefetch_size
        super().__init__(loader, mesh, axis, as_torch=True, prefetch=prefetch)
        self.batches_per_execution = batches_per_execution

    def __iter__(self) -> Iterator[Any]:
        i = 0
        for i, batch in enumerate(super().__iter__(), 1):
            yield batch
            # the steps on the last `batches_per_execution` batches are recorded: run them (torch_xla does)
            if _lazy.is_enabled() and i % self.batches_per_execution == 0:
                _lazy.sync()
        if _lazy.is_enabled() and i % self.batches_per_execution:  # the last, shorter group
            _lazy.sync()

    def per_device_loader(self, device: Any = None) -> ParallelLoader:
        """torch_xla compatibility: the loader itself (one process feeds all its devices)."""
        return self


class MpDeviceLoader(ParallelLoader):
    """torch_xla's `MpDeviceLoader(loader, device, **kwargs)`: `loader`'s batches on `device`.

    One JAX process drives all its local devices, so the `jax` device without an index
    (`xla_device()`) means all of them: each batch is split along dimension 0 over them (as
    torch_xla's one-process-per-device loaders together do). `jax:n` (`xla_device(n)`) places
    each batch whole on that one device. `kwargs` are `ParallelLoader`'s (torch_xla's names
    included: `batches_per_execution`, `loader_prefetch_size`, `device_prefetch_size`, ...).
    `len()` is the wrapped loader's.

    **Example:**
        ```python
        device = xm.xla_device()
        for x, y in pl.MpDeviceLoader(train_loader, device):     # x, y: jax tensors
            loss = loss_fn(model(x), y); loss.backward(); xm.optimizer_step(opt)
        ```
    """

    def __init__(self, loader: Iterable, device: Any = None, **kwargs: Any) -> None:
        if device is not None and not isinstance(device, jax.Device) and torch.device(device).type != DEVICE_TYPE:
            raise ValueError(f"MpDeviceLoader: device {device!r} is not the `jax` device (`xm.xla_device()`)")
        super().__init__(loader, None if device is None else [device], **kwargs)
        self.device = device


def _all_devices(d: Any) -> bool:
    """Whether `d` is the `jax` device without an index: all of this process's devices (SPMD)."""
    return not isinstance(d, jax.Device) and torch.device(d).index is None


def _jax_device(d: Any) -> jax.Device:
    d = torch.device(d)
    return jax.devices()[d.index or 0]


__all__ = [
    "LazyGraphWarning",
    "LazyMetrics",
    "MpDeviceLoader",
    "ParallelLoader",
    "get_ordinal",
    "is_master_ordinal",
    "clear_metrics",
    "is_xla_tensor",
    "mark_step",
    "master_print",
    "metrics",
    "metrics_report",
    "optimizer_step",
    "send_to_device",
    "use_bf16",
    "wait_device_ops",
    "world_size",
    "xla_device",
]
