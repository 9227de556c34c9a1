"""The table of ATen-to-JAX lowerings.

A lowering is a plain function of JAX values with the signature of the ATen op it
lowers: tensors arrive as `jax.Array` (or tracers), `torch.dtype` arguments arrive as
NumPy dtypes, everything else (ints, floats, lists, `torch.device`, `torch.memory_format`)
arrives unchanged. It returns a `jax.Array`, or a tuple/list of them for multi-output ops.

Example:
    ```python
    from jaxtorch.bridge.core._registry import register
    aten = torch.ops.aten

    @register(aten.hypot)              # every overload of aten::hypot
    def hypot(a, b):
        return jnp.hypot(a, b)
    ```

In-place (`add_`) and `out=` (`add.out`) overloads need no lowering of their own: the
interpreter runs the functional overload and writes the result back (see
`jaxtorch.bridge.dispatch._routing`). Keys may be an `OpOverload` (`aten.add.Tensor`), an
`OpOverloadPacket` (`aten.add`, all overloads) or a custom op (`torch.ops.mylib.bar`).

This module is the ground floor: it imports nothing from jaxtorch, and it lives in the bridge's
core so that no `bridge/` module imports `jaxtorch.ops`. The layers above that cache what they
derived from the table (routes, runners, compiled programs) `subscribe` to it (connected by
`jaxtorch/_install.py`); `register`, `unregister` and `register_op` all `notify` them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeAlias

import torch

from ..._compat import VERSIONED_OPS as VERSIONED_OPS
from ..._compat import AutoDispatchBelowAutograd, OpOverload, OpOverloadPacket, versioned_op

OpKey: TypeAlias = OpOverload | OpOverloadPacket
Lowering = Callable[..., Any]

_LOWERINGS: dict[Any, Lowering] = {}
# Ops whose lowering must run eagerly on concrete values (their output shape depends on data).
DATA_DEPENDENT: set[Any] = set()
# Ops whose lowering draws random numbers (they receive a `key=` argument).
RANDOM: set[Any] = set()
# Ops whose integer metadata tensors torch keeps on the CPU (a PackedSequence's `lengths`,
# `batch_sizes`): the interpreter accepts plain CPU tensors there in the PyTorch-first mode too.
HOST_INPUTS: set[Any] = set()
_CACHE: dict[Any, Lowering | None] = {}
_LISTENERS: list[Callable[[], None]] = []


def subscribe(listener: Callable[[], None]) -> Callable[[], None]:
    """Call `listener()` after every change to the table (`register`, `unregister`, `notify`).

    Layers above the registry forget what they cached from it this way (the routing table,
    the interpreter's runners, the eager and lazy executors' compiled programs).

    **Arguments:**
    - `listener`: a function of no arguments; subscribing it twice has no further effect.

    **Returns:** `listener`, so `subscribe` also works as a decorator.

    **Example:** `registry.subscribe(_ROUTES.clear)`.
    """
    if listener not in _LISTENERS:
        _LISTENERS.append(listener)
    return listener


def unsubscribe(listener: Callable[[], None]) -> None:
    """Stop calling `listener` (no effect if it was not subscribed)."""
    if listener in _LISTENERS:
        _LISTENERS.remove(listener)


def notify() -> None:
    """Forget cached lookups and tell every subscriber that the table changed.

    `register` and `unregister` call it; call it yourself after changing what routing reads
    outside the registry (an entry of `torch._decomp.decomposition_table`).

    **Example:** `decomposition_table[op] = my_decomp; registry.notify()`.
    """
    _CACHE.clear()
    for listener in tuple(_LISTENERS):
        listener()


def register(
    *ops: OpKey, data_dependent: bool = False, random: bool = False, host_inputs: bool = False
) -> Callable[[Lowering], Lowering]:
    """Register `fn` as the JAX lowering of each op in `ops`.

    **Arguments:**
    - `ops`: ATen overloads or packets, e.g. `aten.add.Tensor` or `aten.add`.
    - `data_dependent`: the output shape depends on input values (e.g. `nonzero`); under
      `jax.jit` the interpreter raises a clear error instead of calling the lowering.
    - `random`: the lowering takes a keyword argument `key` (a JAX PRNG key) supplied by
      the interpreter.
    - `host_inputs`: torch requires some tensor arguments on the CPU (`lengths` of
      `pack_padded_sequence`); they are accepted next to `jax` tensors and arrive as NumPy
      arrays (concrete under tracing).

    **Returns:** a decorator that records the function and returns it unchanged.
    """

    def decorator(fn: Lowering) -> Lowering:
        for op in ops:
            _LOWERINGS[op] = fn
            if data_dependent:
                DATA_DEPENDENT.add(op)
            if random:
                RANDOM.add(op)
            if host_inputs:
                HOST_INPUTS.add(op)
        notify()
        return fn

    return decorator


def lookup(op: OpOverload) -> Lowering | None:
    """The lowering for `op`: an exact overload entry first, then its packet's entry."""
    try:
        return _CACHE[op]
    except KeyError:
        pass
    fn = _LOWERINGS.get(op)
    if fn is None:
        packet = getattr(op, "overloadpacket", None)
        fn = _LOWERINGS.get(packet)
    _CACHE[op] = fn
    return fn


