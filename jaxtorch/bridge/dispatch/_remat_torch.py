"""Remat (torch's activation checkpointing, `torch.utils.checkpoint`) on the jax device: torch's side.

Under a JAX trace (`jaxtorch.jit`, an `extract`ed function under `jax.jit`/`jax.grad`,
`make_train_step`) a checkpointed region on jax tensors becomes one `jax.checkpoint`
(`_remat_jax`): `checkpoint` below is where torch's function sends its calls. Elsewhere
torch's own checkpoint runs unchanged (both `use_reentrant=True` and `False`, and Hugging
Face's `activation_checkpointing_enable()`, which calls it). For calls whose tensor arguments
are on the jax device, two things are added where torch's entry points call the function
they checkpoint (`CheckpointFunction.apply`, `_checkpoint_without_reentrant_generator`):

- **random numbers**: with `preserve_rng_state=True` (torch's default) the recomputation
  draws the same keys as the forward did, from jaxtorch's generator or, under
  `jaxtorch.compile`/`jit`/`call_torch(rng=...)`, from the call's key (so dropout masks
  match and the gradients equal the unchecked run's);
- **barrier**: in a lazy program (and a traced one that `_remat_jax` hands back to torch: a
  region reading a non-leaf tensor from outside, `context_fn`, `debug`) the recomputation's
  tensor inputs pass through `jax.lax.optimization_barrier`, as `jax.checkpoint` does: XLA
  cannot merge the recomputed activations with the forward's (common-subexpression
  elimination would otherwise undo the checkpoint and keep every activation alive).

Example:
    ```python
    from torch.utils.checkpoint import checkpoint

    @jaxtorch.jit
    def step(model, opt, x):
        loss = checkpoint(model.block, x, use_reentrant=False).sum()
        loss.backward()           # the block is a jax.checkpoint inside the one program
        opt.step()
    ```
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from typing import Any

import jax
import torch
import torch.utils.checkpoint as _tc

from ..._compat import CHECKPOINT_GENERATORS, Tracer, dynamo_disable
from ..core import _lazy, _random, _tracing
from ..core._errors import TorchVersionError
from ..core._executor import executor
from ..tensor._tensor import JaxTensor
from . import _remat_jax
from ._custom_function import _traced_untracked

_OriginalFunction = _tc.CheckpointFunction

# torch's non-reentrant checkpoint hands the function it checkpoints to a generator, which calls it
# again to recompute; its name and signature changed between releases (newest first):
# - torch 2.14: `_checkpoint_without_reentrant_generator_impl(fn, args, kwargs, *, preserve_rng_state, ...)`
#   (`_checkpoint_without_reentrant_generator` is kept only as a shim that calls it);
# - torch 2.13: `_checkpoint_without_reentrant_generator(fn, preserve_rng_state, context_fn, ..., *args, **kwargs)`.
GENERATORS: tuple[str, ...] = CHECKPOINT_GENERATORS


# ---- random state: what the forward drew from, restored around each recomputation -------
def _rng_snapshot() -> tuple[str, Any]:
    """Where random ops draw from now: the innermost key scope's key, else the eager generator."""
    stack = getattr(_random._local, "stack", None)
    if stack and stack[-1][0] is not None:
        return ("scope", stack[-1][0])
    return ("global", _random.raw_state())


@contextlib.contextmanager
def _replaying(snapshot: tuple[str, Any]):
    """Draw the forward's random numbers again: from a new key scope holding the key the
    forward started from (torch may recompute on its autograd thread, outside the call's own
    scope), or from the eager generator reset to its state then and restored after."""
    kind, value = snapshot
    if kind == "scope":
        with _random.key_scope(value):
            yield
        return
    now = _random.raw_state()
    _random.set_raw_state(value)
    try:
        yield
    finally:
        _random.set_raw_state(now)


# ---- the barrier that keeps a recomputation apart from the forward (prevent CSE) ---------
def _barrier_data(values: list) -> list:
    return list(executor(*values).apply(("optimization_barrier", len(values)), _barrier_tuple, *values))


def _barrier_tuple(*values):
    return tuple(jax.lax.optimization_barrier(tuple(values)))


class _Barrier(torch.autograd.Function):
    """Identity on values and gradients; the data passes an `optimization_barrier`."""

    @staticmethod
    def forward(ctx, n_anchors, *tensors):
        if _tracing.pending():  # a backward under a trace, maybe on torch's autograd thread
            with _tracing.adopted():
                out = _barrier_data([t._raw() for t in tensors])
        else:
            out = _barrier_data([t._raw() for t in tensors])
        ctx.n_anchors = n_anchors
        return tuple(JaxTensor(o) for o in out[n_anchors:])

    @staticmethod
    def backward(ctx, *grads):
        return (None, *([None] * ctx.n_anchors), *grads)


