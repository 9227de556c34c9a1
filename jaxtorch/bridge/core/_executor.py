"""The executor seam: how the dispatcher runs one op's JAX lowering, and the one place that
chooses eager or lazy execution.

The dispatcher (`jaxtorch.bridge.dispatch`) turns a torch op into a call of its lowering on
JAX values and hands that call to an *executor*, chosen per call by `executor()`:

- `jaxtorch.bridge.core._eager.EAGER` runs it now, through one cached `jax.jit` per op and
  argument signature (under a JAX trace the lowering is called directly, into the trace);
- `jaxtorch.bridge.core._lazy.LAZY` records it into the pending graph (lazy mode), run as
  one XLA program at `mark_step`.

Both implement `Executor` and receive the op as an `OpCall` record (`_signature`: the lowering
and its flags, looked up once per op, and the op's own caches, so the hot path hashes no
`OpOverload`); both key a call's arguments with `_signature.signature`. The bridge's own
computations on a tensor's values (a write's cast, a scatter through a view, a device move's
cast) go through the same executors (`apply`), so nothing outside this module asks whether
lazy mode is on.

Example:
    ```python
    op = OpCall(aten.add.Tensor, add_lowering, "aten::add.Tensor", random=False, data_dependent=False)
    out = executor().call(op, [x, y], {})                   # a jax.Array, or a pending LazyArray
    y = executor(a).apply(("astype", jd), lambda v: v.astype(jd), a)   # recorded when `a` is pending
    ```
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from ..._compat import trace_ctx
from ._checks import ON as _CHECKS
from ._eager import EAGER
from ._lazy import ACTIVE as _LAZY_ON
from ._lazy import LAZY, LazyArray
from ._signature import OpCall


class Executor(Protocol):
    """Runs (or records) JAX computations for the dispatcher; returns JAX values (arrays,
    tracers or pending `LazyArray`s) in the computation's output structure.

    `pending`: whether arguments may be pending values (`LazyArray`s): the dispatcher then
    unwraps tensors without executing what they hold.
    """

    pending: bool

    def call(self, op: OpCall, jargs: list, jkwargs: dict) -> Any:
        """`op.lowering(*jargs, **jkwargs)`: an op's lowering."""
        ...

    def run(self, runner: Callable[[Executor, Any, Any], Any], args: Any, kwargs: Any) -> Any:
        """`runner(self, args, kwargs)`: one op's runner (its unwrapping, calls and writes) with this executor."""
        ...

    def apply(self, key: Any, fn: Callable, *inputs: Any) -> Any:
        """`fn(*inputs)`, a computation of the bridge on JAX values; `key` (hashable) identifies `fn`."""
        ...

    def nullary(self, key: Any, fn: Callable[[], Any]) -> Any:
        """`fn()`, a value with no inputs (`torch.empty` on the device); `key` identifies `fn`."""
        ...


_trace_clean = trace_ctx.is_top_level  # (per thread: trace_ctx is thread-local)


def executor(*values: Any) -> Executor:
    """The executor of a call: lazy (`LAZY`) when one of `values` is pending, or when lazy mode is
    on, no JAX trace is active and checked mode is off (it runs ops eagerly); eager (`EAGER`,
    which under a trace calls lowerings directly into it) otherwise.

    **Arguments:** `values`: the JAX values the call reads, when the caller holds them
    (`apply`); none for an op `dispatch` runs (its tensors are unwrapped by the executor's rule).

    **Returns:** `EAGER` or `LAZY`.

    **Example:** `executor().call(op, [x, y], {})`; `executor(old, value).apply(key, fn, old, value)`.
    """
    for v in values:
        if type(v) is LazyArray:
            return LAZY
    return LAZY if _LAZY_ON[0] and _trace_clean() and not _CHECKS[0] else EAGER