def is_flagged(op: OpOverload, table: set) -> bool:
    """Whether `op` (or its packet) was registered with the flag whose set is `table`."""
    return op in table or getattr(op, "overloadpacket", None) in table


def registered_ops() -> list[Any]:
    """All keys with a lowering (overloads and packets)."""
    return list(_LOWERINGS)


def unregister(op: OpKey) -> None:
    """Remove the lowering registered under `op` (used by tests and overrides)."""
    _LOWERINGS.pop(op, None)
    DATA_DEPENDENT.discard(op)
    RANDOM.discard(op)
    HOST_INPUTS.discard(op)
    notify()


def register_op(op: OpKey, jax_impl: Lowering, *, data_dependent: bool = False, random: bool = False) -> Lowering:
    """Register (or override) the JAX lowering of a torch op, e.g. a `torch.library` custom op.

    `jax_impl` takes and returns JAX arrays, with the op's signature. It may be a
    `jax.custom_vjp` function: `jax.grad` then uses its rule. Ops already dispatched use it
    from their next call, eagerly and in lazy mode (as after `register`: see `notify`).

    **Arguments:**
    - `op`: the op: an `OpOverload` (`torch.ops.mylib.bar.default`) or an `OpOverloadPacket` (every overload).
    - `jax_impl`: its JAX function (arrays in, arrays out, the op's signature).
    - `data_dependent`: the output's shape depends on values (then refused under tracing).
    - `random`: the op draws random numbers (it gets a key).

    **Returns:** `jax_impl`, so `register_op` also works as a decorator's body.

    **Example:**
        ```python
        @torch.library.custom_op("docs::twice_sin", mutates_args=())
        def twice_sin(x: torch.Tensor) -> torch.Tensor:
            return torch.sin(x) * 2

        jaxtorch.register_op(torch.ops.docs.twice_sin.default, lambda x: jnp.sin(x) * 2)
        y = torch.ops.docs.twice_sin(torch.ones(3, device="jax"))   # runs the JAX function
        ```
    """
    return register(op, data_dependent=data_dependent, random=random)(jax_impl)


# ---- ops that exist only in some torch releases -----------------------------------------------
# The table, `VERSIONED_OPS` (`name.overload` -> the torch releases it was checked in), lives in
# `jaxtorch._compat`. A lowering of such an op names it through `versioned(...)`, which yields only what
# the installed torch has, so `import jaxtorch` works on every supported release (torch 2.14 removed
# `aten::cholesky` and `aten::qr`).
def versioned(*names: str) -> tuple[OpOverload, ...]:
    """The ATen overloads among `names` that the installed torch has (each must be in `VERSIONED_OPS`).

    **Arguments:**
    - `names`: `"name.overload"` strings listed in `VERSIONED_OPS` (`"cholesky.default"`).

    **Returns:** a tuple of `OpOverload`s, without those the installed torch lacks.

    **Example:** `@register(*versioned("cholesky.default"))` registers nothing on torch 2.14.
    """
    return tuple(op for op in map(versioned_op, names) if op is not None)


# ---- the `jax` device's ATen kernels the lowerings need (registered with torch by `install_kernels`) --
# (name.overload, kernel, dispatch key), in the order recorded
_KERNELS: list[tuple[str, Callable[..., Any], str]] = []
_kernel_lib: list[torch.library.Library] = []  # the library holding them, once installed


