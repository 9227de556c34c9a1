"""`JaxModule`: an Equinox or Flax (nnx) module as a `torch.nn.Module`.

Its JAX parameters appear as torch `Parameter`s (on the `jax` device) that a torch
optimizer can train; `forward` runs the JAX module through `call_jax`, so gradients come
from `jax.vjp`.

Example:
    ```python
    head = jaxtorch.JaxModule(eqx.nn.Linear(16, 4, key=jax.random.key(0)))
    opt = torch.optim.Adam(head.parameters(), lr=1e-3)
    loss = head(features).square().mean(); loss.backward(); opt.step()
    ```
"""

from __future__ import annotations

import re
from typing import Any

import equinox as eqx
import jax
import torch

from ..tensor._autograd import call_jax
from ..tensor._tensor import JaxTensor


def _is_nnx(module) -> bool:
    try:
        from flax import nnx
    except ImportError:  # pragma: no cover
        return False
    return isinstance(module, nnx.Module)


def _name(path) -> str:
    name = "_".join(
        re.sub(r"\W+", "_", str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))).strip("_") for k in path
    )
    return name or "param"


class JaxModule(torch.nn.Module):
    """Wrap an `equinox.Module` or `flax.nnx.Module` so torch code can call and train it."""

    def __init__(self, module: Any):
        super().__init__()
        if _is_nnx(module):
            from flax import nnx

            graphdef, state = nnx.split(module)
            self._kind = "nnx"
            tree = state
            self._static = graphdef
        else:
            tree, static = eqx.partition(module, eqx.is_inexact_array)
            self._kind = "eqx"
            self._static = static
        leaves_with_path, self._treedef = jax.tree_util.tree_flatten_with_path(tree)
        self._names: list[str] = []
        for path, leaf in leaves_with_path:
            name = _name(path)
            while name in self._names:
                name += "_"
            self._names.append(name)
            self.register_parameter(name, torch.nn.Parameter(JaxTensor(leaf), requires_grad=True))

    def _rebuild(self, leaves):
        tree = jax.tree_util.tree_unflatten(self._treedef, leaves)
        if self._kind == "nnx":
            from flax import nnx

            return nnx.merge(self._static, tree)
        return eqx.combine(tree, self._static)

    def forward(self, *args, **kwargs):
        params = [getattr(self, n) for n in self._names]
        return call_jax(lambda leaves, *a, **k: self._rebuild(leaves)(*a, **k), params, *args, **kwargs)

    def to_jax_module(self) -> Any:
        """The wrapped JAX module with the current (possibly trained) parameter values."""
        return self._rebuild([getattr(self, n).elem for n in self._names])

    def extra_repr(self) -> str:
        return f"{self._kind}: {type(self.to_jax_module()).__name__}"
