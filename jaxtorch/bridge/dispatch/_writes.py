"""The one rule for writes inside JAX-first functions, checked in one place.

Inside `call_torch`, `extract`'s function and `TorchModule` (the jax-by-default
environment, also `jaxtorch.compile`'s trace), torch code runs as a pure JAX function: it
may compute anything, but it never changes torch state. Two kinds of tensor are torch
state there, and a write to either raises `StateWriteError` naming the tensor and the way
out, before the op runs (eagerly and under `jax.jit` alike, so nothing is ever written
once at trace time and then silently skipped):

1. **plain torch tensors** (CPU tensors a function closes over, a module's plain tensor
   attribute such as `self.count`, a module's own parameters and buffers in `call_torch`):
   `refuse_torch_state_writes`, called by `JaxDispatchMode` for every op, reads which
   arguments the op writes from the route table (`_routing.route(op).mutated`), so every
   in-place op is covered without a list: scalar and tensor overloads (`add_(1)`,
   `+=`), fills (`fill_`, `zero_`, setitem), random fills (`normal_`, `uniform_`),
   foreach ops (`_foreach_add_`), `out=` variants, metadata writes (`squeeze_`,
   `resize_`);
2. **the module's tensors bound read-only for one call** (`read_only`, entered by
   `state._binding.bound(..., mutable=False)`: `extract(model)`'s function without
   `mutable=True`, `TorchModule`): a write (BatchNorm's running statistics in train mode)
   would be dropped after the call, so it raises; `extract(model, mutable=True)` returns
   the new values instead.

Outside the jax-by-default environment (`enable_globally`, `x.to("jax")`) nothing here runs:
CPU writes are ordinary torch.

3. **writes inside a traced region**: `jaxtorch.compile`'s trace, a checkpointed region
   (`_remat`) and a control-flow body (`_control_flow`) install their checks with `checking`
   (the one owner of `_tensor.write_checks`) and ask `made_in` whether a tensor's data is the
   trace's own.

Example:
    ```python
    count = torch.zeros(())
    jaxtorch.call_torch(lambda x: (count.add_(1), x)[1], jnp.ones(3))   # StateWriteError: `count` ...
    ```
"""

from __future__ import annotations

import contextlib
import sys
import threading
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import numpy as np
import torch

from ..._compat import Tracer
from ..core._errors import JaxtorchError, StateWriteError
from ..tensor import _tensor
from ..tensor._tensor import JaxTensor, root
from ._routing import route

_local = threading.local()
_guard = threading.Lock()
_active = [0]  # threads inside a `read_only` scope (the check is installed while > 0)


# ---- 1. plain torch tensors -------------------------------------------------------------------
def _storage_key(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):  # no storage (sparse, nested, ...)
        return None


def _fresh() -> set[int]:
    f = getattr(_local, "fresh", None)
    if f is None:
        f = _local.fresh = set()
    return f


def note_fresh(func, args, out: Any) -> Any:
    """Remember the plain tensors the op `func` made inside the jax-by-default environment
    (scratch memory: a CPU tensor made with `device="cpu"`, `x.cpu()`, the temporaries of
    torch's composite kernels): writing them is not writing torch state. Views and other
    results sharing an argument's memory are not new. Returns `out`.

    **Example:** `note_fresh(aten.empty.memory_format, ([3],), t)` lets a later `t.fill_(0)` run.
    """
    if type(out) is JaxTensor or out is None:
        return out
    new = [t for t in (out if isinstance(out, (list, tuple)) else (out,)) if _is_plain(t)]
    if not new or any(r.alias_info is not None for r in func._schema.returns):
        return out
    inputs = {_storage_key(a) for a in _flat(args) if _is_plain(a)}
    for t in new:
        key = _storage_key(t)
        if key is not None and key not in inputs:
            _fresh().add(key)
    return out