def kernel(name: str, fn: Callable[..., Any], key: str) -> None:
    """Record `fn` as the kernel of the ATen op `name` at the dispatch key `key` (`"PrivateUse1"`,
    `"AutogradPrivateUse1"`); `install_kernels` registers it with torch (at once if it already ran).

    **Arguments:**
    - `name`: the op's `"name.overload"` without the `aten::` prefix (`"native_batch_norm"`).
    - `fn`: the kernel, with the op's signature.
    - `key`: the dispatch key it serves.

    **Returns:** None.

    **Example:** `kernel("native_batch_norm", _batch_norm_autograd, "AutogradPrivateUse1")`.
    """
    _KERNELS.append((name, fn, key))
    if _kernel_lib:
        _kernel_lib[0].impl(name, fn, key)


def install_kernels() -> None:
    """Register every recorded kernel (`kernel`, `keep_whole`) with torch, in one `aten` library
    (idempotent; `jaxtorch._install` calls it once the lowerings are imported).

    **Example:** `install_kernels()`; then `torch.narrow` on a jax tensor reaches its lowering whole.
    """
    if _kernel_lib:
        return
    lib = torch.library.Library("aten", "IMPL")
    _kernel_lib.append(lib)
    for name, fn, key in _KERNELS:
        lib.impl(name, fn, key)


def _any_requires_grad(args) -> bool:
    """Whether a tensor among `args`, or inside a list of them (`Tensor[]`), requires grad."""
    for a in args:
        if isinstance(a, torch.Tensor):
            if a.requires_grad:
                return True
        elif isinstance(a, (list, tuple)) and _any_requires_grad(a):
            return True
    return False


def keep_whole(op: OpOverload, recorded: Callable | None = None) -> None:
    """Let a CompositeImplicitAutograd `op` reach jaxtorch undecomposed on the `jax` device.

    A `PrivateUse1` kernel stops the dispatcher from decomposing the op, so `__torch_dispatch__`
    sees it whole and its lowering runs. When torch autograd has to record it (an input on the
    `jax` device requires grad), the `AutogradPrivateUse1` kernel runs `recorded` instead
    (default: torch's own decomposition), which autograd differentiates.

    The two kernels are recorded here and registered with torch by `install_kernels`.

    Example: `keep_whole(torch.ops.aten.rms_norm.default)`.
    """
    name = op.name().split("::")[1]  # includes the overload unless it is "default"
    recorded = op.decompose if recorded is None else recorded

    def backend(*args, **kwargs):  # never runs: a JaxTensor's Python key takes the call first
        raise RuntimeError(f"jaxtorch: {op} reached the jax backend kernel without a JaxTensor")

    def autograd(*args, **kwargs):
        if torch.is_grad_enabled() and _any_requires_grad(list(args) + list(kwargs.values())):
            return recorded(*args, **kwargs)
        with AutoDispatchBelowAutograd():
            return op(*args, **kwargs)

    kernel(name, backend, "PrivateUse1")
    kernel(name, autograd, "AutogradPrivateUse1")


# ---- one torch autograd node for a whole op (the runner is installed from the tensor layer) -----
_VJP_NODE: list[Callable[..., Any]] = []


def install_vjp_node(run: Callable[..., Any]) -> None:
    """Install `run(fn, *args, **kwargs)`, which runs the JAX function `fn` on torch tensors as
    one torch autograd node whose backward is `jax.vjp` of `fn` (`vjp_node` calls it).

    `jaxtorch._install` installs the tensor layer's `call_jax` (`bridge/tensor/_autograd.py`), so
    lowerings can name that node here without importing upward.
    """
    _VJP_NODE[:] = [run]


def vjp_node(fn: Lowering, *args, **kwargs) -> Any:
    """Run the JAX function `fn` (a lowering) on torch tensors as one torch autograd node.

    For `keep_whole`'s `recorded`: what torch autograd records for a whole op, so its backward
    is `jax.vjp` of the same lowering instead of torch's decomposition.

    **Example:** `keep_whole(aten.gru_cell.default, lambda *a, **k: vjp_node(gru_cell, *a, **k))`.
    """
    if not _VJP_NODE:
        raise RuntimeError("jaxtorch: no autograd node runner installed (import jaxtorch first)")
    return _VJP_NODE[0](fn, *args, **kwargs)