def _needs_barrier(t: JaxTensor) -> bool:
    data = t._raw()
    return type(data) is _lazy.LazyArray or isinstance(data, Tracer)


def barrier(args: tuple, anchors: tuple = ()) -> tuple:
    """`args` with its traced or pending jax tensors passed (together, with `anchors`) through
    an `optimization_barrier`, differentiably; concrete tensors and other values unchanged.
    The anchors (gradients) only order the program: what comes out waits for them."""
    idx = [i for i, a in enumerate(args) if isinstance(a, JaxTensor) and _needs_barrier(a)]
    if not idx:
        return args
    extra = [a.detach() for a in anchors if isinstance(a, JaxTensor) and _needs_barrier(a)]
    outs = _Barrier.apply(len(extra), *extra, *(args[i] for i in idx))
    new = list(args)
    for i, o in zip(idx, outs):
        a = args[i]
        new[i] = o if a.requires_grad else o.detach()
    return tuple(new)


class _Recompute:
    """The checkpointed function as torch calls it: calls after the first `forwards` are
    recomputations, run with the forward's random state and behind a barrier."""

    def __init__(self, fn: Callable, preserve: bool, forwards: int):
        self.fn, self.forwards, self.calls = fn, forwards, 0
        self.anchors: tuple = ()  # gradients reaching the region's outputs: the recomputation waits for them
        self.rng = _rng_snapshot() if preserve else None

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls <= self.forwards:
            return self.fn(*args, **kwargs)
        args = barrier(args, self.anchors)
        self.anchors = ()
        if self.rng is None:
            return self.fn(*args, **kwargs)
        with _replaying(self.rng):
            return self.fn(*args, **kwargs)


def _on_jax(args, kwargs) -> bool:
    return any(isinstance(a, JaxTensor) for a in (*args, *kwargs.values()))


def _calls(fn: Callable, depth: int = 2) -> set[str]:
    """The global names `fn`'s code reads, and (to `depth`) those of the `torch.utils.checkpoint`
    functions among them: which of that module's functions `checkpoint` reaches."""
    code = getattr(fn, "__code__", None)
    names = set(code.co_names) if code is not None else set()
    if depth > 0:
        for name in tuple(names):
            inner = vars(_tc).get(name)
            if inspect.isfunction(inner) and name not in GENERATORS:
                names |= _calls(inner, depth - 1)
    return names


def _wrap_generator(name: str, original: Callable) -> Callable:
    """`original` (the generator `name` of `GENERATORS`), its recomputation wrapped for the jax device
    (torch calls the checkpointed function itself for the forward: every call of the wrapper recomputes)."""
    if name == "_checkpoint_without_reentrant_generator_impl":

        def generator_impl(fn, args, kwargs, *, preserve_rng_state=True, **config):
            _REACHED["generator"] += 1
            if _on_jax(args, kwargs):
                fn = _Recompute(fn, preserve_rng_state, forwards=0)
            return original(fn, args, kwargs, preserve_rng_state=preserve_rng_state, **config)

        return generator_impl

    def generator(fn, preserve_rng_state=True, context_fn=_tc.noop_context_fn, *rest, **kwargs):
        _REACHED["generator"] += 1
        if _on_jax(rest, kwargs):
            fn = _Recompute(fn, preserve_rng_state, forwards=0)
        return original(fn, preserve_rng_state, context_fn, *rest, **kwargs)

    return generator


# how often torch reached each wrapper (tests/test_compat.py checks that torch still calls them)
_REACHED: dict[str, int] = {"generator": 0, "reentrant": 0, "checkpoint": 0}
# the problem with this torch's non-reentrant checkpoint, if `install` found no generator it knows
_UNKNOWN: list[str] = []


class CheckpointFunction(_OriginalFunction):
    """torch's reentrant `CheckpointFunction`; on the jax device its recomputation is wrapped."""

    @classmethod
    def apply(cls, function, preserve_rng_state, *args):
        _REACHED["reentrant"] += 1
        if _on_jax(args, {}):
            function = _Recompute(function, preserve_rng_state, forwards=1)
        return super().apply(function, preserve_rng_state, *args)

    @staticmethod
    def backward(ctx, *grads):
        if isinstance(ctx.run_function, _Recompute):
            ctx.run_function.anchors = grads
        return _OriginalFunction.backward(ctx, *grads)


