"""Turning the interpreter on: `enable_globally`, `disable_globally`, `default_env`.

The torch mode stacks are per thread, so enabling the environment affects the thread
that enables it (documented choice: a serving thread pool or a data loader thread is
never switched on behind its back). `JaxTensor`s work in every thread regardless: their
ops always route to JAX. `enable_globally` pushes the dispatch mode only (the eager path
stays short); `default_env` and `call_torch` push the function mode too, which lets a
`backward()` under `jax.jit` trace into the same program.

Example:
    ```python
    with jaxtorch.default_env():
        x = torch.randn(3, device="jax")
    ```
"""

from __future__ import annotations

import contextlib
import threading

import torch

from ..core import _lazy
from ..tensor._device import JAX_DEVICE
from ._interpreter import JaxDispatchMode, JaxFunctionMode, jax_default_scope

_local = threading.local()


def _stack() -> list:
    s = getattr(_local, "stack", None)
    if s is None:
        s = _local.stack = []
    return s


def enable_globally(lazy: bool = False) -> None:
    """Turn jaxtorch on for this thread: torch ops on the `jax` device run as JAX ops.

    **Arguments:**
    - `lazy`: also turn on lazy mode (process-wide): ops are recorded and run as one XLA
      program at `jaxtorch.xla.mark_step()` / `jaxtorch.sync()` or when a value is read
      (see `jaxtorch.lazy`).

    **Returns:** None; `disable_globally()` undoes it.

    **Example:**
        ```python
        jaxtorch.enable_globally()
        y = torch.nn.Linear(8, 2).to("jax")(torch.randn(3, 8, device="jax"))
        jaxtorch.disable_globally()
        ```
    """
    if lazy:
        _lazy.set_enabled(True)
    if _stack():
        return
    dmode = JaxDispatchMode()
    dmode.__enter__()
    _stack().append(dmode)


def disable_globally() -> None:
    """Undo `enable_globally` for this thread (lazy mode goes off too, after executing what is pending).

    **Arguments:**
    None.

    **Returns:** None.

    **Example:**
        ```python
        jaxtorch.enable_globally()
        jaxtorch.disable_globally()   # torch as before, for this thread
        ```
    """
    _lazy.set_enabled(False)
    s = _stack()
    if not s:
        return
    s.pop().__exit__(None, None, None)


@contextlib.contextmanager
def default_env(jax_by_default: bool = False):
    """Scoped `enable_globally`. With `jax_by_default=True`, factories with no device create
    JAX values and CPU tensors are moved to JAX (what `call_torch` uses).

    **Arguments:**
    - `jax_by_default`: also make factories without a device, and CPU tensors, JAX values.

    **Returns:** a context manager: jaxtorch is on inside the block.

    **Example:**
        ```python
        with jaxtorch.default_env(jax_by_default=True):
            t = torch.zeros(3)           # on the jax device
        assert t.device.type == "jax"
        ```
    """
    with JaxFunctionMode(), JaxDispatchMode():
        if jax_by_default:
            # torch.device as a context fills `device="jax"` into every factory call, so
            # `torch.zeros(3)` / `torch.rand(3)` are JAX values (and draw from the rng key).
            with jax_default_scope(), torch.device(JAX_DEVICE):
                yield
        else:
            yield
