"""`JaxTensor`: a `torch.Tensor` whose data is a `jax.Array` (or a JAX tracer).

It is a wrapper subclass: torch sees its shape, dtype and the `jax` device, autograd
works on it, and every ATen op on it is routed by `__torch_dispatch__` to the interpreter,
which runs the op's JAX lowering.

Views follow torch semantics. A view (from `view`, `transpose`, `x[0]`, `detach`, ...)
keeps its root tensor and a JAX function from the root's array to its own; reading it
replays that function when the root has changed, and writing it (`y.add_(1)`,
`x[0, 0] = v`) scatters the new values back into the root, so every alias sees the write,
eagerly and under `jax.jit`.

Example:
    ```python
    t = JaxTensor(jnp.ones((2, 3)))
    t.jax()          # the jax.Array
    t.cpu()          # a plain CPU torch.Tensor
    ```
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from ..._compat import (
    DispatchKey,
    DispatchKeySet,
    ExcludeDispatchKeyGuard,
    TensorBase,
    Tracer,
    disabled_torch_function_impl,
    make_wrapper_subclass,
)
from ..core import _lazy
from ..core._autodiff import keep_tangent, stop_gradient
from ..core._dtypes import to_jax_dtype, to_torch_dtype
from ..core._executor import executor
from . import _serialization
from ._device import JAX_DEVICE, engine_entry

_Lazy = _lazy.LazyArray
_Tracer = Tracer
_grad_enabled = torch.is_grad_enabled


# Wrapper tensors own no memory; a large virtual storage size (never allocated) lets
# `rebind` change their shape in place with `as_strided_`.
_VIRTUAL_STORAGE = 1 << 40
_TORCH_DTYPE: dict = {}  # jax dtype -> the torch dtype of a bare array of it (int32 -> torch.int32)
_make_wrapper = make_wrapper_subclass


def _no_dispatch(func, args, kwargs):
    raise RuntimeError(f"jaxtorch: {func} on a JaxTensor before the dispatch layer was imported (import jaxtorch)")


_dispatch: Callable = _no_dispatch  # the interpreter's `dispatch(func, args, kwargs)`, see `install_dispatch`


def install_dispatch(fn: Callable) -> None:
    """Make `fn(func, args, kwargs)` run every ATen op on a `JaxTensor`.

    `jaxtorch/_install.py` installs the dispatch layer's interpreter (above this one) here,
    so this module never imports it; `JaxTensor.__torch_dispatch__` calls `fn` directly
    (through `_device.engine_entry` when torch's Python guard is used).

    **Example:**
        ```python
        install_dispatch(interpreter.dispatch)
        ```
    """
    global _dispatch
    _dispatch = engine_entry(fn, depth=1)  # (torch's Python guard: keeps an exception raised in backward)


class JaxTensor(torch.Tensor):
    """A torch tensor on the `jax` device holding a `jax.Array` or tracer.

    **Arguments:**
    Tensors are made by torch, not by this constructor: `t.to("jax")`, a factory with `device="jax"`, an op on
    `jax`-device tensors, `jaxtorch.torch_view(array)`. (`JaxTensor(elem, requires_grad=False, dtype=None)`
    wraps `elem`, a `jax.Array` or tracer, with `dtype` its torch dtype, inferred by default.)

    **Returns:** a `torch.Tensor` (its `device.type` is `"jax"`); `t.jax()` is its `jax.Array`, `t.cpu()` a CPU
    copy.

    **Example:**
        ```python
        t = torch.arange(4.0).to("jax")
        assert isinstance(t, jaxtorch.JaxTensor) and t.device.type == "jax"
        y = (t * 2).sum()                                    # a JAX op
        assert isinstance(t.jax(), jax.Array) and y.item() == 12.0
        ```
    """

    _jt_elem: Any
    # a new tensor is a root: these class-level defaults hold until a view or a write sets its own
    _jt_base: JaxTensor | None = None
    _jt_view_fn: Callable | None = None
    _jt_version: int = 0
    _jt_detached: bool = False  # a view torch's autograd does not see through (`.detach()`, `.data`, `no_grad`)
    # a view of an `expand`/`as_strided` view: its elements may share memory (stride 0); writes check
    # (`_writes.refuse_internal_overlap`), then set False when they do not
    _jt_overlap: bool = False

    @staticmethod
    def __new__(cls, elem, requires_grad: bool = False, dtype: torch.dtype | None = None):
        # `dtype`: the tensor's torch dtype when it is not the array's own (a `torch.int64`
        # tensor held as int32 without x64); by default, the array's own (int32 -> torch.int32)
        if dtype is None:
            dtype = _TORCH_DTYPE.get(elem.dtype)
            if dtype is None:  # not seen yet
                dtype = _TORCH_DTYPE[elem.dtype] = to_torch_dtype(elem.dtype)
        if requires_grad:
            r = make_wrapper_subclass(
                cls, elem.shape, dtype=dtype, device=JAX_DEVICE, requires_grad=True, storage_size=_VIRTUAL_STORAGE
            )
        else:  # (one keyword argument fewer to parse on the hot path)
            r = _make_wrapper(cls, elem.shape, dtype=dtype, device=JAX_DEVICE, storage_size=_VIRTUAL_STORAGE)
        r._jt_elem = elem
        if type(elem) is _Lazy:
            _lazy.track(r)
        return r

    # (no `__init__`: `object.__init__` ignores the arguments `__new__` took)

    __torch_function__ = disabled_torch_function_impl  # type: ignore[assignment]

    # (torch's stub declares `Tensor.__torch_dispatch__` a plain function; torch's own subclasses ignore it too)
    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:  # type: ignore[override]
        return _dispatch(func, args, kwargs or {})

    # `t.data = other` (used by `Module._apply` for `.half()`, `.to(dtype)`, ...) must move
    # the JAX data along with torch's metadata.
    @property
    def data(self) -> torch.Tensor:
        return TensorBase.data.__get__(self)  # type: ignore[attr-defined]  # (a descriptor; the stub says Tensor)

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        if write_checks:
            _check_write(self)
        TensorBase.data.__set__(self, value)  # type: ignore[attr-defined]  # (as above)
        if isinstance(value, JaxTensor):
            new, old = value._raw(), self._raw()
            if (
                (isinstance(new, _Tracer) or isinstance(old, _Tracer))
                and new.shape == old.shape
                and new.dtype == old.dtype
            ):
                new = keep_tangent(new, old)  # torch does not record `t.data = v`: `t` keeps its derivative
            self._jt_elem = new
            if type(self._jt_elem) is _Lazy:
                _lazy.track(self)
            self._jt_base = None
            self._jt_view_fn = None
            self._jt_version += 1

    def backward(self, gradient=None, retain_graph=None, create_graph=False, inputs=None):
        """`torch.Tensor.backward`, also under a JAX trace (backward ops join the trace)."""
        from ..core._tracing import backward_in_trace

        with backward_in_trace():
            return super().backward(gradient, retain_graph, create_graph, inputs)

    # ---- saving and storage queries (see `_serialization`) -------------------------
    def __reduce_ex__(self, protocol):
        return _serialization.reduce(self, protocol)

    def __deepcopy__(self, memo):
        return _serialization.deepcopy(self, memo)

    def untyped_storage(self) -> torch.UntypedStorage:
        """An identity for the array this tensor reads, shared by its aliases (not its bytes)."""
        return _serialization.storage_of(root(self))

    def data_ptr(self) -> int:
        return _serialization.data_ptr(self, root(self))

    def set_(  # type: ignore[override]  # (torch's stub omits the no-argument form, which torch accepts)
        self, source: Any = None, storage_offset: int = 0, size: Any = None, stride: Any = None
    ) -> torch.Tensor:
        """`torch.Tensor.set_`; a storage restored by `torch.load(..., map_location="jax")` becomes its data."""
        loaded = _serialization.pending_bytes(source)
        if loaded is None:
            if source is None:
                return super().set_()  # type: ignore[call-overload]  # (torch's stub omits the no-argument form)
            if size is None:
                return super().set_(source)
            return super().set_(source, storage_offset, size, stride)
        size = tuple(size) if size is not None else (loaded.nbytes() // self.element_size(),)
        stride = tuple(stride) if stride is not None else None
        if stride is None:
            stride, acc = [], 1
            for n in reversed(size):
                stride.insert(0, acc)
                acc *= max(n, 1)
        value = _serialization.loaded_array(loaded, self.dtype, storage_offset, size, stride)
        rebind(self, JaxTensor(value, dtype=self.dtype))
        return self

    # ---- data access -------------------------------------------------------------
    @property
    def elem(self):
        """The current `jax.Array` (or tracer) of this tensor, views replayed if stale.

        In lazy mode a pending value is executed first (see `jaxtorch.bridge.core._lazy`).
        """
        base = self._jt_base
        if base is None:
            e = self._jt_elem
        elif self._jt_version != base._jt_version:
            e = self._replay(base)
        else:
            e = self._jt_elem
        if type(e) is _Lazy:
            return self._executed(e, "reading the jax.Array of a tensor")
        return e

    def _raw(self):
        """Like `elem`, but a pending value stays a `LazyArray` (the interpreter's view)."""
        base = self._jt_base
        if base is None:
            return self._jt_elem
        if self._jt_version != base._jt_version:
            return self._replay(base)
        return self._jt_elem

    def _replay(self, base):
        view_fn = self._jt_view_fn
        assert view_fn is not None  # (set with `_jt_base`)
        e = self._jt_elem = view_fn(base._jt_elem)
        self._jt_version = base._jt_version
        if type(e) is _Lazy:
            _lazy.track(self)
        return e

    def _executed(self, e, reason: str):
        """The value of the pending `e` (this tensor's data), executing what it needs."""
        value = _lazy.force(e, reason)
        if self._jt_elem is e:
            self._jt_elem = value
        return value

    def _concrete(self, reason: str):
        e = self._raw()
        return self._executed(e, reason) if type(e) is _Lazy else e

    def jax(self) -> jax.Array:
        """The `jax.Array` behind this tensor (no copy)."""
        return self._concrete("Tensor.jax()")

    def apply_jax(self, fn: Callable, *args, **kwargs) -> JaxTensor:
        """A new tensor holding `fn(self.jax(), *args, **kwargs)` (this tensor's dtype when the
        result is stored as this tensor is: an int64 tensor held as int32 stays int64)."""
        return labelled(fn(self.elem, *args, **kwargs), self.dtype)

    def apply_jax_(self, fn: Callable, *args, **kwargs) -> JaxTensor:
        """Replace this tensor's data with `fn(self.jax(), *args, **kwargs)` (same shape); returns self."""
        write(self, fn(self.elem, *args, **kwargs))
        return self

    def numpy(self, *, force: bool = False) -> np.ndarray:
        """A NumPy copy of the data (blocks until it is computed)."""
        return np.asarray(_concrete(self._concrete("Tensor.numpy()"), "Tensor.numpy()"))

    def tolist(self):
        """Python numbers (nested lists), like `torch.Tensor.tolist`."""
        return self.cpu().tolist()

    def __format__(self, format_spec: str) -> str:
        """As `torch.Tensor.__format__`: a 0-d tensor formats its `.item()`, others as an object.

        Example: `f"{loss:.3f}"` -> `'0.693'`."""
        if self.dim() == 0:
            return self.item().__format__(format_spec)
        return object.__format__(self, format_spec)

    def __repr__(self, *, tensor_contents=None) -> str:  # type: ignore[override]
        elem = self._concrete("print/repr of a tensor")
        traced = isinstance(elem, Tracer)
        if self.grad_fn is not None:
            grad = f", grad_fn=<{type(self.grad_fn).__name__}>"
        else:
            grad = ", requires_grad=True" if self.requires_grad else ""
        if traced:
            body = f"<traced {elem.aval.str_short()}>"
        else:
            body = np.array2string(np.asarray(elem), separator=", ", prefix="tensor(", threshold=64)
        shape = f", shape={tuple(self.shape)}" if traced or elem.size > 64 else ""
        shard = ""
        sharding = None if traced else getattr(elem, "sharding", None)
        if sharding is not None and len(sharding.device_set) > 1:
            spec = getattr(sharding, "spec", None)
            mesh = getattr(sharding, "mesh", None)
            where = f" on mesh({', '.join(f'{k}={v}' for k, v in mesh.shape.items())})" if mesh is not None else ""
            shard = f", sharding={spec if spec is not None else sharding}{where}"
        return f"tensor({body}{shape}, device='{self.device}', dtype={self.dtype}{shard}{grad})"

    __str__ = __repr__

    def _repr_pretty_(self, p, cycle):  # IPython
        p.text(repr(self))


def _concrete(x, what: str):
    if isinstance(x, Tracer):
        from ..core._errors import DataDependentError

        raise DataDependentError(what)
    return x


# ---- the two directions of the bridge, for single values -----------------------------
def wrap(x) -> Any:
    """jax.Array -> JaxTensor; anything else unchanged."""
    if isinstance(x, (jax.Array, Tracer)):
        return JaxTensor(x)
    return x


def unwrap(x) -> Any:
    """JaxTensor -> its jax.Array; anything else unchanged."""
    if isinstance(x, JaxTensor):
        return x.elem
    return x


def labelled(elem, dtype: torch.dtype) -> JaxTensor:
    """`JaxTensor(elem)` with torch dtype `dtype` when `elem` is stored as `dtype` is (an int64
    tensor held as int32 without x64), else the array's own dtype.

    Example: `labelled(jnp.zeros(2, jnp.int32), torch.int64).dtype` is `torch.int64` without x64.
    """
    own = _TORCH_DTYPE.get(elem.dtype)
    if own is None:  # not seen yet (as in `JaxTensor.__new__`)
        own = _TORCH_DTYPE[elem.dtype] = to_torch_dtype(elem.dtype)
    if own is dtype:  # (the common case: the array's own dtype)
        return JaxTensor(elem, dtype=dtype)
    try:
        jd = to_jax_dtype(dtype)
    except TypeError:  # (Float64Error is one) no JAX storage for `dtype`: the array's own
        return JaxTensor(elem)
    return JaxTensor(elem, dtype=dtype) if elem.dtype == jd else JaxTensor(elem)


def make_view(base: JaxTensor, elem, view_fn: Callable | None) -> JaxTensor:
    """A tensor aliasing `base`: reading it replays `view_fn` on the root's data."""
    root = base._jt_base
    if root is None:
        root, fn = base, view_fn
    else:
        outer = base._jt_view_fn
        if view_fn is None:
            fn = outer
        elif outer is None:
            fn = view_fn
        else:
            fn = _Compose(view_fn, outer)
    t = labelled(elem, base.dtype)  # a view keeps its base's dtype unless it reinterprets the data
    t._jt_base = root
    t._jt_view_fn = fn if fn is not None else _identity
    t._jt_version = root._jt_version
    if base._jt_detached:
        t._jt_detached = True
    if base._jt_overlap:
        t._jt_overlap = True
    return t


class _StopGradient:
    """The view function of a detached alias under a JAX trace: the root's data, not differentiated."""

    __slots__ = ()
    key = ("detach",)

    def __call__(self, a):
        return stop_gradient(a)


_STOP_GRADIENT = _StopGradient()


def detach_result(t: JaxTensor) -> None:
    """Make the new result `t` of an op run outside torch's graph (`no_grad`, `.detach()`, `.data`)
    not differentiated by JAX: a root's data is stopped; a view becomes a detached view of its root
    (it replays `stop_gradient(root)`; writes through it keep the root's derivative, see `write`)."""
    base = t._jt_base
    if base is None:
        t._jt_elem = stop_gradient(t._jt_elem)
        return
    fn = t._jt_view_fn
    t._jt_view_fn = _STOP_GRADIENT if fn is _identity or fn is None else _Compose(_STOP_GRADIENT, fn)
    t._jt_elem = stop_gradient(t._jt_elem)
    t._jt_detached = True


def _identity(a):
    return a


# Checks run before a write lands in a tensor (`jaxtorch.compile` refuses, while it traces,
# writes to tensors that are not program state). Empty outside a trace: one list test.
# Installed only through `dispatch/_writes.checking`, which owns the write rules.
write_checks: list[Callable[[torch.Tensor], None]] = []


def _check_write(t: torch.Tensor) -> None:
    for check in write_checks:
        check(t)


class _Compose:
    """`f(g(a))`: a view of a view."""

    __slots__ = ("f", "g")

    def __init__(self, f: Callable, g: Callable):
        self.f, self.g = f, g

    def __call__(self, a):
        return self.f(self.g(a))

    @property
    def key(self):
        kf, kg = view_key(self.f), view_key(self.g)
        return None if kf is None or kg is None else ("compose", kf, kg)


def view_key(fn: Callable):
    """A hashable description of a view function (None: unknown), for lazy recording."""
    if fn is _identity:
        return ("identity",)
    return getattr(fn, "key", None)


def write(t: JaxTensor, value) -> None:
    """Replace the data of `t` with `value` (cast and broadcast to `t`), updating aliases.

    One path for every value: a cast, broadcast or scatter into the root runs now on
    arrays and tracers, and is recorded when the value or the root is pending (lazy mode:
    the executor `_executor.executor` picks for them).

    **Example:**
        ```python
        write(t, jnp.zeros(t.shape))      # t and every view of its root see zeros
        ```
    """
    if write_checks:
        _check_write(t)
    if type(value) is not _Lazy and not isinstance(value, jax.Array):
        value = jnp.asarray(value)
    if _TORCH_DTYPE.get(value.dtype) is not t.dtype or value.shape != t.shape:  # (else: nothing to fit)
        dtype, shape = to_jax_dtype(t.dtype), tuple(t.shape)
        if value.dtype != dtype or value.shape != shape:
            value = executor(value).apply(("write_cast", dtype, shape), lambda v: _fit(v, dtype, shape), value)
    root = t._jt_base
    if root is None:
        if _untracked(t, value, t._jt_elem):
            value = keep_tangent(value, t._jt_elem)  # a write torch does not record: `t` keeps its derivative
        t._jt_elem = value
        t._jt_version += 1
        if type(value) is _Lazy:
            _lazy.track(t)
        return
    if root.dtype != t.dtype:
        raise _reinterpreting_view(root, t)
    fn = t._jt_view_fn
    assert fn is not None  # (a view always has its function)
    old = root._jt_elem
    untracked = _untracked(t, value, old)
    if fn is _STOP_GRADIENT:
        fn = _identity
    if fn is _identity and value.shape == old.shape:
        new_root = value
    else:
        key = view_key(fn)
        if key is None:  # a view function with no structural key: scatter on executed values
            old, value = _lazy.force_tree([old, value], "write through a view (not recordable)")
            new_root = scatter_view(old, fn, value)
        else:
            new_root = executor(old, value).apply(
                ("scatter_view", key), lambda r, v: scatter_view(r, fn, v), old, value
            )
    if untracked:
        new_root = keep_tangent(new_root, old)  # a write torch does not record: the root keeps its derivative
    root._jt_elem = new_root
    root._jt_version += 1
    t._jt_elem = value
    t._jt_version = root._jt_version
    if type(new_root) is _Lazy:
        _lazy.track(root)
    if type(value) is _Lazy:
        _lazy.track(t)


def _untracked(t: JaxTensor, value, old) -> bool:
    """Whether writing `value` over `old` through `t` is a write torch's autograd does not record
    (grad mode off, or `t` a detached alias) under a JAX trace: the root then keeps its derivative."""
    return (t._jt_detached or not _grad_enabled()) and (isinstance(value, _Tracer) or isinstance(old, _Tracer))


def write_many(tensors, values) -> None:
    """`write(t, v)` for each pair (a foreach op's in-place results); the common case, a
    root tensor given a value of its own shape and dtype, skips `write`'s per-call work."""
    if write_checks:
        for t, v in zip(tensors, values):
            write(t, v)
        return
    jax_dtypes: dict = {}
    for t, v in zip(tensors, values):
        jd = jax_dtypes.get(t.dtype)
        if jd is None:
            jd = jax_dtypes[t.dtype] = to_jax_dtype(t.dtype)
        if t._jt_base is None and v.dtype == jd and v.shape == t._jt_elem.shape and not _untracked(t, v, t._jt_elem):
            t._jt_elem = v
            t._jt_version += 1
            if type(v) is _Lazy:
                _lazy.track(t)
        else:
            write(t, v)


def _reinterpreting_view(root: JaxTensor, t: JaxTensor) -> RuntimeError:
    return RuntimeError(
        f"jaxtorch: this view reinterprets {root.dtype} data as {t.dtype}, so it cannot be written "
        "through; write to a `.clone()` instead."
    )


def _fit(value, dtype, shape: tuple):
    if value.dtype != dtype:
        value = value.astype(dtype)
    if value.shape != shape:
        value = jnp.broadcast_to(value, shape)
    return value


def scatter_view(root, view_fn: Callable, value):
    """`root` with the elements that `view_fn` selects replaced by `value`.

    Every view op is an index map, so applying `view_fn` to an iota over the root's
    elements says which root element each view element is; under `jax.jit` that iota is a
    constant and the write is one scatter.
    """
    iota = jnp.arange(root.size, dtype=jnp.int32).reshape(root.shape)
    idx = view_fn(iota)
    if idx.dtype != jnp.int32 or idx.shape != value.shape:
        raise RuntimeError(
            "jaxtorch: this view cannot be written through (it changes dtype or is not an index map); "
            "write to a `.clone()` instead."
        )
    flat = root.reshape(-1).at[idx.reshape(-1)].set(value.reshape(-1).astype(root.dtype))
    return flat.reshape(root.shape)


_PYTHON_KEYS = DispatchKeySet(DispatchKey.Python) | DispatchKeySet(DispatchKey.PythonTLSSnapshot)


def rebind(t: JaxTensor, src: JaxTensor) -> None:
    """Give `t` the shape and data of `src` in place (`squeeze_`, `t_`, resizing an `out=`).

    torch's own metadata is updated with `as_strided_` below the Python dispatch key; if
    `src` is a view of another root, `t` becomes that view.
    """
    if write_checks:
        _check_write(t)
    shape = tuple(src.shape)
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    with ExcludeDispatchKeyGuard(_PYTHON_KEYS):
        torch.ops.aten.as_strided_.default(t, list(shape), list(reversed(strides)), 0)
    root = src._jt_base
    if root is None or root is t:
        t._jt_elem = src._raw()
        t._jt_base = None
        t._jt_view_fn = None
        t._jt_version += 1
    else:
        t._jt_base = root
        t._jt_view_fn = src._jt_view_fn
        t._jt_elem = src._raw()
        t._jt_version = root._jt_version
    if type(t._jt_elem) is _Lazy:
        _lazy.track(t)


def _settle(tensors: list, reason: str | None) -> None:
    """`_lazy.sync`'s tensor walk: execute, as one program, the pending data of the roots of
    the live tracked `tensors`, give each root its value, and let views replay from it."""
    roots = []
    for t in tensors:
        base = t._jt_base
        r = t if base is None else base
        if type(r._jt_elem) is _Lazy:
            roots.append(r)
    _lazy.materialize([r._jt_elem for r in roots], reason, donate=True)
    for r in roots:
        e = r._jt_elem
        if type(e) is _Lazy:
            r._jt_elem = e.value
    for t in tensors:
        if t._jt_base is not None and type(t._jt_elem) is _Lazy:
            t._jt_elem = None  # replayed from its (now executed) root on next use
            t._jt_version = -1


def install_settle() -> None:
    """Give the lazy executor (below) the walk over live tensors that `sync` needs (`_settle`;
    `jaxtorch._install` calls it, so the core never imports this layer).

    **Example:** `install_settle(); jaxtorch.sync()`.
    """
    _lazy.install_settle(_settle)


# ---- accessors: the only way other modules read or change a tensor's private fields ----------
def root(t: JaxTensor) -> JaxTensor:
    """The tensor whose array `t` reads: `t` itself, or the root of the view `t`."""
    base = t._jt_base
    return t if base is None else base


def root_data(t: JaxTensor) -> Any:
    """What the root of `t` holds now (a `jax.Array`, a tracer or a pending `LazyArray`), not replayed."""
    base = t._jt_base
    return (t if base is None else base)._jt_elem


def set_root_data(t: JaxTensor, value: Any) -> None:
    """Give the root of `t` the array `value` (same shape and dtype): no cast, no write checks;
    views of it replay on their next read. For state the bridge itself moves (binding a
    module's state into a program, resharding, gradient barriers)."""
    r = root(t)
    r._jt_elem = value
    r._jt_version += 1
    if type(value) is _Lazy:
        _lazy.track(r)


def set_same_data(t: JaxTensor, value: Any) -> None:
    """Give the root `t` an array holding the values it holds now (a traced identity, such as a
    gradient barrier): not a write, so nothing counts it as written and views taken before stay valid.

    Example: `set_same_data(t, gradient_barrier(root_data(t)))`.
    """
    t._jt_elem = value


def was_written(t: JaxTensor) -> bool:
    """Whether the root of `t` was written (or rebound) since it was made."""
    return root(t)._jt_version != 0


def own_root(p: JaxTensor, holders: int) -> None:
    """Make `p`, an identity view of a root nothing else holds, the root of its data.

    `holders` is how many references to the root the caller's frame sees besides `p`'s own
    (`sys.getrefcount` of the root as the caller counts it). Anything else holding the root
    keeps the view as it is.
    """
    base = p._jt_base
    if base is None or p._jt_view_fn is not _identity:
        return
    # references now: `p._jt_base`, `base`, getrefcount's argument, plus the caller's
    if (
        sys.getrefcount(base) == 3 + holders
        and base.dtype == p.dtype
        and tuple(base.shape) == tuple(p.shape)
        and isinstance(base._jt_elem, jax.Array)
    ):
        p._jt_elem, p._jt_base, p._jt_view_fn = base._jt_elem, None, None


def view_fn(t: JaxTensor) -> Callable | None:
    """The function computing `t`'s data from its root's (None when `t` is a root): what a
    compiled call replays to rebuild a view of an argument, or to return one.

    Example: `make_view(r, view_fn(t)(r.elem), view_fn(t))` is `t` again, on the root `r`.
    """
    return t._jt_view_fn if t._jt_base is not None else None