# ---- the entry point: a region under a JAX trace becomes a `jax.checkpoint` (`_remat_jax`) --
_torch_checkpoint: list[Callable] = []  # torch's checkpoint as its wrapper would call it (made on first use)


def _original(*args: Any, **kwargs: Any) -> Any:
    if not _torch_checkpoint:
        wrapped = _tc.checkpoint.__wrapped__  # type: ignore[attr-defined]  # (torch decorates it at runtime)
        _torch_checkpoint.append(dynamo_disable(wrapped, True, wrapping=False))
    return _torch_checkpoint[0](*args, **kwargs)


def checkpoint(
    function=None,
    *args,
    use_reentrant: bool | None = None,
    context_fn=_tc.noop_context_fn,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    respect_saved_tensors_hooks: bool | None = None,
    **kwargs,
):
    """`torch.utils.checkpoint.checkpoint`: under a JAX trace, on jax tensors, the region runs
    as `jax.checkpoint` (`_remat_jax`); otherwise (and with `context_fn`, `debug`,
    `respect_saved_tensors_hooks` or an unset `use_reentrant`, which torch warns about) torch's own
    checkpoint runs it. torch 2.14's curried form (`checkpoint(use_reentrant=False)(fn)`, no function)
    is torch's own, through the wrapped generator."""
    _REACHED["checkpoint"] += 1
    if respect_saved_tensors_hooks is not None:
        kwargs["respect_saved_tensors_hooks"] = respect_saved_tensors_hooks  # torch 2.14's; 2.13 refuses it
    if _UNKNOWN and use_reentrant is False and (function is None or _on_jax(args, kwargs)):
        raise TorchVersionError(_UNKNOWN[0])  # (a curried checkpoint may get jax tensors later)
    if function is None:
        return _original(
            use_reentrant=use_reentrant, context_fn=context_fn, determinism_check=determinism_check, debug=debug,
            early_stop=early_stop, **kwargs,
        )  # fmt: skip
    if (
        use_reentrant is not None
        and context_fn is _tc.noop_context_fn
        and not debug
        and respect_saved_tensors_hooks is None
    ):
        preserve = kwargs.pop("preserve_rng_state", True)
        if not (use_reentrant and kwargs) and _remat_jax.applies(args, kwargs):
            out = _remat_jax.remat(function, args, kwargs, reentrant=use_reentrant)
            if out is not _remat_jax.FALLBACK:
                return out
            if _traced_untracked((*args, *kwargs.values())):
                # JAX, not torch, differentiates (a JAX-first function): torch's checkpoint would run the
                # region outside torch's graph (its reentrant forward under no_grad); the region runs as
                # written, JAX differentiates it with torch's meaning (no rematerialization for it)
                return function(*args, **kwargs)
        kwargs["preserve_rng_state"] = preserve
    return _original(
        function, *args, use_reentrant=use_reentrant, context_fn=context_fn,
        determinism_check=determinism_check, debug=debug, early_stop=early_stop, **kwargs,
    )  # fmt: skip


def install() -> None:
    """Put the wrappers where `torch.utils.checkpoint.checkpoint` looks them up (idempotent).

    `checkpoint` itself is a wrapper (torch's dynamo-disabling decorator) that calls what its
    function's `__dynamo_disable` attribute holds: `checkpoint` above goes there, so every
    reference to torch's function (Hugging Face imports it by name) reaches it.
    """
    wrapped = getattr(_tc.checkpoint, "__wrapped__", None)
    called = _calls(wrapped) if wrapped is not None else set()
    name = next((n for n in GENERATORS if n in called), None)
    if name is None:
        _UNKNOWN[:] = [
            f"torch.utils.checkpoint(use_reentrant=False) on jax tensors: this torch's checkpoint calls none of "
            f"{', '.join(GENERATORS)}, where jaxtorch replays the forward's random numbers for the recomputation "
            "(without it, dropout inside the region would give wrong gradients). Use use_reentrant=True"
        ]
    elif not getattr(getattr(_tc, name), "_jaxtorch", False):
        generator = _wrap_generator(name, getattr(_tc, name))
        generator._jaxtorch = True  # type: ignore[attr-defined]
        setattr(_tc, name, generator)
    _tc.CheckpointFunction = CheckpointFunction  # type: ignore[misc]
    if wrapped is not None and "__dynamo_disable" in _tc.checkpoint.__code__.co_names:
        wrapped.__dynamo_disable = checkpoint
