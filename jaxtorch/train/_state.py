"""Training state, and the way back to PyTorch: `TrainState`, `select`, `load_into`.

Example:
    ```python
    state = TrainState(params, opt_state, jnp.zeros((), jnp.int32))
    jaxtorch.load_into(model, state.params)      # the torch module now holds the trained values
    ```
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable
from typing import NamedTuple

import jax
import numpy as np
import torch

from ..bridge.state._binding import named_state
from ..bridge.state._layouts import conv_kernels, from_kernels
from ..bridge.tensor._convert import array_to_torch
from ..bridge.tensor._tensor import JaxTensor, write


class TrainState(NamedTuple):
    """What `make_train_step`'s `step` carries from one step to the next (a pytree).

    - `params`: every parameter and buffer of the model by torch name (as `extract` gives).
    - `opt_state`: the optax state of the trainable parameters.
    - `step`: the number of optimizer updates applied (an int32 scalar array).
    """

    params: dict[str, jax.Array]
    opt_state: object
    step: jax.Array


Trainable = None | str | Iterable[str] | Callable[[str, jax.Array], bool]


def select(params: dict[str, jax.Array], trainable: Trainable, buffers: Iterable[str] = ()) -> dict[str, bool]:
    """Which entries of `params` are trained: `{name: bool}`.

    **Arguments:**
    - `params`: the `extract`-style dict.
    - `trainable`: `None` (every floating-point parameter), a glob or list of globs
      matched against names (`"fc.*"`, `["*.bias", "head.*"]`), or a predicate
      `(name, array) -> bool`.
    - `buffers`: names that are buffers (never trained).

    **Returns:** a dict with the same keys as `params`.
    """
    buffers = set(buffers)
    if trainable is None:
        wanted = lambda name, value: True  # noqa: E731
    elif callable(trainable):
        wanted = trainable
    else:
        globs = [trainable] if isinstance(trainable, str) else list(trainable)
        wanted = lambda name, value: any(fnmatch.fnmatchcase(name, g) for g in globs)  # noqa: E731
    return {
        name: name not in buffers and jax.numpy.issubdtype(value.dtype, jax.numpy.inexact) and bool(wanted(name, value))
        for name, value in params.items()
    }


def buffer_names(module: torch.nn.Module) -> set[str]:
    """Names of the module's buffers (as `named_state` keys them)."""
    params = {id(p) for p in module.parameters()}
    return {name for name, t in named_state(module).items() if id(t) not in params}


def load_into(model: torch.nn.Module, params: dict, *, strict: bool = True) -> torch.nn.Module:
    """Write trained values (parameters and buffers) back into a torch module, in place.

    Tied weights are one tensor in torch, so writing one name updates every name tied to
    it. Convolution kernels in Flax's layout (`conv1.kernel`, from `conv_layout="flax"`)
    are transposed back to torch's. Values are converted to each tensor's dtype; sharded
    arrays are gathered. A module on the `jax` device gets the arrays themselves (no host
    copy).

    **Arguments:**
    - `model`: the module `params` came from (`extract`, `make_train_step`).
    - `params`: `{name: array}`, e.g. `state.params`.
    - `strict`: raise `KeyError` for names the module does not have, or module tensors
      `params` does not cover.

    **Returns:** `model`.

    **Example:**
        ```python
        jaxtorch.load_into(model, state.params)
        torch.save(model.state_dict(), "model.pt")
        ```
    """
    params = from_kernels(params, conv_kernels(model))
    targets: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    targets.update(dict(model.named_buffers(remove_duplicate=False)))
    if strict:
        unknown = sorted(set(params) - set(targets))
        covered = {id(targets[n]) for n in params if n in targets}
        missing = sorted(n for n, t in named_state(model).items() if id(t) not in covered)
        if unknown or missing:
            raise KeyError(f"load_into: names not in the module: {unknown}; module tensors not given: {missing}")
    with torch.no_grad():
        for name, value in params.items():
            t = targets.get(name)
            if t is None:
                continue
            if tuple(value.shape) != tuple(t.shape):
                raise ValueError(f"load_into: {name} has shape {tuple(value.shape)}, the module's is {tuple(t.shape)}")
            if isinstance(t, JaxTensor):
                write(t, jax.numpy.asarray(value).astype(t.elem.dtype))
            else:
                t.copy_(_host(value).to(t.dtype))
    return model


def _host(value) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu() if not isinstance(value, JaxTensor) else array_to_torch(value.elem, copy=False)
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        from jax.experimental import multihost_utils

        value = np.asarray(multihost_utils.process_allgather(value, tiled=True))
    if isinstance(value, np.ndarray):
        value = jax.numpy.asarray(value)
    return array_to_torch(value, copy=False)  # read at once by copy_


__all__ = ["TrainState", "buffer_names", "load_into", "select"]
