"""`JaxModule`: an Equinox or Flax (nnx) module as a `torch.nn.Module`.

Its trainable JAX parameters appear as torch `Parameter`s (on the `jax` device) that a torch
optimizer can train, and its other state (nnx `BatchStat` running statistics, `Rngs` keys and
counts, any other `nnx.Variable`) as torch buffers; `forward` runs the JAX module through
`call_jax`, so gradients come from `jax.vjp`, and writes the state the call changed back into
the buffers (in place, so `jaxtorch.jit` and `make_train_step` carry it like a torch BatchNorm's).

Modes follow torch's `training` flag, checked at each call:
- nnx: `.train()` / `.eval()` of the wrapper call nnx's `Module.train()` / `Module.eval()` on the
  module it runs (`deterministic` and `use_running_average` of every `Dropout` / `BatchNorm`);
  a new `JaxModule` is in training mode, like every torch module.
- Equinox: the flag sets every `inference` field (`eqx.nn.inference_mode(model, not training)`).
  Equinox layers take their randomness as an argument, so pass it: `head(x, key=key)` (an
  `eqx.nn.Dropout` in training mode without a key raises Equinox's own error). Stateful Equinox
  layers (`eqx.nn.BatchNorm`, `SpectralNorm`: `eqx.nn.State`) are refused with a clear error.

Example:
    ```python
    head = jaxtorch.JaxModule(eqx.nn.Linear(16, 4, key=jax.random.key(0)))
    opt = torch.optim.Adam(head.parameters(), lr=1e-3)
    loss = head(features).square().mean(); loss.backward(); opt.step()

    bn = jaxtorch.JaxModule(nnx.BatchNorm(4, rngs=nnx.Rngs(0)))
    bn(x)            # training mode: batch statistics, running_mean/var buffers updated
    bn.eval(); bn(x) # the running statistics, as nnx's eval mode
    ```
"""

from __future__ import annotations

import copy
import re
import sys
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import torch

from ..core._errors import JaxtorchError
from ..tensor._autograd import call_jax
from ..tensor._tensor import JaxTensor


def _is_nnx(module: Any) -> bool:
    """Whether `module` is a Flax `nnx.Module`, without importing Flax.

    An nnx module exists only once `flax.nnx` was imported, so the check reads `sys.modules`: a
    Flax that is missing, or fails to import on this JAX (flax 0.12.8 on JAX 0.12 fails with other
    errors than `ImportError`), leaves Equinox modules working.

    >>> _is_nnx(eqx.nn.Linear(2, 2, key=jax.random.key(0)))
    False
    """
    nnx = sys.modules.get("flax.nnx")
    cls = getattr(nnx, "Module", None)
    return isinstance(cls, type) and isinstance(module, cls)


def _name(path: Any) -> str:
    """A torch attribute name for a pytree path: `(.layers, [0], .weight)` -> `layers_0_weight`."""
    name = "_".join(
        re.sub(r"\W+", "_", str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))).strip("_") for k in path
    )
    return name or "param"


def _is_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


_SIGNED = {"uint16": "int16", "uint32": "int32", "uint64": "int64"}  # torch.save has no storage for these


def _codec(leaf: Any) -> tuple[Any, Any]:
    """How `_encode` stores a state leaf: (its PRNG key implementation or None, its array dtype)."""
    if _is_key(leaf):
        return jax.random.key_impl(leaf), jax.random.key_data(leaf).dtype
    return None, getattr(leaf, "dtype", None)


def _encode(leaf: Any) -> Any:
    """A state leaf as an array a torch buffer can hold (and `torch.save` write): a typed PRNG key
    as its raw key data, an unsigned 16/32/64-bit integer bit-cast to the signed type of its width.

    >>> _encode(jax.random.key(0)).dtype
    dtype('int32')
    """
    x = jax.random.key_data(leaf) if _is_key(leaf) else leaf
    signed = _SIGNED.get(str(getattr(x, "dtype", "")))
    return jax.lax.bitcast_convert_type(x, signed) if signed else x


def _decode(leaves: list, codecs: list) -> list:
    """Undo `_encode` leaf by leaf (`codecs[i]` is `_codec` of the original leaf `i`)."""
    out = []
    for x, (impl, dtype) in zip(leaves, codecs):
        if dtype is not None and str(dtype) in _SIGNED:
            x = jax.lax.bitcast_convert_type(x, dtype)
        out.append(x if impl is None else jax.random.wrap_key_data(x, impl=impl))
    return out


