"""The "jax" torch.distributed backend: `dist.all_reduce` and friends as JAX collectives.

`dist.init_process_group("jax", rank=0, world_size=N, store=dist.HashStore())` makes a process
group whose collectives run torch's functional collectives (`torch.ops._c10d_functional`), which
jaxtorch lowers to JAX collectives over mesh axes (`jaxtorch/ops/collectives.py`): torch code
written for DDP runs unchanged inside `jax.shard_map`, one torch rank per device along the axes.

| `torch.distributed` call                        | runs as                                      |
|-------------------------------------------------|----------------------------------------------|
| `all_reduce`, `all_reduce_coalesced`            | `_c10d_functional.all_reduce`, written back  |
| `broadcast`                                     | `_c10d_functional.broadcast`, written back   |
| `all_gather_into_tensor`, `all_gather`          | `_c10d_functional.all_gather_into_tensor`    |
| `reduce_scatter_tensor`, `reduce_scatter`       | `_c10d_functional.reduce_scatter_tensor`     |
| `all_to_all_single`, `all_to_all`               | `_c10d_functional.all_to_all_single`         |
| `barrier`                                       | nothing (one SPMD program has no stragglers) |
| `reduce`, `gather`, `scatter`, `send`, `recv`   | refused: `CollectiveError`                   |

The group's rank is the one given to `init_process_group` in every device's copy of the program
(it is a Python int, and the program is one for all devices): code that branches on
`dist.get_rank()` takes that branch on every device. Collectives need no rank: each device's
place along the axes is its rank.

Example:
    ```python
    dist.init_process_group("jax", rank=0, world_size=8, store=dist.HashStore())
    def step(g):
        dist.all_reduce(g)          # in place, a JAX psum over the mesh axis
        return g / dist.get_world_size()
    f = jax.shard_map(lambda g: jaxtorch.call_torch(step, g), mesh=mesh, in_specs=P("data"), out_specs=P())
    ```
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..._compat import c10d_backend_plugins
from ..core._errors import CollectiveError

BACKEND = "jax"
c10d = torch.ops._c10d_functional


class _Done(dist.Work):
    """The handle of a collective that is complete when it returns (JAX collectives are values)."""

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True


def _reduce_op(opts) -> str:
    """The functional API's name of `opts.reduceOp` ('sum', 'avg', 'premul_sum', ...)."""
    return opts.reduceOp.op.name.lower()


def _jax_tensors(what: str, tensors: Sequence[torch.Tensor]) -> None:
    """Refuse tensors that are not on the `jax` device (their values are not in the program)."""
    for t in tensors:
        if t.device.type != "jax":
            raise CollectiveError(
                f"`{what}` on the 'jax' process group got a tensor on {t.device}: its collectives are JAX "
                "collectives inside jax.shard_map / jax.pmap, over tensors on the jax device. Move the tensor "
                "(`t.to('jax')`), or create it inside the torch function jaxtorch runs (`jaxtorch.call_torch`)."
            )


