"""Mixed precision: compute in a low-precision dtype while the master weights stay float32.

`MixedPrecision(compute_dtype=jnp.bfloat16)` casts floating-point parameters and inputs
to bfloat16 for the forward and backward passes; the cast's transpose hands float32
gradients back to the float32 master weights, and the loss is computed in float32.
Loss scaling is off by default (bfloat16 has float32's exponent range); a static
`loss_scale` multiplies the loss and divides the gradients (for float16).

Example:
    ```python
    init, step = make_train_step(model, loss_fn, optax.adam(1e-3), mixed_precision="bf16")
    ```
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from .._compat import Tracer


@dataclasses.dataclass(frozen=True)
class MixedPrecision:
    """A mixed-precision policy.

    **Arguments:**
    - `compute_dtype`: the dtype of the forward/backward computation.
    - `output_dtype`: what model outputs are cast to before `loss_fn` (float32).
    - `loss_scale`: a static loss scale, or None (off).

    **Returns:** the policy, for `make_train_step(..., mixed_precision=policy)` (`"bf16"` is `MixedPrecision()`);
    its `cast_to_compute` / `cast_to_output` cast a pytree's floating leaves.

    **Example:**
        ```python
        policy = jaxtorch.train.MixedPrecision(compute_dtype=jnp.bfloat16)
        assert policy.cast_to_compute({"w": jnp.ones(2)})["w"].dtype == jnp.bfloat16
        ```
    """

    compute_dtype: Any = jnp.bfloat16
    output_dtype: Any = jnp.float32
    loss_scale: float | None = None

    def cast_to_compute(self, tree: Any) -> Any:
        """Floating-point leaves of `tree` cast to `compute_dtype` (others unchanged)."""
        return _cast_floats(tree, self.compute_dtype)

    def cast_to_output(self, tree: Any) -> Any:
        """Floating-point leaves of `tree` cast to `output_dtype`."""
        return _cast_floats(tree, self.output_dtype)


_NAMED = {"bf16": jnp.bfloat16, "bfloat16": jnp.bfloat16, "fp16": jnp.float16, "float16": jnp.float16}


def resolve(policy: None | str | MixedPrecision) -> MixedPrecision | None:
    """`None`, a dtype name ("bf16", "fp16") or a `MixedPrecision` -> a policy or None."""
    if policy is None or isinstance(policy, MixedPrecision):
        return policy
    if isinstance(policy, str) and policy.lower() in _NAMED:
        return MixedPrecision(compute_dtype=_NAMED[policy.lower()])
    raise ValueError(f"mixed_precision: expected None, 'bf16', 'fp16' or a MixedPrecision, got {policy!r}")


def _cast_floats(tree: Any, dtype: Any) -> Any:
    def cast(x: Any) -> Any:
        if isinstance(x, (jax.Array, Tracer)) and jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype:
            return x.astype(dtype)
        return x

    return jax.tree_util.tree_map(cast, tree)


def cast_like(tree: Any, reference: Any) -> Any:
    """Each leaf of `tree` cast to the dtype of the matching leaf of `reference`."""
    return jax.tree_util.tree_map(lambda x, r: x.astype(r.dtype) if x.dtype != r.dtype else x, tree, reference)


__all__ = ["MixedPrecision", "cast_like", "resolve"]