def _refuse_eqx_state(module: Any) -> None:
    """Raise for an Equinox module holding `eqx.nn.StateIndex` (BatchNorm, SpectralNorm): its state is
    passed and returned by the caller (`model(x, state) -> (y, state)`), which a torch `forward` has no place for."""
    is_index = lambda x: isinstance(x, eqx.nn.StateIndex)
    if any(is_index(x) for x in jax.tree_util.tree_leaves(module, is_leaf=is_index)):
        raise JaxtorchError(
            "JaxModule cannot wrap an Equinox module with state (eqx.nn.State: eqx.nn.BatchNorm, SpectralNorm): "
            "its call takes and returns the state, which torch's forward has no place for. Use flax.nnx.BatchNorm "
            "(its running statistics become torch buffers), or call the Equinox model with its state through "
            "jaxtorch.call_jax and keep the state yourself."
        )


_TREEDEFS = ("_param_def", "_state_def")


class _Skeleton:
    """A pickled treedef: the tree with 0 at each leaf (`__setstate__` takes its structure again)."""

    def __init__(self, tree: Any):
        self.tree = tree


class JaxModule(torch.nn.Module):
    """Wrap an `equinox.Module` or `flax.nnx.Module` so torch code can call and train it.

    - **Parameters**: Equinox's inexact arrays and nnx's floating `Param`s become torch
      Parameters (named by their path: `lin_kernel_value`), trained by a torch optimizer;
      `loss.backward()` gives the gradients `jax.grad` / `nnx.grad` give.
    - **State**: every other nnx Variable (`BatchStat` running statistics, `Rngs` keys and
      counts) becomes a buffer (in `state_dict`, never trained), written in place after each
      call with what the call left in it, exactly as calling the nnx module updates it (also
      under `jaxtorch.jit` / `compile` and `no_grad`).
    - **Modes** follow torch's `training` flag at each call: nnx's `Module.train()` /
      `.eval()` (`Dropout.deterministic`, `BatchNorm.use_running_average`), Equinox's
      `eqx.nn.inference_mode`. A new `JaxModule` is in training mode, as every torch module.
    - **Randomness**: nnx `Dropout` draws from the module's own `Rngs` stream (fresh each call,
      the draws nnx makes; `torch.manual_seed` does not reseed it). Equinox takes its key as an
      argument: `m(x, key=key)`; an `eqx.nn.Dropout` in training mode without one raises
      Equinox's error.
    - **Refused**: Equinox stateful layers (`eqx.nn.BatchNorm`, `SpectralNorm`: `eqx.nn.State`)
      raise `JaxtorchError` at construction (use `nnx.BatchNorm`, or `call_jax` with the state).
    - **Copies**: `copy.deepcopy` and `torch.save`/`torch.load` give working copies; a module
      whose static part does not pickle (an Equinox MLP holding `jax.nn.relu`) refuses
      `torch.save` naming `state_dict`.

    **Arguments:**
    - `module`: an `equinox.Module` or a `flax.nnx.Module`.

    **Returns:** a `torch.nn.Module`; calling it with torch tensors (on the `jax` device or the CPU) runs the JAX
    module and returns torch tensors on the `jax` device, differentiable by `loss.backward()`.

    **Example:**
        ```python
        import equinox as eqx

        lin = jaxtorch.JaxModule(eqx.nn.Linear(3, 2, key=jax.random.key(0)))
        opt = torch.optim.SGD(lin.parameters(), lr=0.1)
        loss = lin(torch.ones(3, device="jax")).sum()
        loss.backward()
        opt.step()                          # the Equinox weights, trained by torch
        ```
    """

    _static: Any  # nnx's GraphDef, or the non-trainable part of the Equinox module

    def __init__(self, module: Any):
        super().__init__()
        if _is_nnx(module):
            from flax import nnx

            self._kind = "nnx"
            self._static, params, state = nnx.split(module, nnx.Param, ...)  # type: ignore[misc]
        else:
            _refuse_eqx_state(module)
            self._kind = "eqx"
            params, self._static = eqx.partition(module, eqx.is_inexact_array)
            state = {}
        self._param_names, self._param_def = self._register(params, self.register_parameter, True)
        state_leaves = jax.tree_util.tree_leaves(state)
        self._codecs = [_codec(x) for x in state_leaves]
        self._state_names, self._state_def = self._register(state, self.register_buffer, False)

    def _register(self, tree: Any, register: Callable[..., Any], as_param: bool) -> tuple[list[str], Any]:
        """Register each leaf of `tree` as a Parameter (`as_param`) or buffer; -> (names, treedef)."""
        leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
        names: list[str] = []
        for path, leaf in leaves_with_path:
            name = _name(path)
            while hasattr(self, name) or name in names:
                name += "_"
            names.append(name)
            tensor = JaxTensor(_encode(leaf))
            register(name, torch.nn.Parameter(tensor, requires_grad=True) if as_param else tensor)
        return names, treedef

    def _rebuild(self, params: list, state: list, training: bool | None = None) -> Any:
        """The JAX module from parameter and (encoded) state leaves, in `training` mode (None: as stored)."""
        tree = jax.tree_util.tree_unflatten(self._param_def, params)
        if self._kind == "nnx":
            from flax import nnx

            rest = jax.tree_util.tree_unflatten(self._state_def, _decode(state, self._codecs))
            module = nnx.merge(self._static, tree, rest)
            if training is not None:
                module.train() if training else module.eval()
            return module
        module = eqx.combine(tree, self._static)
        return module if training is None else eqx.nn.inference_mode(module, not training)

    def _run(self, params: list, state: list, training: bool, *args: Any, **kwargs: Any) -> tuple[Any, list]:
        """The pure function `forward` runs: (output, the module's state leaves after the call)."""
        module = self._rebuild(params, state, training)
        out = module(*args, **kwargs)
        if self._kind != "nnx":
            return out, []
        from flax import nnx

        new_state = nnx.split(module, nnx.Param, ...)[2]  # type: ignore[misc]
        new_leaves = [jax.lax.stop_gradient(_encode(x)) for x in jax.tree_util.tree_leaves(new_state)]
        if len(new_leaves) != len(state):
            raise JaxtorchError(
                f"the nnx module's state changed structure during its call ({len(state)} -> {len(new_leaves)} "
                "variables): JaxModule keeps a fixed set of buffers; create every Variable in __init__."
            )
        return out, new_leaves

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        params = [getattr(self, n) for n in self._param_names]
        state = [getattr(self, n) for n in self._state_names]
        out, new_state = call_jax(self._run, params, state, self.training, *args, **kwargs)
        with torch.no_grad():
            for buffer, new in zip(state, new_state):
                buffer.copy_(new.detach())
        return out

    def to_jax_module(self) -> Any:
        """The wrapped JAX module with the current (possibly trained) parameters and state, in the
        mode it was given (its own `deterministic` / `use_running_average` / `inference` flags)."""
        params = [getattr(self, n).elem for n in self._param_names]
        return self._rebuild(params, [getattr(self, n).elem for n in self._state_names])

    def __deepcopy__(self, memo: dict) -> JaxModule:
        """A copy with its own parameters and buffers; the static parts (immutable) are shared."""
        shared = ("_static", *_TREEDEFS, "_codecs")
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for k, v in self.__dict__.items():
            new.__dict__[k] = v if k in shared else copy.deepcopy(v, memo)
        return new

    def __getstate__(self) -> dict:
        """Pickling (`torch.save`): refuse clearly where the static part of the module cannot be pickled."""
        import pickle

        try:
            pickle.dumps(self._static)
        except Exception as e:  # (pickle raises many types)
            raise JaxtorchError(
                f"cannot pickle this JaxModule: the static part of its {self._kind} module does not pickle ({e}). "
                "Save its parameters instead: torch.save(m.state_dict(), path), then build the module again and "
                "m.load_state_dict(torch.load(path))."
            ) from e
        state = dict(super().__getstate__())
        for k in _TREEDEFS:  # a treedef does not round-trip through pickle (Equinox's field sentinels): a tree does
            state[k] = _Skeleton(jax.tree_util.tree_unflatten(state[k], [0] * state[k].num_leaves))
        return state

    def __setstate__(self, state: dict) -> None:
        state = {k: jax.tree_util.tree_structure(v.tree) if isinstance(v, _Skeleton) else v for k, v in state.items()}
        super().__setstate__(state)

    def extra_repr(self) -> str:
        return f"{self._kind}: {type(self.to_jax_module()).__name__}"
