"""Where random ops get their JAX PRNG keys.

Inside `call_torch(..., rng=key)` / `extract`'s `fn(..., rng=key)` every random op splits
the key given for that call (thread-local). Otherwise, eagerly, keys come from a global
generator seeded by `torch.manual_seed` (or `jaxtorch.manual_seed`). Under tracing with
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
from jax._src import core as _jax_core

from ._errors import MissingKeyError

_lock = threading.Lock()
_global: dict[str, Any] = {"key": None, "seed": 0}
_local = threading.local()


def manual_seed(seed: int) -> None:
    """Reseed the eager generator (called by `torch.manual_seed`)."""
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


def next_key(op=None) -> jax.Array:
    """A fresh PRNG key for one random op."""
    stack = getattr(_local, "stack", None)
    if stack and stack[-1][0] is not None:
        cell = stack[-1]
        cell[0], sub = jax.random.split(cell[0])
        return sub
    if not _jax_core.trace_state_clean():
        raise MissingKeyError(op)
    return _eager_key()
