"""Checked mode: torch's value errors (out-of-range indices, integer division by zero) on JAX.

An XLA gather cannot raise, so by default an out-of-range read gives the fill value (NaN for floats,
the rule in docs/api/errors.md) and an out-of-range write is dropped, where CPU torch raises
`IndexError`. `jaxtorch.checks()` (or `JAXTORCH_CHECKS=1` in the environment, read at import) turns on
checks that raise torch's error instead:

- concretely (op by op, values known): a plain Python check, raised at the op;
- traced inside `jaxtorch.jit`/`compile` or an eager op's cached jit: `checkify.check`, the
  program is wrapped in `checkify.checkify` and the error rethrown as torch's type after it runs;
- traced elsewhere (a `jax.jit` of your own around `extract`'s `fn` or `call_torch`): a
  `jax.debug.callback` that raises at run time (JAX reports it as its runtime error carrying
  torch's message; wrap with `checkify.checkify` yourself for a typed error).

The lowerings call one helper, `check(ok, values, error, message)`, which is a no-op when checks
are off: no cost, no change in the programs. Lazy mode runs ops eagerly while checks are on, so
the error comes from the line that caused it.

Example:
    ```python
    with jaxtorch.checks():
        torch.arange(3, device="jax")[torch.tensor([5], device="jax")]
    # IndexError: index 5 is out of bounds for dimension 0 with size 3
    ```
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from ..._compat import Tracer

ON: list[bool] = [os.environ.get("JAXTORCH_CHECKS", "0") not in ("", "0")]  # (read on the hot path)
_FUNCTIONALIZED = [0]  # programs being traced under `checkify` (process-wide: torch runs a
# backward on its own autograd thread, inside the same trace)
_TYPES: dict[str, type[Exception]] = {"IndexError": IndexError, "RuntimeError": RuntimeError}
_SEP = "|"  # between the error type's name and the message inside a checkify message


def enabled() -> bool:
    """Whether checked mode is on (`jaxtorch.checks()` or `JAXTORCH_CHECKS=1`)."""
    return ON[0]


class checks:
    """Checked mode: out-of-range indices and integer division by zero raise torch's errors.

    Indexing (`a[idx]`, `index_select`, `take`, `index_put`, `index_add`/`copy`/`fill`),
    `gather`/`scatter`, `F.embedding`, the targets of `cross_entropy`/`nll_loss`, `F.one_hot`,
    and integer `//`, `%`, `div(rounding_mode=...)`, `fmod` raise the `IndexError` or
    `RuntimeError` CPU torch raises, eagerly, lazily (ops run eagerly while checks are on) and
    under `jaxtorch.jit`/`compile` (through `jax.experimental.checkify`). Off by default: the
    checks cost a reduction per checked op and, under jit, a little bookkeeping (see
    `benchmarks/checks.py`). `JAXTORCH_CHECKS=1` turns them on at import; `checks(False)`
    turns them off inside. Not thread-local: it switches the process.

    **Arguments:**
    - `on`: True (default) turns the checks on inside the block, False off.

    **Returns:** a context manager (`checks(...)` also works as a decorator, as a `ContextDecorator`).

    **Example:**
        ```python
        weight = torch.ones(4, 2, device="jax")
        try:
            with jaxtorch.checks():
                torch.nn.functional.embedding(torch.tensor([10], device="jax"), weight)
        except IndexError as err:
            print(err)   # index out of range in self, as CPU torch says
        ```
    """

    def __init__(self, on: bool = True):
        self.on = on
        self._saved: list[bool] = []

    def __enter__(self) -> checks:
        self._saved.append(ON[0])
        ON[0] = self.on
        return self

    def __exit__(self, *exc) -> None:
        ON[0] = self._saved.pop()


# ---- the one check the lowerings call ------------------------------------------------------------
def check(ok: Any, values: Any, error: type[Exception], message: str) -> None:
    """Raise `error(message)` where `ok` (a bool array, or a Python bool) is False somewhere.

    `message` may name `{value}`: the first failing element of `values` (same shape as `ok`).
    A no-op when checks are off. Concrete values: raised now; traced: see the module doc.

    **Example:**
        ```python
        check((idx >= -n) & (idx < n), idx, IndexError, "index {value} is out of bounds for dimension 0 with size 3")
        ```
    """
    if not ON[0]:
        return
    if isinstance(ok, bool):
        if not ok:
            raise _torch_error(error, message.format(value=values))
        return
    if not isinstance(ok, Tracer) and not isinstance(values, Tracer):
        ok_np = np.asarray(ok)
        if not ok_np.all():
            vals = np.broadcast_to(np.asarray(values), ok_np.shape)
            raise _torch_error(error, message.format(value=_py(vals[~ok_np].flat[0])))
        return
    ok = jnp.asarray(ok)
    values = jnp.broadcast_to(jnp.asarray(values), ok.shape).reshape(-1)
    first = values[jnp.argmin(ok.reshape(-1))] if ok.size else jnp.zeros((), values.dtype)
    if _FUNCTIONALIZED[0]:
        checkify.check(jnp.all(ok), f"{error.__name__}{_SEP}{message}", value=first)
    else:
        jax.debug.callback(_raise_if, jnp.all(ok), first, error=error, message=message)


def _torch_error(error: type[Exception], message: str) -> Exception:
    """`error(message)`, marked as torch's own (dispatch then looks no further for one)."""
    e = error(message)
    e._jaxtorch_torch_error = True  # type: ignore[attr-defined]
    return e


