"""`jaxtorch.export`: a torch module as a `jax.export.Exported` (StableHLO inside).

The result serializes to bytes, reloads with `jax.export.deserialize` and runs with JAX
alone: no torch, no jaxtorch. Parameters are either embedded as constants or passed
in as the first argument; the batch dimension can be symbolic.

Example:
    ```python
    exp = jaxtorch.export(model, x, batch_dim=True)
    blob = exp.serialize()
    # elsewhere, with JAX only:
    y = jax.export.deserialize(blob).call(x_array)
    ```
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import torch

from ..tensor._convert import to_jax
from ._jax_first import extract


def _spec(x: Any, batch: Any) -> Any:
    shape = tuple(x.shape)
    if batch is not None and len(shape) > 0:
        shape = (batch,) + shape[1:]
    return jax.ShapeDtypeStruct(shape, x.dtype)


def _per_example(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` applied to each example (as a batch of one) under `jax.vmap`.

    torch code needs concrete sizes, so a symbolic batch size cannot reach it; vmapping over
    the batch keeps every size torch sees concrete, and the exported program still takes
    any batch size. Requires examples to be independent (true of an eval-mode forward).
    """

    def batched(params: Any, *xs: Any) -> Any:
        def one(*x1: Any) -> Any:
            out = fn(params, *[a[None] for a in x1])
            return jax.tree_util.tree_map(lambda o: o[0], out)

        return jax.vmap(one)(*xs)

    return batched


def export(
    model: torch.nn.Module,
    *example_args: Any,
    embed_params: bool = True,
    batch_dim: bool = False,
    platforms: tuple[str, ...] | None = None,
) -> jax.export.Exported:
    """Export `model`'s forward as a `jax.export.Exported`.

    **Arguments:**
    - `model`: the torch module (its current train/eval mode is used).
    - `example_args`: example inputs (torch tensors or JAX arrays) giving shapes and dtypes.
    - `embed_params`: embed parameters as constants (call with inputs only), or take the
      params dict as the first argument (`exp.call(params, *inputs)`).
    - `batch_dim`: make dimension 0 of every input a symbolic size `b` (the forward is
      vmapped over examples, so they must be independent: use `model.eval()`). This is the
      way to a symbolic batch: `jax.export` of `extract`'s function (or `call_torch`) with a
      `jax.export.symbolic_shape` input raises `JaxtorchError`, since torch code reads sizes
      as Python ints.
    - `platforms`: lowering platforms (default: the current backend), e.g. `("cpu", "cuda")`.

    **Returns:** a `jax.export.Exported`; `.serialize()` gives bytes.

    **Example:**
        ```python
        exp = jaxtorch.export(torch.nn.Linear(3, 2), torch.ones(1, 3))
        y = exp.call(jnp.ones((1, 3)))    # the embedded weights
        blob = exp.serialize()            # bytes; jax.export.deserialize(blob) in any JAX process
        ```
    """
    params, forward = extract(model)
    fn: Callable[..., Any] = _per_example(forward) if batch_dim else forward
    arrays = [to_jax(a) for a in example_args]
    batch = jax.export.symbolic_shape("b")[0] if batch_dim else None
    specs = [_spec(a, batch) for a in arrays]
    kwargs: dict[str, Any] = {} if platforms is None else {"platforms": platforms}
    if embed_params:
        return jax.export.export(jax.jit(lambda *xs: fn(params, *xs)), **kwargs)(*specs)
    pspecs = jax.tree_util.tree_map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params)
    return jax.export.export(jax.jit(fn), **kwargs)(pspecs, *specs)
