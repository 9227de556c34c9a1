"""Where random ops get their JAX PRNG keys.

Inside `call_torch(..., rng=key)` / `extract`'s `fn(..., rng=key)` every random op splits
the key given for that call (thread-local). Otherwise, eagerly, keys come from a global
generator seeded by `torch.manual_seed` (or `jaxtorch.manual_seed`). An op given a torch
generator (`generator=g`, `torch.Generator(device="jax")` or a CPU one) draws its key from
`g` instead, eagerly and in lazy mode; under a JAX trace that raises `GeneratorUnderTraceError`. Under tracing with
no key given, `next_key` raises `MissingKeyError`: a key baked into a compiled function
would repeat the same randomness at every call.

Example:
    ```python
    with key_scope(jax.random.key(0)):
        k1, k2 = next_key(op), next_key(op)   # two different subkeys
    ```
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import jax

from ..._compat import TorchGenerator, disable_current_modes, trace_state_clean
from ._errors import GeneratorUnderTraceError, MissingKeyError

_lock = threading.Lock()
_global: dict[str, Any] = {"key": None, "seed": 0}
_local = threading.local()


def manual_seed(seed: int) -> None:
    """Reseed the eager generator (called by `torch.manual_seed`).

    **Arguments:**
    - `seed`: the seed (an int).

    **Returns:** None.

    **Example:**
        ```python
        jaxtorch.manual_seed(0); a = torch.rand(2, device="jax")
        jaxtorch.manual_seed(0); b = torch.rand(2, device="jax")
        assert torch.equal(a.cpu(), b.cpu())
        ```
    """
    with _lock:
        _global["seed"] = int(seed)
        _global["key"] = None


def get_state():
    """The eager generator's state (seed and key data) as a uint8 torch tensor."""
    import numpy as np
    import torch

    with _lock:
        key = _global["key"]
        data = np.asarray(jax.random.key_data(key)) if key is not None else np.zeros(2, np.uint32)
        seed = np.array([_global["seed"], key is not None], dtype=np.int64)
    return torch.from_numpy(np.concatenate([seed.view(np.uint8), data.astype(np.uint32).view(np.uint8)]).copy())


def set_state(state) -> None:
    """Restore a state from `get_state`."""
    import numpy as np

    raw = np.asarray(state.cpu().numpy() if hasattr(state, "cpu") else state, dtype=np.uint8)
    seed, has_key = raw[:16].view(np.int64)
    data = raw[16:].view(np.uint32)
    with _lock:
        _global["seed"] = int(seed)
        _global["key"] = jax.random.wrap_key_data(jax.numpy.asarray(data)) if has_key else None


def raw_state() -> tuple:
    """The eager generator's state as it is, `(seed, key)`, for `set_raw_state` (no torch
    tensor is made: safe inside torch's dispatch modes, such as a remat region's recomputation)."""
    with _lock:
        return _global["seed"], _global["key"]


def set_raw_state(state: tuple) -> None:
    """Restore a state from `raw_state`."""
    with _lock:
        _global["seed"], _global["key"] = state


def _eager_key() -> jax.Array:
    with _lock:
        key = _global["key"]
        if key is None:
            key = jax.random.key(_global["seed"])
        key, sub = jax.random.split(key)
        _global["key"] = key
    return sub


@contextlib.contextmanager
def key_scope(key):
    """Make random ops in this thread draw from `key` (None: keep the current behaviour).

    Yields the scope's cell, `[current key]`: a random op replaces the key with a fresh
    one, so `cell[0] is not key` afterwards says whether anything drew from it.
    """
    if key is None:
        yield None
        return
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    cell = [key]
    stack.append(cell)
    try:
        yield cell
    finally:
        stack.pop()


def take_generator(jargs: list, jkwargs: dict):
    """Remove a torch `Generator` from a random op's arguments (`generator=` or positional) and
    return it (None if there is none): it picks the op's key (`next_key`), the lowering never sees it.

    Example: `next_key(op, take_generator(jargs, jkwargs))`.
    """

    g = jkwargs.pop("generator", None)
    for i, a in enumerate(jargs):
        if isinstance(a, TorchGenerator):
            g, jargs[i] = a, None
    return g


def key_from_generator(generator, op=None) -> jax.Array:
    """A key drawn from a torch generator (`torch.Generator(device="jax")`, or a CPU one): one
    63-bit number from the generator's own stream, which advances it. The same seed gives the
    same keys; generators are independent of each other and of the default generator.

    Under a JAX trace it raises `GeneratorUnderTraceError`: the draw would happen once, at trace
    time, and the compiled function would repeat it at every call.

    Example:
        ```python
        g = torch.Generator(device="jax").manual_seed(1)
        k = key_from_generator(g)   # the same key after every `g.manual_seed(1)`
        ```
    """
    import torch

    if not trace_state_clean():
        raise GeneratorUnderTraceError(op)
    with disable_current_modes(), torch.no_grad():
        v = int(torch.empty((), dtype=torch.int64, device="cpu").random_(generator=generator))
    return jax.random.fold_in(jax.random.key(v & 0x7FFFFFFF), (v >> 31) & 0xFFFFFFFF)


def next_key(op=None, generator=None) -> jax.Array:
    """A fresh PRNG key for one random op (from `generator` when one is given)."""
    if generator is not None:
        return key_from_generator(generator, op)
    stack = getattr(_local, "stack", None)
    if stack and stack[-1][0] is not None:
        cell = stack[-1]
        cell[0], sub = jax.random.split(cell[0])
        return sub
    if not trace_state_clean():
        raise MissingKeyError(op)
    return _eager_key()
