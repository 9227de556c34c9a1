"""torch's derivative for a lowering, where JAX's own rule would differ: kinks, ties, boundaries.

`jax.grad` of a JAX-first function differentiates the lowerings with JAX's rules, and at the
points where an op is not smooth JAX's conventions are not torch's: `d relu/dx` at 0 is 0.5 in
JAX and 0 in torch, `d|x|/dx` at 0 is 1 in JAX and 0 in torch, a clamped log gives NaN where
torch's closed form gives a number. PyTorch defines the meaning, so a lowering whose JAX rule
differs somewhere declares torch's formula with one decorator line:

```python
@register(aten.relu.default)
@torch_derivative(lambda t, out, self: threshold_backward(t, out, 0))
def relu(self):
    return jnp.maximum(self, 0)
```

The lowering becomes a `jax.custom_jvp` whose tangent rule is the given formula (torch's
`derivatives.yaml` entry, usually its `*_backward` op applied to the tangent). A rule is LINEAR
in the tangent and built from transposable operations (`where`, a multiply by a factor of the
primals, a gather at the index torch picked), so reverse mode (`jax.grad`), forward mode
(`jax.jvp`, `jax.jacfwd`) and second order (`jax.hessian`) all follow it; the factor itself is
differentiated by JAX for the second order. Arguments are handled so that every lowering keeps
its signature:

- `wrt` names the arguments the rule gives the derivative for (default: the first). The rule is
  called as `rule(t, out, *args, **kwargs)`: `t` the tangent of the `wrt` argument (a tuple of
  them when `wrt` names several; `None` for one that is not a floating array), `out` the
  lowering's result, then the lowering's own arguments, bound by its signature.
- Every other floating array argument keeps JAX's derivative (the JVP of the lowering with
  respect to it, added to the rule's tangent).
- Integer and boolean arrays, Python numbers, dtypes and lists are not differentiated; a
  multi-output rule returns `None` for an output without a tangent (an index output gets a
  float0 tangent, a floating one zeros).

With no floating array among the `wrt` arguments (an integer `abs`) the lowering runs as it is.
The wrapper only adds a `custom_jvp` around the call, so it works under `jax.jit`, `jax.vmap`,
and in the eager and lazy executors alike.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Rule = Callable[..., Any]


def _is_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray)) and not isinstance(x, np.generic)


def _is_float(x) -> bool:
    return _is_array(x) and jnp.issubdtype(x.dtype, jnp.inexact)


def _zero_tangent(x):
    """The zero tangent of output `x`: float0 for integer and boolean outputs."""
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros_like(x)
    return np.zeros(np.shape(x), jax.dtypes.float0)


def _add(a, b):
    """Sum two output tangents leaf by leaf (`None` is zero; float0 leaves stay float0)."""
    if a is None:
        return b
    if b is None or getattr(b, "dtype", None) == jax.dtypes.float0:
        return a
    if getattr(a, "dtype", None) == jax.dtypes.float0:
        return b
    return a + b


def torch_derivative(rule: Rule, wrt: str | Sequence[str] | None = None) -> Callable[[Callable], Callable]:
    """Make `rule` the derivative of a lowering (torch's formula), in every JAX mode.

    **Arguments:**
    - `rule`: `rule(t, out, *args, **kwargs) -> out_tangent`, linear in `t` (see the module
      docstring); for a multi-output lowering a tuple with `None` where there is no tangent.
    - `wrt`: the parameter name(s) of the lowering that `rule` differentiates; default the first.

    **Returns:** a decorator; the decorated lowering has the same signature and values.

    **Example:** `@torch_derivative(lambda t, out, a: t * jnp.sign(a))` on `abs`.
    """

    def decorator(fn: Callable) -> Callable:
        sig = inspect.signature(fn)
        names = list(sig.parameters)
        ruled = (names[0],) if wrt is None else (wrt,) if isinstance(wrt, str) else tuple(wrt)
        single = wrt is None or isinstance(wrt, str)

        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            bound = sig.bind(*args, **kwargs)
            given = bound.arguments
            if not any(_is_float(given.get(n)) for n in ruled):
                return fn(*args, **kwargs)
            # every array argument is an explicit primal (no tracer is closed over)
            arrays = [n for n, v in given.items() if _is_array(v)]

            def call(values):
                b = sig.bind(*bound.args, **bound.kwargs)
                b.arguments.update(zip(arrays, values))
                return b

            @jax.custom_jvp
            def inner(*values):
                b = call(values)
                return fn(*b.args, **b.kwargs)

            @inner.defjvp
            def inner_jvp(primals, tangents):
                b = call(primals)
                out = fn(*b.args, **b.kwargs)
                t_of = dict(zip(arrays, tangents))
                ts = tuple(t_of.get(n) if _is_float(given.get(n)) else None for n in ruled)
                t_out = rule(ts[0] if single else ts, out, *b.args, **b.kwargs)
                rest = [i for i, n in enumerate(arrays) if n not in ruled and _is_float(primals[i])]
                if rest:  # JAX's own derivative for the floating arguments the rule leaves out

                    def of_rest(*ys):
                        vals = list(primals)
                        for i, y in zip(rest, ys):
                            vals[i] = y
                        r = call(vals)
                        return fn(*r.args, **r.kwargs)

                    _, t_rest = jax.jvp(of_rest, [primals[i] for i in rest], [tangents[i] for i in rest])
                    t_out = jax.tree_util.tree_map(_add, t_out, t_rest, is_leaf=lambda x: x is None)
                tree: Any  # (a PyTreeDef: jaxlib ships no stub for it, so mypy cannot see its methods)
                out_leaves, tree = jax.tree_util.tree_flatten(out)
                t_leaves = tree.flatten_up_to(type(out)(t_out)) if isinstance(out, (tuple, list)) else [t_out]
                t_leaves = [
                    _zero_tangent(o) if t is None or not jnp.issubdtype(o.dtype, jnp.inexact) else t.astype(o.dtype)
                    for o, t in zip(out_leaves, t_leaves)
                ]
                return out, jax.tree_util.tree_unflatten(tree, t_leaves)

            return inner(*(given[n] for n in arrays))

        wrapped.torch_derivative = rule  # type: ignore[attr-defined]
        return wrapped

    return decorator