def _py(v: Any) -> Any:
    return v.item() if hasattr(v, "item") else v


def _raise_if(ok, value, *, error: type[Exception], message: str) -> None:
    if not bool(ok):
        raise error(message.format(value=_py(np.asarray(value))))


def check_index(index: Any, size: int, error: type[Exception], message: str, negative: bool = True) -> None:
    """`check` that every element of `index` is in `[-size, size)` (`negative`) or `[0, size)`.

    **Example:**
        ```python
        check_index(idx, a.shape[0], IndexError, "index {value} is out of bounds for dimension 0 with size 3")
        ```
    """
    if not ON[0]:
        return
    low = -size if negative else 0
    if isinstance(index, (int, np.integer)):
        check(bool(low <= index < size), index, error, message)
        return
    check((index >= low) & (index < size), index, error, message)


def check_nonzero_divisor(b: Any, *, integer: bool) -> None:
    """Integer division by zero raises `RuntimeError: ZeroDivisionError`, as torch does."""
    if ON[0] and integer:
        check(b != 0, b, RuntimeError, "ZeroDivisionError")


# ---- checked programs ----------------------------------------------------------------------------
def functionalized(fn: Callable) -> Callable:
    """`fn` with `check` emitting `checkify.check`s while it is traced (for `checkify.checkify`)."""

    def traced(*args, **kwargs):
        _FUNCTIONALIZED[0] += 1
        try:
            return fn(*args, **kwargs)
        finally:
            _FUNCTIONALIZED[0] -= 1

    return traced


def rethrow(err: checkify.Error) -> None:
    """Raise a failed check of `err` (concrete) as the torch error it names."""
    text = err.get()
    if text is None:
        return
    first = text.splitlines()[0].replace(" (`check` failed)", "")
    name, sep, message = first.partition(_SEP)
    if not sep or name not in _TYPES:
        err.throw()
    raise _torch_error(_TYPES[name], message)


def jit(fn: Callable, **jit_kwargs) -> Callable:
    """`jax.jit(fn)`, checked when checks are on at this call: then the program runs under
    `checkify.checkify` and a failed check raises torch's error after it. Callers key their
    program caches with `enabled()` (a program built with checks on differs).

    **Example:**
        ```python
        prog = jit(traced)          # jax.jit(traced) when checks are off
        out = prog(state, args)     # raises IndexError/RuntimeError on a failed check
        ```
    """
    if not ON[0]:
        return jax.jit(fn, **jit_kwargs)
    checked = jax.jit(checkify.checkify(functionalized(fn), errors=checkify.user_checks), **jit_kwargs)

    def run(*args, **kwargs):
        err, out = checked(*args, **kwargs)
        rethrow(err)
        return out

    run.lower = checked.lower  # type: ignore[attr-defined]
    return run


