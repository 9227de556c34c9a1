"""torch_xla-style helpers for PyTorch-first training on the `jax` device.

Familiar names, each doing the JAX-native thing. As in torch_xla, the device is lazy:
`xla_device()` turns on jaxtorch's lazy mode (`jaxtorch.bridge.core._lazy`), so ops are
recorded and each step runs as one cached XLA program at `mark_step()` (which
`optimizer_step(barrier=True)` and `ParallelLoader` call for you); `metrics_report()`
shows compilations, cache hits and what forced unplanned executions. One JAX process drives all of its local
devices (SPMD), so "ordinal" and "world size" count processes (`jax.process_index()`,
`jax.process_count()`), not devices; gradients computed on sharded data are already
global, so `optimizer_step` needs no all-reduce.

**Example:**
    ```python
    import jaxtorch.xla as xm

    device = xm.xla_device()                           # lazy mode on
    model = xm.send_to_device(torch.nn.Linear(4, 1))   # bfloat16 if JAXTORCH_USE_BF16=1
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train_loader = [(torch.ones(8, 4), torch.zeros(8, 1)) for _ in range(2)]
    for x, y in xm.ParallelLoader(train_loader):       # batches sharded over all devices
        loss = torch.nn.functional.mse_loss(model(x), y); loss.backward()
        xm.optimizer_step(opt); opt.zero_grad()
        xm.mark_step()                                 # (ParallelLoader also calls it)
    xm.master_print("done"); print(xm.metrics_report())
    jaxtorch.disable_globally()                        # lazy mode off again
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

    **Arguments:**
    - `n`: a device index (`jax.devices()[n]`), or None: the `jax` device (all local devices).
    - `lazy`: turn lazy mode on (default, as torch_xla's device is lazy).

    **Returns:** a `torch.device` (`jax` or `jax:n`).

    **Example:**
        ```python
        import jaxtorch.xla as xm

        device = xm.xla_device()                   # lazy mode on
        t = torch.ones(2, device=device) * 3       # recorded
        xm.mark_step()                             # run as one program
        assert t.cpu().tolist() == [3.0, 3.0]
        jaxtorch.disable_globally()                 # lazy mode off again
        ```
    """
    if lazy:
        _lazy.set_enabled(True)
    return torch.device(DEVICE_TYPE) if n is None else torch.device(DEVICE_TYPE, n)


def is_xla_tensor(t: Any) -> bool:
    """Whether `t` is a torch tensor on the `jax` device.

    **Arguments:**
    - `t`: any value.

    **Returns:** a bool.

    **Example:**
        ```python
        assert jaxtorch.xla.is_xla_tensor(torch.ones(1, device="jax")) and not jaxtorch.xla.is_xla_tensor(torch.ones(1))
        ```
    """
    return isinstance(t, JaxTensor) or (isinstance(t, torch.Tensor) and t.device.type == DEVICE_TYPE)


def get_ordinal() -> int:
    """This process's index among the processes of the run (`jax.process_index()`).

    **Arguments:**
    None.

    **Returns:** an int, 0 in a single-process run.

    **Example:**
        ```python
        assert jaxtorch.xla.get_ordinal() == jax.process_index()
        ```
    """
    return jax.process_index()


def world_size() -> int:
    """How many processes take part (`jax.process_count()`); each drives its local devices.

    **Arguments:**
    None.

    **Returns:** an int, 1 in a single-process run.

    **Example:**
        ```python
        assert jaxtorch.xla.world_size() == jax.process_count()
        ```
    """
    return jax.process_count()


def is_master_ordinal() -> bool:
    """Whether this is process 0.

    **Arguments:**
    None.

    **Returns:** a bool: `get_ordinal() == 0`.

    **Example:**
        ```python
        if jaxtorch.xla.is_master_ordinal():
            print("process 0 writes the checkpoint")
        ```
    """
    return jax.process_index() == 0


def master_print(*args: Any, **kwargs: Any) -> None:
    """`print`, on process 0 only.

    **Arguments:**
    - `args`, `kwargs`: what `print` takes.

    **Returns:** None.

    **Example:**
        ```python
        jaxtorch.xla.master_print("loss", 0.25)      # printed once, by process 0
        ```
    """
    if is_master_ordinal():
        print(*args, **kwargs)


