"""Training state, and the way back to PyTorch: `TrainState`, `select`, `load_into`.

Example:
    ```python
    state = TrainState(params, model_state, opt_state, jnp.zeros((), jnp.int32))
    jaxtorch.load_into(model, state)      # the torch module now holds the trained values and buffers
    ```
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np
import torch

from ..bridge.core._errors import DonatedStateError, ParamsError
from ..bridge.state._binding import named_state, split_state
from ..bridge.state._layouts import conv_kernels, from_kernels
from ..bridge.tensor._convert import array_to_torch
from ..bridge.tensor._tensor import JaxTensor, write


class TrainState(NamedTuple):
    """What `make_train_step`'s `step` carries from one step to the next (a pytree).

    **Arguments:**
    - `params`: the trained parameters by torch name (`extract`'s params, less those
      `trainable=` leaves out): what the optimizer updates.
    - `model_state`: the rest, by name: parameters `trainable=` leaves out, frozen
      parameters (`requires_grad=False`), buffers (`extract`'s `fn.state`). Only the
      forward changes it (BatchNorm statistics); entries it does not write stay bit-identical.
    - `opt_state`: the optax state of the trained parameters.
    - `step`: the number of optimizer updates applied (an int32 scalar array).

    **Returns:** a `NamedTuple` (so a pytree: `jax.jit`, `jaxtorch.save_checkpoint` and `jaxtorch.load_into` take
    it); made by `init()`, never by hand.

    **Example:**
        ```python
        import optax

        model = torch.nn.Linear(3, 1)
        init, step = jaxtorch.train.make_train_step(model, lambda out, y: jnp.mean((out - y) ** 2), optax.sgd(0.1))
        state = init()
        assert isinstance(state, jaxtorch.train.TrainState) and set(state.params) == {"weight", "bias"}
        state, loss = step(state, jnp.ones((4, 3)), jnp.ones((4, 1)))
        assert int(state.step) == 1
        ```
    """

    params: dict[str, jax.Array]
    model_state: dict[str, jax.Array]
    opt_state: object
    step: jax.Array


Trainable = None | str | Iterable[str] | Callable[[str, jax.Array], bool]


def check_not_donated(tree: Any, where: str, cause: BaseException | None = None) -> None:
    """Raise `DonatedStateError` (from `cause`) if an array in `tree` was deleted (donated to a step).

    **Example:** `check_not_donated(state, "step")` before running a step on `state`.
    """
    if not any(isinstance(leaf, jax.Array) and leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(tree)):
        return
    gone = [
        jax.tree_util.keystr(path)
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
        if isinstance(leaf, jax.Array) and leaf.is_deleted()
    ]
    if gone:
        raise DonatedStateError(
            f"{where}: {len(gone)} arrays of this state were donated to an earlier step and no longer exist "
            f"(first: {gone[0]}): `make_train_step` donates the state it is given (its memory holds the new "
            "state), so use the state each step returns (`state, loss = step(state, x, y)`). To keep old "
            "states usable, build the step with `make_train_step(..., donate=False)`, or copy one first "
            "(`jax.tree_util.tree_map(jnp.copy, state)`)."
        ) from cause


def select(params: Mapping[str, Any], trainable: Trainable, buffers: Iterable[str] = ()) -> dict[str, bool]:
    """Which entries of `params` are trained: `{name: bool}`.

    **Arguments:**
    - `params`: the `extract`-style dict (trainable parameters; arrays or
      `jax.ShapeDtypeStruct`s).
    - `trainable`: `None` (every floating-point parameter), a glob or list of globs
      matched against names (`"fc.*"`, `["*.bias", "head.*"]`), or a predicate
      `(name, array) -> bool`.
    - `buffers`: names that are buffers (never trained).

    **Returns:** a dict with the same keys as `params`.
    """
    buffers = set(buffers)
    if trainable is None:
        wanted = lambda name, value: True
    elif callable(trainable):
        wanted = trainable
    else:
        globs = [trainable] if isinstance(trainable, str) else list(trainable)
        wanted = lambda name, value: any(fnmatch.fnmatchcase(name, g) for g in globs)
    return {
        name: name not in buffers and jax.numpy.issubdtype(value.dtype, jax.numpy.inexact) and bool(wanted(name, value))
        for name, value in params.items()
    }


def buffer_names(module: torch.nn.Module) -> set[str]:
    """Names of the module's buffers (as `named_state` keys them)."""
    params = {id(p) for p in module.parameters()}
    return {name for name, t in named_state(module).items() if id(t) not in params}


def load_into(
    model: torch.nn.Module, params: dict | TrainState, state: dict | None = None, *, strict: bool = True
) -> torch.nn.Module:
    """Write trained values (parameters and state) back into a torch module, in place.

    Tied weights are one tensor in torch, so writing one name updates every name tied to
    it. Convolution kernels in Flax's layout (`conv1.kernel`, from `conv_layout="flax"`)
    are transposed back to torch's. Values are converted to each tensor's dtype; sharded
    arrays are gathered. A module on the `jax` device gets the arrays themselves (no host
    copy).

    **Arguments:**
    - `model`: the module the values came from (`extract`, `make_train_step`).
    - `params`: `{name: array}` (`extract`'s params), or a whole `TrainState` (its
      `params` and `model_state` are written).
    - `state`: `{name: array}` for the state (`fn.state`, what a mutable `fn` returned);
      None leaves the module's buffers and frozen parameters as they are.
    - `strict`: raise for names the module does not have, or for module tensors not given:
      every trainable parameter, and every state entry when `state` is given.

    A module built on the meta device (`with torch.device("meta")`, for `load_params`) gets
    CPU tensors holding the values, as `load_state_dict(assign=True)` would: each in the
    module's dtype, parameters stay `Parameter`s with their `requires_grad`, tied weights stay
    one tensor. Every meta tensor needs a value (pass `state` too); else `ParamsError`, before
    anything is written.

    **Returns:** `model`.

    **Example:**
        ```python
        import optax

        model = torch.nn.Linear(3, 1)
        init, step = jaxtorch.train.make_train_step(model, lambda out, y: jnp.mean((out - y) ** 2), optax.sgd(0.1))
        state, loss = step(init(), jnp.ones((4, 3)), jnp.ones((4, 1)))
        jaxtorch.load_into(model, state)                      # the trained weights, back in the torch module
        assert torch.allclose(model.weight, torch.from_numpy(jax.device_get(state.params["weight"])))
        ```
    """
    check_not_donated((params, state), "load_into")
    if isinstance(params, TrainState):
        if state is not None:
            raise TypeError("load_into: a TrainState carries its own state (`model_state`); do not pass `state=` too")
        whole: Any = params
        params, state = dict(whole.params), dict(whole.model_state)
    values: dict = {**params, **(state or {})}
    bad = [n for n, v in values.items() if not isinstance(v, torch.Tensor) and not hasattr(v, "shape")]
    if bad:
        raise ParamsError(
            f"load_into: {bad[:5]} {'is not an array' if len(bad) == 1 else 'are not arrays'} "
            f"({type(values[bad[0]]).__name__}); give jax.Arrays, NumPy arrays or torch tensors "
            "(`jnp.asarray(value)`)"
        )
    values = from_kernels(values, conv_kernels(model))
    targets: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    targets.update(dict(model.named_buffers(remove_duplicate=False)))
    if strict:
        unknown = sorted(set(values) - set(targets))
        covered = {id(targets[n]) for n in values if n in targets}
        wanted_params, wanted_state = split_state(model)
        wanted = {**wanted_params, **(wanted_state if state is not None else {})}
        missing = sorted(n for n, t in wanted.items() if id(t) not in covered)
        if unknown or missing:
            raise KeyError(
                f"load_into: names not in the module: {unknown}; module tensors not given: {missing}"
                + (
                    " (frozen or `trainable=`-excluded parameters are in a TrainState's `model_state`: "
                    "pass the whole TrainState, or `state=`)"
                    if missing
                    else ""
                )
            )
    _check_meta_covered(targets, values)
    made: dict[int, torch.Tensor] = {}  # id(meta tensor) -> its materialized tensor (tied names share it)
    with torch.no_grad():
        for name, value in values.items():
            t = targets.get(name)
            if t is None:
                continue
            if tuple(value.shape) != tuple(t.shape):
                raise ValueError(f"load_into: {name} has shape {tuple(value.shape)}, the module's is {tuple(t.shape)}")
            if t.is_meta:
                made.setdefault(id(t), _materialized(t, value))
            elif isinstance(t, JaxTensor):
                write(t, jax.numpy.asarray(value).astype(t.elem.dtype))
            else:
                t.copy_(_host(value).to(t.dtype))
    _assign(model, targets, made)
    return model


def _check_meta_covered(targets: Mapping[str, torch.Tensor], values: Mapping[str, Any]) -> None:
    """Raise before writing anything when a tensor of the module is on the meta device and no
    value is given for it under any of its names: it would stay without data."""
    given = {id(targets[n]) for n in values if n in targets}
    left = sorted(n for n, t in targets.items() if t.is_meta and id(t) not in given)
    if left:
        raise ParamsError(
            f"load_into: {left[:8]}{' ...' if len(left) > 8 else ''} ({len(left)}) are on the meta device and no "
            "value is given for them, so they would stay without data. Pass them too (`load_params` returns "
            "`(params, state)`: `load_into(model, params, state)`), or give the module storage first "
            "(`model.to_empty(device='cpu')`, `Module.to_empty`) and initialize what you do not load."
        )


def _materialized(t: torch.Tensor, value: Any) -> torch.Tensor:
    """A CPU tensor holding `value` in `t`'s dtype, for the meta tensor `t`: a Parameter (with
    `t`'s `requires_grad`) when `t` is one, as `load_state_dict(assign=True)` keeps them."""
    data = _host(value).to(t.dtype).clone()  # its own storage: never a view of a JAX buffer
    if isinstance(t, torch.nn.Parameter):
        return torch.nn.Parameter(data, requires_grad=t.requires_grad)
    return data


def _assign(model: torch.nn.Module, targets: Mapping[str, torch.Tensor], made: Mapping[int, torch.Tensor]) -> None:
    """Put each materialized tensor in place of its meta tensor, under every name it has (tied
    weights stay one tensor; a buffer stays a buffer, persistent or not)."""
    for name, t in targets.items():
        new = made.get(id(t))
        if new is None:
            continue
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        slots: dict[str, Any] = module._parameters if leaf in module._parameters else module._buffers
        slots[leaf] = new


def _host(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu() if not isinstance(value, JaxTensor) else array_to_torch(value.elem, copy=False)
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        from jax.experimental import multihost_utils

        value = np.asarray(multihost_utils.process_allgather(value, tiled=True))
    if isinstance(value, np.ndarray):
        value = jax.numpy.asarray(value)
    return array_to_torch(value, copy=False)  # read at once by copy_


__all__ = ["DonatedStateError", "TrainState", "buffer_names", "check_not_donated", "load_into", "select"]