# ---- torch's own shape errors ------------------------------------------------------------------
_CPU_LIMIT = 1 << 24  # elements: larger inputs are not mirrored on the CPU (meta's message is kept)


def meta_error(func: Any, args: Any, kwargs: dict, error: BaseException) -> BaseException | None:
    """The error CPU torch raises for `func(*args, **kwargs)` when a lowering failed with
    `error`; None when torch's checks pass (the failure is jaxtorch's own: keep `error`).

    Torch's shape checks run first on meta tensors (no data); when they fail, the op runs again
    on the CPU on zero-strided zeros of the same shapes (no memory) for CPU torch's exact
    message, which can differ from the meta kernel's (real zeros for in-place ops, inputs up to
    `_CPU_LIMIT` elements). Called only after a failure: nothing on
    the normal path. JAX's errors about tracers (`jax.errors.JAXTypeError`) and torch errors
    already raised are kept as they are.

    **Example:**
        ```python
        meta_error(aten.mm.default, (a, b), {}, e)
        # RuntimeError: mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)
        ```
    """
    if isinstance(error, jax.errors.JAXTypeError) or getattr(error, "_jaxtorch_torch_error", False):
        return None
    found = _raised(func, args, kwargs, _meta_like)
    if found is None:
        return None
    if _numel(args, kwargs) <= _CPU_LIMIT:  # (in-place ops write: real zeros then)
        found = _raised(func, args, kwargs, _cpu_zeros if func._schema.is_mutable else _cpu_like) or found
    found._jaxtorch_torch_error = True  # type: ignore[attr-defined]
    return found


def _meta_like(x: Any) -> Any:
    import torch

    if isinstance(x, torch.Tensor) and x.device.type != "meta":
        return torch.empty_strided(tuple(x.shape), x.stride(), dtype=x.dtype, device="meta")
    return x


def _cpu_like(x: Any) -> Any:
    import torch

    if isinstance(x, torch.Tensor):
        return torch.zeros((), dtype=x.dtype, device="cpu").expand(tuple(x.shape))
    return x


def _cpu_zeros(x: Any) -> Any:
    import torch

    if isinstance(x, torch.Tensor):
        return torch.zeros(tuple(x.shape), dtype=x.dtype, device="cpu")
    return x


def _numel(args: Any, kwargs: dict) -> int:
    import torch

    from ..._compat import torch_pytree

    return sum(x.numel() for x in torch_pytree.tree_leaves((tuple(args), dict(kwargs))) if isinstance(x, torch.Tensor))


def _raised(func: Any, args: Any, kwargs: dict, like: Callable) -> BaseException | None:
    """The torch error `func` raises on `like`-mirrored arguments (a shape error), or None."""
    from ..._compat import torch_pytree

    try:
        margs, mkwargs = torch_pytree.tree_map(like, (tuple(args), dict(kwargs)))
    except Exception:  # (an argument that cannot be mirrored: keep jaxtorch's error)
        return None
    if str(mkwargs.get("device", "")).split(":")[0] == "jax":  # a factory: mirrored off the jax device
        mkwargs["device"] = "meta" if like is _meta_like else "cpu"  # (else it would run jaxtorch's again)
    try:
        func(*margs, **mkwargs)
    except NotImplementedError:  # no kernel
        return None
    except (RuntimeError, IndexError, ValueError, TypeError) as e:
        text = str(e)
        if "meta" in text.lower() or "data-dependent" in text or "memory location" in text:
            return None  # about the mirrored tensors, not the shapes
        return e
    except Exception:
        return None
    return None