class JaxProcessGroup(dist.ProcessGroup):
    """A torch process group whose collectives are JAX collectives (see the module docstring).

    Made by `dist.init_process_group("jax", ...)` / `dist.new_group(..., backend="jax")`, not directly.
    """

    def __init__(self, rank: int, size: int):
        super().__init__(rank, size)  # type: ignore[call-arg]  # torch's stub lists the store form only
        self._jax_group_name = ""
        self._jax_group_desc = ""

    # torch's ProcessGroup keeps its name on its backends; this group runs without one
    def _set_group_name(self, name: str) -> None:
        self._jax_group_name = name

    def _set_group_desc(self, desc: str) -> None:
        self._jax_group_desc = desc

    @property
    def group_name(self) -> str:  # type: ignore[override]
        return self._jax_group_name

    @property
    def group_desc(self) -> str:
        return self._jax_group_desc

    def getBackendName(self) -> str:  # (torch's name)
        return BACKEND

    def name(self) -> str:
        return BACKEND

    @property
    def _name(self) -> str:
        return self.group_name

    # ---- collectives that run ----------------------------------------------------------------
    # (the forms torch.distributed calls: a list of tensors and an options object; torch's stub types
    # them with its pybind overloads, hence the `ignore[override]`)
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> _Done:  # type: ignore[override]
        _jax_tensors("dist.all_reduce", tensors)
        op = "sum" if opts is None else _reduce_op(opts)
        for t in tensors:
            t.copy_(c10d.all_reduce(t, op, self._name))
        return _Done()

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> _Done:  # type: ignore[override]
        _jax_tensors("dist.broadcast", tensors)
        src = 0 if opts is None else opts.rootRank
        for t in tensors:
            t.copy_(c10d.broadcast(t, src, self._name))
        return _Done()

    def all_gather_single(self, output, input, opts=None):
        _jax_tensors("dist.all_gather_into_tensor", [output, input])
        output.copy_(c10d.all_gather_into_tensor(input, self.size(), self._name).reshape(output.shape))
        return _Done()

    _allgather_base = all_gather_single

    def allgather(self, output_lists, inputs, opts=None):
        for outputs, t in zip(output_lists, inputs, strict=True):
            _jax_tensors("dist.all_gather", [*outputs, t])
            gathered = c10d.all_gather_into_tensor(t.unsqueeze(0), self.size(), self._name)
            for i, out in enumerate(outputs):
                out.copy_(gathered[i])
        return _Done()

    def reduce_scatter_single(self, output, input, opts=None):
        _jax_tensors("dist.reduce_scatter_tensor", [output, input])
        op = "sum" if opts is None else _reduce_op(opts)
        output.copy_(c10d.reduce_scatter_tensor(input, op, self.size(), self._name).reshape(output.shape))
        return _Done()

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter(  # type: ignore[override]
        self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any = None
    ) -> _Done:
        op = "sum" if opts is None else _reduce_op(opts)
        for out, inputs in zip(outputs, input_lists, strict=True):
            _jax_tensors("dist.reduce_scatter", [out, *inputs])
            stacked = torch.stack(list(inputs))
            out.copy_(c10d.reduce_scatter_tensor(stacked, op, self.size(), self._name)[0])
        return _Done()

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        _jax_tensors("dist.all_to_all_single", [output, input])
        out = c10d.all_to_all_single(input, list(output_split_sizes), list(input_split_sizes), self._name)
        output.copy_(out.reshape(output.shape))
        return _Done()

    alltoall_base = all_to_all_single

    def alltoall(self, outputs, inputs, opts=None):
        _jax_tensors("dist.all_to_all", [*outputs, *inputs])
        if len({tuple(t.shape) for t in [*outputs, *inputs]}) > 1:
            raise CollectiveError.uneven_split(
                "dist.all_to_all", len(inputs), self.size(), [tuple(t.shape) for t in inputs]
            )
        exchanged = c10d.all_to_all_single(torch.stack(list(inputs)), [], [], self._name)
        for i, out in enumerate(outputs):
            out.copy_(exchanged[i])
        return _Done()

    def barrier(self, opts=None):
        return _Done()

    # ---- calls with no SPMD form -------------------------------------------------------------
    def reduce(self, *args, **kwargs):
        raise CollectiveError.unsupported_call(
            "dist.reduce", "Use `dist.all_reduce`: every rank gets the result, the destination included."
        )

    def gather(self, *args, **kwargs):
        raise CollectiveError.unsupported_call(
            "dist.gather", "Use `dist.all_gather_into_tensor` / `dist.all_gather`: every rank gets the list."
        )

    def scatter(self, *args, **kwargs):
        raise CollectiveError.unsupported_call(
            "dist.scatter",
            "Give every device its part as the shard_map's input (`in_specs=P(axis)`), or broadcast the "
            "whole tensor and slice it by position.",
        )

    def send(self, *args, **kwargs):
        raise CollectiveError.unsupported_call(
            "dist.send / dist.isend",
            "Express the exchange as a collective (all_to_all_single, all_gather_into_tensor), or use "
            "`jax.lax.ppermute` in JAX code.",
        )

    def recv(self, *args, **kwargs):
        raise CollectiveError.unsupported_call(
            "dist.recv / dist.irecv",
            "Express the exchange as a collective (all_to_all_single, all_gather_into_tensor), or use "
            "`jax.lax.ppermute` in JAX code.",
        )

    recv_anysource = recv


def _create(store, rank: int, size: int, timeout) -> JaxProcessGroup:
    """torch.distributed's backend creator for "jax" (`Backend.register_backend`)."""
    return JaxProcessGroup(rank, size)


def install_jax_backend() -> None:
    """Register the "jax" torch.distributed backend once (`dist.init_process_group("jax", ...)`).

    **Example:** `install_jax_backend(); dist.init_process_group("jax", rank=0, world_size=8, store=dist.HashStore())`.
    """
    if dist.is_available() and BACKEND.upper() not in c10d_backend_plugins():
        dist.Backend.register_backend(BACKEND, _create, devices=["jax", "cpu"])


__all__ = ["BACKEND", "JaxProcessGroup", "install_jax_backend"]