def use_bf16() -> bool:
    """Whether the `JAXTORCH_USE_BF16` switch is on (like torch_xla's `XLA_USE_BF16`).

    **Arguments:**
    None (reads the environment variable `JAXTORCH_USE_BF16`).

    **Returns:** True when `JAXTORCH_USE_BF16` is set to a true value (`1`).

    **Example:**
        ```python
        import os

        assert jaxtorch.xla.use_bf16() == (os.environ.get("JAXTORCH_USE_BF16", "0") not in ("", "0"))
        ```
    """
    return os.environ.get(BF16_ENV, "0").lower() not in ("", "0", "false", "no", "off")


def send_to_device(obj: Any, device: torch.device | str | None = None) -> Any:
    """Move a module, tensor or nested structure of tensors to the `jax` device.

    With `JAXTORCH_USE_BF16=1`, float32 parameters and tensors become bfloat16 on the way
    (the model then computes in bfloat16, as torch_xla does with `XLA_USE_BF16=1`).

    **Arguments:**
    - `obj`: a `torch.nn.Module`, a tensor, or a nested structure (lists, tuples, dicts) of tensors.
    - `device`: the target (default: the `jax` device).

    **Returns:** `obj` on the device (a module is moved in place and returned).

    **Example:**
        ```python
        model = jaxtorch.xla.send_to_device(torch.nn.Linear(2, 2))
        batch = jaxtorch.xla.send_to_device({"x": torch.ones(3, 2)})
        assert model.weight.device.type == "jax" and batch["x"].device.type == "jax"
        ```
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

    **Returns:** None.

    **Example:**
        ```python
        with jaxtorch.lazy():
            t = torch.ones(3, device="jax").cumsum(0)   # recorded, not run
            jaxtorch.xla.mark_step(wait=True)            # run (and wait for it)
        assert t.cpu().tolist() == [1.0, 2.0, 3.0]
        ```
    """
    _lazy.sync()
    if wait:
        wait_device_ops()


def wait_device_ops() -> None:
    """Block until queued device work is finished.

    **Arguments:**
    None.

    **Returns:** None, once the device is idle.

    **Example:**
        ```python
        t = torch.ones(1000, device="jax") @ torch.ones(1000, device="jax")
        jaxtorch.xla.wait_device_ops()               # e.g. before reading a timer
        ```
    """
    jax.effects_barrier()


def optimizer_step(optimizer: torch.optim.Optimizer, barrier: bool = False, optimizer_args: dict | None = None) -> Any:
    """`optimizer.step(**optimizer_args)`; returns its result.

    Under SPMD a gradient computed from a sharded batch is already the global gradient,
    so no cross-replica reduction is needed; `barrier=True` calls `mark_step` and waits
    (as torch_xla's does).

    **Arguments:**
    - `optimizer`: a torch optimizer.
    - `barrier`: also `mark_step(wait=True)` after the step.
    - `optimizer_args`: keyword arguments for `optimizer.step`.

    **Returns:** what `optimizer.step` returns (the loss, with a closure).

    **Example:**
        ```python
        model = torch.nn.Linear(2, 1).to("jax")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.ones(4, 2, device="jax")).sum().backward()
        jaxtorch.xla.optimizer_step(opt)
        ```
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

    **Returns:** an iterable of batches of `jax`-device tensors (`per_device_loader(device)` returns the loader
    itself, as torch_xla's).

    **Example:**
        ```python
        batches = [(torch.ones(8, 3), torch.zeros(8)) for _ in range(2)]   # e.g. a torch DataLoader
        for x, y in jaxtorch.xla.ParallelLoader(batches):                  # torch_xla: pl.ParallelLoader(...)
            assert x.device.type == "jax" and x.shape == (8, 3)
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

    **Arguments:**
    - `loader`: a torch `DataLoader` (or any iterable of tensor batches).
    - `device`: the `jax` device (all local devices) or `jax:n` (one).
    - `kwargs`: the options of `ParallelLoader`.

    **Returns:** an iterable of batches of `jax`-device tensors.

    **Example:**
        ```python
        import jaxtorch.xla as xm

        model = torch.nn.Linear(3, 1).to("jax")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        batches = [(torch.ones(8, 3), torch.zeros(8, 1)) for _ in range(2)]
        for x, y in xm.MpDeviceLoader(batches, xm.xla_device(lazy=False)):
            torch.nn.functional.mse_loss(model(x), y).backward()
            xm.optimizer_step(opt); opt.zero_grad()
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
