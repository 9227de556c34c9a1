"""Turning the interpreter on: `enable_globally`, `disable_globally`, `default_env`.

The torch mode stacks are per thread, so enabling the environment affects the thread
that enables it (documented choice: a serving thread pool or a data loader thread is
never switched on behind its back). `JaxTensor`s work in every thread regardless: their
ops always route to JAX; what the environment adds is the two modes (factories such as
`torch.randn(..., device="jax")`, and named scopes).

Example:
    ```python
    with jaxtorch.default_env():
        x = torch.randn(3, device="jax")
    ```
"""

from __future__ import annotations

import contextlib
import threading

from .interpreter import JaxDispatchMode, JaxFunctionMode, jax_default_scope

_local = threading.local()


def _stack() -> list:
    s = getattr(_local, "stack", None)
    if s is None:
        s = _local.stack = []
    return s


def enable_globally() -> None:
    """Turn jaxtorch on for this thread: torch ops on the `jax` device run as JAX ops.

    **Example:**
        ```python
        import jaxtorch; jaxtorch.enable_globally()
        m = MyModel().to("jax"); y = m(torch.randn(3, 8, device="jax"))
        ```
    """
    if _stack():
        return
    fmode, dmode = JaxFunctionMode(), JaxDispatchMode()
    fmode.__enter__()
    dmode.__enter__()
    _stack().append((fmode, dmode))


def disable_globally() -> None:
    """Undo `enable_globally` for this thread."""
    s = _stack()
    if not s:
        return
    fmode, dmode = s.pop()
    dmode.__exit__(None, None, None)
    fmode.__exit__(None, None, None)


@contextlib.contextmanager
def default_env(jax_by_default: bool = False):
    """Scoped `enable_globally`. With `jax_by_default=True`, factories with no device create
    JAX values and CPU tensors are moved to JAX (what `call_torch` uses)."""
    with JaxFunctionMode(), JaxDispatchMode():
        if jax_by_default:
            with jax_default_scope():
                yield
        else:
            yield