def _is_plain(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and not isinstance(t, JaxTensor)


def _flat(args) -> Iterator[Any]:
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a


def forget_fresh() -> None:
    """Forget the scratch tensors (when this thread leaves the jax-by-default environment)."""
    _local.fresh = None


def is_torch_state(t: Any) -> bool:
    """A plain torch tensor with data (not a `JaxTensor`, not on the meta device) that was not
    made inside the environment (`note_fresh`)."""
    if not isinstance(t, torch.Tensor) or isinstance(t, JaxTensor) or t.device.type == "meta":
        return False
    fresh = getattr(_local, "fresh", None)
    return not fresh or _storage_key(t) not in fresh


def refuse_torch_state_writes(func, args, kwargs) -> None:
    """Raise `StateWriteError` if the op `func` would write a plain torch tensor.

    Called by `JaxDispatchMode` for every op inside the jax-by-default environment.

    **Example:** `refuse_torch_state_writes(aten.add_.Tensor, (cpu_t, 1), {})` raises.
    """
    mutated = _MUTATED.get(func)
    if mutated is None:
        mutated = _MUTATED[func] = route(func).mutated
    if not mutated:  # (most ops: one dict lookup)
        return
    for i, name, kw_only in mutated:
        t = kwargs.get(name) if (kw_only or i >= len(args)) else args[i]
        if type(t) is JaxTensor:  # (the common write: a jax tensor, never torch state)
            continue
        for u in t if isinstance(t, (list, tuple)) else (t,):
            if is_torch_state(u):
                refuse_torch_state_write(func, u)


_MUTATED: dict = {}  # op -> the arguments it writes (`route(op).mutated`: a schema fact, never stale)


def refuse_torch_state_write(func, t: torch.Tensor) -> None:
    """Raise for a write of `func` to the plain tensor `t` (inside `jaxtorch.compile`'s trace,
    its own check names the tensor the way compile users need)."""
    if _tensor.write_checks:
        _tensor._check_write(t)
    raise StateWriteError.torch_state_write(func, describe(t))


# Frames of jaxtorch's and torch's machinery: the user's frame is searched for a name.
_SKIP = ("/jaxtorch/bridge/", "/torch/", "/jax/", "/contextlib.py")


def _same_memory(a: torch.Tensor, b: Any) -> bool:
    if not isinstance(b, torch.Tensor) or isinstance(b, JaxTensor) or b.device != a.device:
        return False
    return b is a or b.untyped_storage()._cdata == a.untyped_storage()._cdata


def _attribute_name(module: torch.nn.Module, t: torch.Tensor) -> str | None:
    """`sub.attr` for the tensor attribute (buffer, parameter or plain) of `module` holding `t`'s memory."""
    for prefix, m in module.named_modules():
        for slots in (m._buffers, m._parameters, m.__dict__):
            for k, v in slots.items():
                if _same_memory(t, v):
                    return f"{prefix}.{k}" if prefix else k
    return None


def describe(t: torch.Tensor) -> str:
    """`t` as the user knows it: a module attribute (`Counter.count`) or a variable name found
    in the calling frames (a closure), with its shape and dtype.

    **Example:** `describe(self.count)` is "`Counter.count` (a CPU tensor of shape () and dtype torch.float32)".
    """
    what = f"a {t.device.type.upper()} tensor of shape {tuple(t.shape)} and dtype {t.dtype}"
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        if not any(s in frame.f_code.co_filename for s in _SKIP):
            local = frame.f_locals
            owner = local.get("self")
            if isinstance(owner, torch.nn.Module):
                name = _attribute_name(owner, t)
                if name is not None:
                    return f"`{type(owner).__name__}.{name}` ({what})"
            for k, v in local.items():
                if _same_memory(t, v):
                    return f"`{k}` ({what}, in `{frame.f_code.co_name}`)"
        frame = frame.f_back
    return what


# ---- internally overlapping destinations ---------------------------------------------------------
_OVERLAP_MESSAGE = (
    "unsupported operation: more than one element of the written-to tensor refers to a single memory "
    "location. Please clone() the tensor before performing the operation."
)


REFUSED, PARTIAL, WHOLE = "refused", "partial", "whole"  # how a write treats a destination whose elements alias


def refuse_internal_overlap(t: JaxTensor, policy: str = REFUSED) -> None:
    """Refuse a write into `t` (a view whose chain holds an `expand` or `as_strided`, `t._jt_overlap`)
    where several of its elements are one root element, unless the write is one jaxtorch computes as
    torch's memory does. `policy` says what the op does with such a destination:

    - `REFUSED` (pointwise in-place and `out=` ops, `copy_`, scatters): torch refuses a dimension of
      size > 1 whose elements are one root element (stride 0: `x.expand(3, 4)`) with its RuntimeError;
    - `WHOLE` (`fill_`, `zero_`): every element gets one value, so every alias agrees: allowed;
    - `PARTIAL` (`index_put_`, `masked_fill_`, `tril_`, `out=` of other ops): torch writes element by
      element into the shared memory (a row written through one alias shows in all), which a view
      that is a function of its root cannot reproduce: refused with a JaxtorchError naming clone().

    Any other aliasing (an `as_strided` with overlapping non-zero strides, which torch computes in
    memory order) is refused the same way for every policy but `WHOLE`. Decided on an iota of the
    root's elements (computed now, also under a JAX trace); a view whose function cannot run on it is
    not refused. Otherwise marks `t` checked.

    **Example:** `refuse_internal_overlap(x.expand(3, 4))` raises; `x.expand(1, 4)` passes.
    """
    base, fn = t._jt_base, t._jt_view_fn
    if base is None or fn is None or policy == WHOLE:
        if policy != WHOLE:
            t._jt_overlap = False
        return
    shape = tuple(base.shape)
    try:
        with jax.ensure_compile_time_eval():
            idx = np.asarray(fn(jax.numpy.arange(base.numel(), dtype=np.int32).reshape(shape)))
    except Exception:  # (a view of traced arguments: not decided, not refused)
        return
    if policy == REFUSED:
        for d, n in enumerate(idx.shape):
            if n > 1 and idx.size and (np.take(idx, [0], d) == np.take(idx, [1], d)).all():
                raise RuntimeError(_OVERLAP_MESSAGE)
    if np.unique(idx).size < idx.size:
        raise JaxtorchError(
            f"jaxtorch cannot write into this tensor of shape {tuple(t.shape)}: several of its elements are one "
            "element of its base (an expand or as_strided view), and torch's result depends on the order its "
            "kernel writes that shared memory, which a jax view (a function of its base) does not reproduce. "
            "clone() the view before writing, or write into the base tensor."
        )
    t._jt_overlap = False


# ---- 2. module tensors bound read-only ----------------------------------------------------------
def _read_only() -> dict[int, tuple[JaxTensor, str, str]]:
    d = getattr(_local, "read_only", None)
    if d is None:
        d = _local.read_only = {}
    return d


def _refuse_read_only_write(t: torch.Tensor) -> None:
    if not isinstance(t, JaxTensor):
        return
    entry = _read_only().get(id(root(t)))
    if entry is not None:
        _, owner, name = entry
        raise StateWriteError.read_only_write(owner, name, tuple(root(t).shape), root(t).dtype)


@contextlib.contextmanager
def read_only(tensors: Mapping[str, torch.Tensor], owner: str) -> Iterator[None]:
    """Inside, a write to any of `tensors` (or a view of one) raises `StateWriteError`
    naming it (`owner.name`) and saying to use `extract(model, mutable=True)`.

    Entered by `state._binding.bound(module, values, mutable=False)`, this thread only.

    **Example:**
        ```python
        with read_only({"bn.running_mean": JaxTensor(m)}, "Net"):
            bn(x)     # train mode: StateWriteError: `Net.bn.running_mean` ...
        ```
    """
    marks = _read_only()
    added = []
    for name, t in tensors.items():
        if isinstance(t, JaxTensor):
            r = root(t)
            if id(r) not in marks:
                marks[id(r)] = (r, owner, name)  # (holds `r`: its id stays unique while marked)
                added.append(id(r))
    with _guard:
        _active[0] += 1
        if _active[0] == 1:
            _install(_refuse_read_only_write)
    try:
        yield
    finally:
        with _guard:
            _active[0] -= 1
            if _active[0] == 0:
                _uninstall(_refuse_read_only_write)
        for k in added:
            del marks[k]


# ---- 3. writes inside a traced region -----------------------------------------------------------
# `jaxtorch.compile`'s trace refuses writes to tensors that are not program state; a checkpointed
# region (`_remat`) records the tensors from outside it that it writes; a control-flow body
# (`_control_flow`) refuses them. Each installs its check with `checking`, and each asks `made_in`
# whether a tensor's data belongs to the trace: the one rule of what a traced region made.
WriteCheck = Callable[[torch.Tensor], None]


def _install(check: WriteCheck) -> None:
    _tensor.write_checks.append(check)


def _uninstall(check: WriteCheck) -> None:
    _tensor.write_checks.remove(check)


@contextlib.contextmanager
def checking(check: WriteCheck) -> Iterator[None]:
    """Run `check(t)` before every write to a tensor `t` (an in-place op, `t.data = v`, a
    metadata write) while the block runs, in every thread: `check` raises to refuse the write
    or records it. The one way a write check is installed (`read_only` too).

    **Arguments:** `check`: a function of the tensor about to be written.

    **Returns:** a context manager.

    **Example:**
        ```python
        with checking(lambda t: print("write to", tuple(t.shape))):
            x.add_(1)
        ```
    """
    _install(check)
    try:
        yield
    finally:
        _uninstall(check)


def check_writes(args: Any, kwargs: Any, mutated: Any) -> None:
    """Run the installed checks on the tensors an op writes (`mutated`: its route's
    `(index, name, keyword-only)` of each written argument), plain torch tensors included.

    **Example:** `check_writes((cpu_t, 1), {}, route(aten.add_.Tensor).mutated)`.
    """
    for i, name, kw_only in mutated:
        t = kwargs.get(name) if (kw_only or i >= len(args)) else args[i]
        if isinstance(t, torch.Tensor):
            _tensor._check_write(t)


def made_in(data: Any, trace: Any = None) -> bool:
    """Whether `data` (a root's array) is a value of the JAX trace `trace`: made inside the traced
    region, or given to it as an input. With `trace=None`, a value of any trace (a tensor holding
    a concrete array was made outside every trace).

    **Example:** `made_in(root_data(t), trace_ctx.trace)`.
    """
    if not isinstance(data, Tracer):
        return False
    return trace is None or getattr(data, "_trace", None) is trace
