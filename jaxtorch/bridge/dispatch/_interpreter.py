"""The interpreter: runs torch ops on `JaxTensor`s as JAX ops.

Data flows one way: torch value -> `jax_view` -> JAX lowering -> `torch_view` -> torch
value. `dispatch` is the single entry point, called by `JaxTensor.__torch_dispatch__`
and by `JaxDispatchMode` (`JaxTensor` calls it through `_tensor.install_dispatch`). For each
`OpOverload` it builds, once, a small runner that knows how the op treats its arguments
(functional, view, in-place, `out=`), and caches it; each call passes the runner the
executor chosen for that call (`core._executor`: `LAZY` in lazy mode outside a JAX trace,
else `EAGER`), which runs or records the lowering. Which runner is decided by the op's route
(`_routing.route`, the table `jaxtorch.coverage` reads too):

1. a registered lowering (`jaxtorch.bridge.core._registry`) runs on the unwrapped arguments;
2. in-place (`add_`) and `out=` overloads run the functional overload and write back;
3. otherwise PyTorch's own decomposition (`torch._decomp`) runs, on `JaxTensor`s;
4. otherwise `UnsupportedOpError` names the op and how to register a lowering.

The modes: `JaxDispatchMode` (below autograd) catches ops with no tensor arguments
(factories such as `torch.zeros(3)` inside `call_torch`) and `torch.tensor` literals;
`JaxFunctionMode` (above autograd) sees whole torch functions and gives each a JAX
named scope while tracing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from ..._compat import (
    OpOverload,
    OpOverloadPacket,
    TensorBase,
    TorchDispatchMode,
    Tracer,
    foreach_add,
    foreach_add_,
    foreach_mul,
    foreach_sub,
    foreach_sub_,
    has_kernel_for_dispatch_key,
    trace_ctx,
)
from ..core import _lazy as lazy
from ..core import _registry as registry
from ..core import _tracing as tracing
from ..core._checks import meta_error
from ..core._dtypes import scalar_jax_dtype, to_jax_dtype, to_torch_dtype
from ..core._eager import EAGER
from ..core._errors import DataDependentError, DeviceMismatchError, MetaTensorError, UnsupportedOpError
from ..core._executor import Executor, executor
from ..core._signature import OpCall, signature
from ..tensor import _tensor
from ..tensor._convert import array_to_torch, cast_on_host, tensor_to_jax
from ..tensor._device import engine_entry, is_jax_device, jax_device_of
from ..tensor._tensor import (
    JaxTensor,
    detach_result,
    labelled,
    make_view,
    rebind,
    root,
    root_data,
    set_root_data,
    write,
    write_many,
)
from . import _foreach as foreach
from . import _meta_likes as meta_likes
from . import _result_dtype
from . import _writes as writes
from ._routing import Kind, Route, is_factory_sibling, route
from ._routing import clear as route_clear
from ._routing import functional_sibling as _functional_sibling
from ._routing import mutated_args as _mutated_args

aten = torch.ops.aten
_Tracer = Tracer
_ArrayImpl = type(jax.numpy.zeros(()))
_Lazy = lazy.LazyArray
_local = threading.local()


# ---- thread-local state set by call_torch / enable_globally ------------------------------
def jax_by_default() -> bool:
    """Whether factories with no device, and CPU tensors, become JAX values (inside call_torch)."""
    return getattr(_local, "jax_default", 0) > 0


class jax_default_scope:
    """Inside it, this thread's factories default to the jax device and CPU tensors are moved."""

    def __enter__(self):
        _local.jax_default = getattr(_local, "jax_default", 0) + 1

    def __exit__(self, *exc):
        _local.jax_default -= 1
        if not _local.jax_default:
            writes.forget_fresh()


# ---- argument conversion (the only place torch values become JAX values in dispatch) -----
_PLAIN = frozenset({int, float, bool, type(None), str})


def _to_jax_arg(x, func, raw: bool = False):
    t = type(x)
    if t in _PLAIN:
        return x
    if t is list or t is tuple:
        for y in x:  # a list of Python scalars (a size, dims) is passed as it is
            if type(y) not in _PLAIN:
                break
        else:
            return x
        out = []
        for y in x:
            ty = type(y)
            if ty is JaxTensor:
                out.append(y._raw() if raw else y.elem)
            elif ty in _PLAIN:
                out.append(y)
            elif func in _CPU_INDICES and isinstance(y, torch.Tensor) and y.device.type == "cpu":
                out.append(_host_array(y, func))  # `x[cpu_index]`: moved, as torch moves CPU indices to CUDA
            else:
                out.append(_to_jax_arg(y, func, raw))
        return t(out)
    if isinstance(x, JaxTensor):
        return x._raw() if raw else x.elem
    if isinstance(x, torch.Tensor):
        if x.device.type == "cpu" and registry.is_flagged(func, registry.HOST_INPUTS):
            return x.numpy()  # metadata torch keeps on the host (lengths): concrete, also under tracing
        if x.dim() == 0 or jax_by_default() or x.device.type == "meta":
            return _host_array(x, func)
        raise DeviceMismatchError(func, x.device)
    if isinstance(x, (list, tuple)):
        return type(x)(_to_jax_arg(y, func, raw) for y in x) if type(x) in (list, tuple) else x
    if isinstance(x, torch.dtype):
        return to_jax_dtype(x)
    return x


def _host_array(x: torch.Tensor, func) -> Any:
    """A plain torch tensor's values as a JAX array for the op `func`; a tensor on the meta
    device has none: `MetaTensorError` names `func` and the ways to give it values.

    **Example:** `_host_array(torch.ones(2), aten.add.Tensor)` is `Array([1., 1.])`."""
    if x.device.type == "meta":
        raise MetaTensorError(func, tuple(x.shape), x.dtype)
    return tensor_to_jax(x)


# ops whose index list (`Tensor?[] indices`) may hold CPU tensors for a tensor on another device, as in
# torch (`cuda_x[cpu_index]`, `cuda_x[cpu_index] = 0`; `nn.init.sparse_` does this on any device)
_CPU_INDICES = frozenset(
    {
        aten.index.Tensor,
        aten.index_put.default,
        aten.index_put_.default,
        aten._index_put_impl_.default,
        aten._unsafe_index.Tensor,
        aten._unsafe_index_put.default,
    }
)


def _unwrap_args(args, kwargs, func, pending: bool):
    """The JAX values of an op's arguments: tensors' arrays (`pending`: as they are, a lazy
    executor's pending values included; else executed), the rest via `_to_jax_arg`."""
    jargs = []
    for a in args:  # (a loop, not a comprehension: no function object per call)
        if type(a) is JaxTensor:
            jargs.append(a._raw() if pending else a.elem)
        else:
            jargs.append(_to_jax_arg(a, func, pending))
    if not kwargs:
        return jargs, {}
    if func in _SCALAR_FACTORIES and kwargs.get("dtype") in _WIDE and _scalar_or_empty(args[0] if args else ()):
        kwargs = {**kwargs, "dtype": scalar_jax_dtype(kwargs["dtype"])}  # see dtypes
    return jargs, {k: _to_jax_arg(v, func, pending) for k, v in kwargs.items()}


_WIDE = (torch.float64, torch.complex128)
_X64_DEPENDENT = frozenset({np.dtype("int32"), np.dtype("uint32")})  # torch dtype depends on x64


def _scalar_or_empty(size) -> bool:
    """A 0-dim scalar or a zero-element placeholder: torch's internals make these in float64
    (`matrix_rank`'s tolerances, `batch_norm`'s unused statistics); they carry no float64 data."""
    size = tuple(size) if isinstance(size, (list, tuple)) else (size,)
    return not size or 0 in size


_SCALAR_FACTORIES = frozenset(
    {aten.zeros.default, aten.ones.default, aten.full.default, aten.empty.memory_format, aten.scalar_tensor.default}
)


def _wrap_out(out, func=None, args=(), kwargs=None):
    """The op's JAX result as torch values; int32/uint32 arrays (x64 off) get torch's result
    dtype for `func(*args, **kwargs)` (int32 or int64, see `_result_dtype`)."""
    if func is not None and type(out) is not tuple and type(out) is not list:  # one array (the common case)
        if _is_array(out) and out.dtype in _AMBIGUOUS and _result_dtype.ambiguous(out.dtype):
            return JaxTensor(out, dtype=_result_dtype.label_one(func, args, kwargs or {}, out))
    elif func is not None and _has_ambiguous(out):
        arrays: list = []
        _arrays_of(out, arrays)
        labels = iter(_result_dtype.label(func, args, kwargs or {}, arrays))
        return _wrap_labelled(out, labels)
    if type(out) is _ArrayImpl or type(out) is _Lazy or isinstance(out, (jax.Array, _Tracer)):
        return JaxTensor(out)
    if isinstance(out, (list, tuple)):
        return type(out)(_wrap_out(o) for o in out)
    return out


def _is_array(x) -> bool:
    return type(x) is _ArrayImpl or type(x) is _Lazy or isinstance(x, (jax.Array, _Tracer))


def _has_ambiguous(out) -> bool:
    if _is_array(out):
        return out.dtype in _AMBIGUOUS and _result_dtype.ambiguous(out.dtype)
    if isinstance(out, (list, tuple)):
        return any(_has_ambiguous(o) for o in out)
    return False


def _arrays_of(out, acc: list) -> None:
    if _is_array(out):
        acc.append(out)
    elif isinstance(out, (list, tuple)):
        for o in out:
            _arrays_of(o, acc)


def _wrap_labelled(out, labels):
    if _is_array(out):
        dtype = next(labels)
        return JaxTensor(out) if dtype is None else JaxTensor(out, dtype=dtype)
    if isinstance(out, (list, tuple)):
        return type(out)(_wrap_labelled(o, labels) for o in out)
    return out


_AMBIGUOUS = _result_dtype.AMBIGUOUS


# ---- runners --------------------------------------------------------------------------------
# A runner is `run(ex, args, kwargs)`: built once per op (see `_build_runner`), called with
# the executor `dispatch` chose for this call (`core._executor.Executor`: EAGER or LAZY).
def _op_call(func, lowering, floats: bool | None = None) -> OpCall:
    """The executors' record of `func`'s lowering, its registry flags looked up once."""
    return OpCall(
        func,
        lowering,
        func.name(),
        random=registry.is_flagged(func, registry.RANDOM),
        data_dependent=registry.is_flagged(func, registry.DATA_DEPENDENT),
        floats=floats,
    )


def _make_functional_runner(func, lowering):
    op = _op_call(func, lowering)

    def run(ex: Executor, args, kwargs):
        jargs, jkwargs = _unwrap_args(args, kwargs, func, ex.pending)
        out = ex.call(op, jargs, jkwargs)
        if (type(out) is _Lazy or type(out) is _ArrayImpl) and out.dtype not in _AMBIGUOUS:  # (the common case)
            return JaxTensor(out)
        return _wrap_out(out, func, args, kwargs)

    return run


class _ViewFn:
    """The view `lowering(a, *rest, **kw)` (output `index` of a multi-output view) of a root
    array `a`; replayed when the root changes. Pending roots record the view (lazy mode)."""

    __slots__ = ("op", "rest", "kw", "index")

    def __init__(self, op: OpCall, rest, kw, index):
        self.op, self.rest, self.kw, self.index = op, rest, kw, index

    def __call__(self, a):
        if type(a) is _Lazy:
            out = lazy.record(self.op, [a, *self.rest], self.kw)
        else:
            out = self.op.lowering(a, *self.rest, **self.kw)
        return out if self.index is None else out[self.index]

    @property
    def key(self):
        """Structural key (None when an argument is an array: not recordable as a write)."""
        sig = signature(list(self.rest), self.kw, False)
        if sig is None or sig[1]:
            return None
        return ("view", self.op.func, sig[0], self.index)


# views whose elements may share memory (a stride-0 dimension): writes through them check (`_writes`)
_MAY_OVERLAP = frozenset({aten.expand.default, aten.as_strided.default})


def _make_view_runner(func, lowering):
    op = _op_call(func, lowering)
    may_overlap = func in _MAY_OVERLAP

    def run(ex: Executor, args, kwargs):
        jargs, jkwargs = _unwrap_args(args, kwargs, func, ex.pending)
        out = ex.call(op, jargs, jkwargs)
        base = args[0]
        if not isinstance(base, JaxTensor):
            return _wrap_out(out, func, args, kwargs)
        rest, kw = jargs[1:], jkwargs
        if isinstance(out, (list, tuple)):
            return type(out)(make_view(base, o, _ViewFn(op, rest, kw, i)) for i, o in enumerate(out))
        v = make_view(base, out, _ViewFn(op, rest, kw, None))
        if may_overlap:
            v._jt_overlap = True
        return v

    return run


# In-place and `out=` ops that are not pointwise but refuse, as torch does, a destination whose elements
# share memory (`x.expand(3, 4).copy_(src)`, `torch.mm(a, b, out=expanded)`); torch lets fills,
# `index_put_`, `masked_fill_`, `index_fill_`, `tril_`/`triu_`, metadata changes (`squeeze_`) and some
# reductions' `out=` (`sum`, `prod`, `amax`) write into one, element by element (`_overlap_policy`).
_OVERLAP_REFUSED = frozenset(
    {
        "mm",
        "cat",
        "sort",
        "index_select",
        "where",
        "cumsum",
        "mean",
        "copy_",
        "index_copy_",
        "index_add_",
        "index_reduce_",
        "masked_scatter_",
        "put_",
        "scatter_",
        "scatter_add_",
        "scatter_reduce_",
        "cumsum_",
        "cumprod_",
    }
)


# every element one value (every alias agrees), or metadata only (no value written)
_OVERLAP_WHOLE = frozenset(
    {"fill_", "zero_", "squeeze_", "unsqueeze_", "t_", "transpose_", "swapdims_", "swapaxes_", "detach_"}
)

# torch allows these (with a deprecation warning) and writes element by element into the shared memory
_OVERLAP_PARTIAL = frozenset({"masked_fill_", "index_fill_", "index_put_", "_index_put_impl_", "tril_", "triu_"})


def _overlap_policy(func) -> str:
    """What an in-place or `out=` op does with a destination whose elements share memory
    (`_writes.refuse_internal_overlap`): torch's refusal for pointwise ops (TensorIterator's check),
    random fills and `_OVERLAP_REFUSED`; allowed for whole fills; refused by jaxtorch for the rest
    (`index_put_`, `masked_fill_`, `tril_`, other `out=`), which torch writes element by element into
    the shared memory. Decided once per overload."""
    name = func._schema.name.split("::")[1]
    if name in _OVERLAP_WHOLE:
        return writes.WHOLE
    if name in _OVERLAP_PARTIAL:
        return writes.PARTIAL
    if name in _OVERLAP_REFUSED or registry.is_flagged(func, registry.RANDOM):
        return writes.REFUSED
    pointwise = torch.Tag.pointwise
    sibling = _functional_sibling(func)
    if pointwise in func.tags or (sibling is not None and pointwise in sibling.tags):
        return writes.REFUSED
    return writes.PARTIAL


def _cast_check(func, elementwise_op=None) -> Callable | None:
    """For an in-place or `out=` pointwise op (called only for ops that write), `check(value, t)`
    raising as torch does when the result's dtype cannot be cast to the tensor's
    (`int_tensor.add_(0.5)`, `int_tensor.sqrt_()`, `torch.add(float_t, 0.5, out=int_t)`): writing
    would round silently. None for other ops (fills, scatters and random fills cast by design;
    reductions such as `sum.IntList_out` cast into their out tensor as torch's do)."""
    pointwise = torch.Tag.pointwise
    if registry.is_flagged(func, registry.RANDOM):
        return None
    sibling = elementwise_op if elementwise_op is not None else _functional_sibling(func)
    if sibling is not None and registry.is_flagged(sibling, registry.RANDOM):
        return None
    if pointwise not in func.tags and (sibling is None or pointwise not in sibling.tags):
        return None

    castable: set = set()  # (result dtype, tensor dtype) pairs seen to cast
    how = "in-place op" if func._schema.name.endswith("_") else "out= argument"

    def check(value, t) -> None:
        pair = (value.dtype, t.dtype)
        if pair in castable:
            return
        result = to_torch_dtype(value.dtype)
        if result == t.dtype or torch.can_cast(result, t.dtype):
            if value.dtype not in _X64_DEPENDENT:
                castable.add(pair)
            return
        raise RuntimeError(
            f"jaxtorch: {func.name()}: result type {result} can't be cast to the desired output type "
            f"{t.dtype} (torch refuses this {how} too); use the out-of-place op, or cast the tensor first."
        )

    return check


def _make_mutating_runner(func, compute: Callable, mutated):
    """Run `compute` (functional) then write results into the mutated arguments."""
    positions = [(i, n, kw) for i, n, kw in mutated]
    check_cast = _cast_check(func)
    overlap_policy = _overlap_policy(func)
    void = not func._schema.returns  # (`split_copy.Tensor_out` writes its list, returns nothing)

    def write_list(ts, rs) -> None:
        """An `out=` list (`split_copy.Tensor_out`): each result copied into its tensor as torch's
        kernel does (`copy_`: broadcast to the tensor, cast to its dtype; never resized)."""
        if len(ts) != len(rs):
            name = f"{func._schema.name.split('::')[1]}_{func._overloadname}"
            raise RuntimeError(f"{name}() expected an out= argument of size {len(rs)}, got size {len(ts)}")
        for u in ts:
            if not isinstance(u, JaxTensor):
                _cpu_write(func, u)
                raise DeviceMismatchError(func, u.device)
        for u, v in zip(ts, rs):
            u.copy_(v if isinstance(v, torch.Tensor) else JaxTensor(v))

    def write_result(t, r) -> None:
        if t is None:
            return
        if isinstance(t, (list, tuple)):
            write_list(t, r)
            return
        if not isinstance(t, JaxTensor):
            _cpu_write(func, t)
            raise DeviceMismatchError(func, t.device)
        if t._jt_overlap:
            writes.refuse_internal_overlap(t, overlap_policy)
        value = r._raw() if type(r) is JaxTensor else r
        if check_cast is not None:
            check_cast(value, t)
        if tuple(value.shape) != tuple(t.shape):
            # squeeze_/unsqueeze_/t_/transpose_ change metadata; out= tensors are resized
            rebind(t, r if isinstance(r, JaxTensor) else JaxTensor(value))
            return
        write(t, value)

    if len(positions) == 1:  # (the common case: `add_`, `out=`; no lists built)
        ((i0, name0, kw0),) = positions

        def run_one(ex: Executor, args, kwargs):
            result = compute(ex, args, kwargs)
            t = kwargs.get(name0) if (kw0 or i0 >= len(args)) else args[i0]
            write_result(t, result)
            return None if void else t

        return run_one

    single = _single_aliased_return(func, positions)

    def run(ex: Executor, args, kwargs):
        result = compute(ex, args, kwargs)
        targets = []
        for i, name, kw_only in positions:
            t = kwargs.get(name) if (kw_only or i >= len(args)) else args[i]
            targets.append(t)
        results = result if isinstance(result, (list, tuple)) and len(targets) > 1 else (result,)
        for t, r in zip(targets, results):
            write_result(t, r)
        if void:
            return None
        return tuple(targets) if single is None else targets[single]

    return run


def _single_aliased_return(func, positions) -> int | None:
    """For an op writing several arguments but returning one of them (`_amp_update_scale_` returns
    `self`, `Tensor(a!)`), the index among `positions` of the argument returned; else None."""
    rets = func._schema.returns
    if len(rets) != 1 or rets[0].alias_info is None:
        return None
    sets = rets[0].alias_info.before_set
    args = func._schema.arguments
    for k, (i, _, _) in enumerate(positions):
        info = args[i].alias_info
        if info is not None and info.before_set == sets:
            return k
    return None


def _make_decomp_runner(func, decomp):
    def run(ex: Executor, args, kwargs):  # (the decomposition's ops are dispatched one by one)
        return decomp(*args, **kwargs)

    return run


def _foreach_runner(func) -> Callable | None:
    """`_foreach_add_.List(xs, ys)` and friends: the per-tensor op over the lists."""
    name = func._schema.name.split("::")[1]
    packet = getattr(aten, name[len("_foreach_") :], None)
    if packet is None:
        return None
    inplace = name.endswith("_")
    # foreach schemas pass some arguments positionally that the per-tensor op takes by
    # keyword (`_foreach_addcmul_(self, t1, t2, value)` vs `addcmul_(self, t1, t2, *, value)`)
    schemas = [getattr(packet, o)._schema for o in packet.overloads()]
    widest = max(schemas, key=lambda sc: len([a for a in sc.arguments if not a.kwarg_only]))
    n_pos = len([a for a in widest.arguments if not a.kwarg_only])
    kw_names = [a.name for a in widest.arguments if a.kwarg_only]

    def run(ex: Executor, args, kwargs):
        lists = [i for i, a in enumerate(args) if isinstance(a, (list, tuple))]
        n = len(args[lists[0]]) if lists else 0
        extra = dict(zip(kw_names, args[n_pos:]))
        outs = []
        for j in range(n):
            per = [a[j] if i in lists else a for i, a in enumerate(args)]
            kw = {k: (v[j] if isinstance(v, (list, tuple)) else v) for k, v in extra.items()}
            outs.append(packet(*per[:n_pos], **kw, **kwargs))
        return None if inplace else outs

    return run


def _sibling_compute(func, sibling, mutated) -> Callable:
    """The functional sibling's runner, called with an `out=` variant's out arguments dropped."""
    inner = _runner(sibling)
    if func._schema.name.endswith("_"):  # in-place: same arguments
        return inner
    names = {m[1] for m in mutated}
    n_pos = len([a for a in sibling._schema.arguments if not a.kwarg_only])
    if is_factory_sibling(func, sibling):  # `arange.out` -> `arange.start_step`: the out tensor's dtype
        ((i, out_name, kw_only),) = mutated

        def make(ex: Executor, args, kwargs):
            out = kwargs.get(out_name) if (kw_only or i >= len(args)) else args[i]
            kw = {k: v for k, v in kwargs.items() if k not in names}
            return inner(ex, args[:n_pos], {**kw, "dtype": out.dtype})

        return make

    if func.overloadpacket.__name__ in _OUT_DTYPE_ACCUMULATES and any(
        a.name == "dtype" for a in sibling._schema.arguments
    ):
        ((i, out_name, kw_only),) = mutated

        def accumulate(ex: Executor, args, kwargs):  # `torch.sum(x, 0, out=int_t)` sums x cast to int_t's dtype
            out = kwargs.get(out_name) if (kw_only or i >= len(args)) else args[i]
            kw = {k: v for k, v in kwargs.items() if k not in names}
            if kw.get("dtype") is None and isinstance(out, torch.Tensor):
                kw["dtype"] = out.dtype
            return inner(ex, args[:n_pos], kw)

        return accumulate

    def compute(ex: Executor, args, kwargs):
        return inner(ex, args[:n_pos], {k: v for k, v in kwargs.items() if k not in names})

    return compute


# Reductions and scans whose `out=` tensor's dtype, with no `dtype=` given, is the dtype torch computes
# in (`torch.sum(float_x, 0, out=int_t)` sums the truncated values: 1.5 + 2.5 gives 3, not 4)
_OUT_DTYPE_ACCUMULATES = frozenset({"sum", "prod", "cumsum", "cumprod"})


def _make_foreach_runner(func, multi: Callable, fallback: Callable) -> Callable:
    """A foreach op as one call of `multi` over its lists (see `foreach`); the in-place
    overloads write each result into its list element."""
    op = _op_call(func, multi, floats=True)
    inplace = func._schema.name.endswith("_")
    element = foreach.per_element(func)
    check_cast = _cast_check(func, element[0]) if inplace and element is not None else None

    def run(ex: Executor, args, kwargs):
        if not foreach.lists_of_jax_tensors(args, kwargs, JaxTensor) or (
            inplace and foreach.aliased_across(args, kwargs, _root)
        ):
            return fallback(ex, args, kwargs)
        jargs, jkwargs = _unwrap_args(args, kwargs, func, ex.pending)
        out = ex.call(op, jargs, jkwargs)
        if not inplace:
            firsts = args[0] if isinstance(args[0], (list, tuple)) else [None] * len(out)  # (`_foreach_pow(2.0, xs)`)
            return [labelled(o, t.dtype) if isinstance(t, JaxTensor) else JaxTensor(o) for o, t in zip(out, firsts)]
        if check_cast is not None:
            for t, r in zip(args[0], out):
                check_cast(r, t)
        for t in args[0]:
            if t._jt_overlap:
                writes.refuse_internal_overlap(t)
        write_many(args[0], out)
        return None

    return run


_root = root  # the tensor whose array `t` reads (itself, or a view's root)


def _build_runner(func) -> Callable:
    """The runner of `func`, as its route says (see `_routing`)."""
    return _runner_for(route(func))


def _runner_for(r: Route) -> Callable:
    """The runner that carries out the route `r` (one builder per route kind).

    Example: `_runner_for(route(aten.add_.Tensor))` runs `add.Tensor`'s runner, then writes back.
    """
    func = r.op
    match r.kind:
        case Kind.SPECIAL:
            return _SPECIAL[func]
        case Kind.FOREACH:
            assert r.multi is not None and r.fallback is not None  # (a FOREACH route has both)
            return _make_foreach_runner(func, r.multi, _runner_for(r.fallback))
        case Kind.VIEW:
            return _make_view_runner(func, r.lowering)
        case Kind.MUTATING:
            return _make_mutating_runner(func, _make_functional_runner(func, r.lowering), r.mutated)
        case Kind.FUNCTIONAL:
            return _make_functional_runner(func, r.lowering)
        case Kind.VIA_SIBLING | Kind.SIBLING_DECOMPOSED:
            return _make_mutating_runner(func, _sibling_compute(func, r.sibling, r.mutated), r.mutated)
        case Kind.DECOMPOSED:
            return _make_decomp_runner(func, r.decomposition)
        case Kind.FOREACH_LOOP:
            loop = _foreach_runner(func)
            if loop is not None:  # (a FOREACH_LOOP route has one)
                return loop
    return _make_unsupported_runner(func)


def _make_unsupported_runner(func) -> Callable:
    def unsupported(ex: Executor, args, kwargs):
        raise UnsupportedOpError(func)

    return unsupported


_RUNNERS: dict[Any, Callable] = {}


def _runner(func) -> Callable:
    r = _RUNNERS.get(func)
    if r is None:
        r = _build_runner(func)
        schema = getattr(func, "_schema", None)
        if schema is not None and (schema.is_mutable or any(a.alias_info is not None for a in schema.returns)):
            r = _serialized(r)  # writes, and views (a view's value and version are read together)
        _RUNNERS[func] = r
    return r


def _serialized(run: Callable) -> Callable:
    """`run` holding the state lock: an in-place op's read-compute-write is atomic, so the same
    tensor written from several threads loses no update (as eager torch's in-place kernels),
    and a new view's data and root version agree."""

    def locked(ex: Executor, args, kwargs):
        with lazy.STATE_LOCK:
            return run(ex, args, kwargs)

    locked.__name__ = run.__name__  # (the runner's kind stays readable: `unsupported` for a missing op)
    return locked


def _forget_runners() -> None:
    """Forget built runners: they hold the lowerings their routes named."""
    _RUNNERS.clear()


def install_listeners() -> None:
    """Subscribe every cache built from lowerings to the registry (idempotent; `jaxtorch._install`
    calls it): each change (register, unregister, register_op, notify) then reaches the routes
    (`_routing`), the runners (here) and the lazy executor's compiled programs (eager jits live in
    the runners' `OpCall`s).

    **Example:** `install_listeners(); registry.notify()` forgets every route and runner.
    """
    for listener in (route_clear, _forget_runners, lazy.clear_cache):
        registry.subscribe(listener)


def invalidate_cache() -> None:
    """Forget routes, runners and compiled programs (`registry.notify()`): after changing a
    lowering or an entry of torch's `decomposition_table`."""
    registry.notify()


_trace_clean = trace_ctx.is_top_level  # (per thread: trace_ctx is thread-local)


def dispatch(func, args, kwargs):
    """Run the ATen op `func` on `args`/`kwargs` (which hold `JaxTensor`s) with JAX.

    The op's runner (built once, `_runner`) gets the executor chosen for this call (`executor()`).

    **Example:**
        ```python
        out = dispatch(torch.ops.aten.add.Tensor, (x, y), {})   # x, y: JaxTensors
        ```
    """
    r = _RUNNERS.get(func)
    if r is None:
        r = _runner(func)
    try:
        if tracing._published:  # a backward under jax tracing: this may be torch's autograd thread
            with tracing.adopted():
                out = r(executor(), args, kwargs)
                if not _grad_enabled() and not _trace_clean():
                    _outside_graph(out, args)
                return out
        ex = executor()
        if ex.pending:  # (lazy: outside a JAX trace, so nothing to detach below)
            return ex.run(r, args, kwargs)
        out = r(ex, args, kwargs)
        if not _grad_enabled() and not _trace_clean():  # no_grad under a JAX trace: JAX must not differentiate
            _outside_graph(out, args)
        return out
    except (TypeError, ValueError, IndexError) as e:  # a shape error: torch's own message
        torch_error = meta_error(func, args, kwargs, e)
        if torch_error is None:
            raise
        raise torch_error from e


_grad_enabled = torch.is_grad_enabled


def _outside_graph(out, args) -> None:
    """The new results of an op run where torch records no graph (`no_grad`, `inference_mode`,
    `set_grad_enabled(False)`) under a JAX trace: JAX does not differentiate them either
    (`core._autodiff`). Results that are arguments (in-place, `out=`) were written as torch writes
    them: values changed, derivative kept (`_tensor.write`)."""
    if type(out) is JaxTensor:
        if not any(out is a for a in args):
            detach_result(out)
    elif isinstance(out, (list, tuple)):
        for o in out:
            if type(o) is JaxTensor and not any(o is a for a in args):
                detach_result(o)


# ---- ops the bridge itself owns: device moves, scalars, aliasing --------------------------
def _to_copy(ex, args, kwargs):
    (x,) = args
    device = kwargs.get("device")
    dtype = kwargs.get("dtype")
    if device is not None and not is_jax_device(device):  # jax -> cpu
        if isinstance(x, JaxTensor):
            t = array_to_torch(x._concrete(f"copy to {device}"), copy=False, dtype=x.dtype)
        else:
            t = x
        return t.to(dtype=dtype or t.dtype, device=device, copy=True)
    src = x._raw() if isinstance(x, JaxTensor) else None
    if src is None and device is not None and not getattr(_local, "from_data", 0):
        to_jax_dtype(dtype or x.dtype)  # an explicit move: float64 without x64 raises Float64Error, 0-dim too
    if src is None:  # cpu -> jax, cast by torch on the host first (its rounding; float64 never meets JAX)
        host = cast_on_host(x, dtype) if dtype is not None and x.device.type == "cpu" else x
        a = _host_array(host, aten._to_copy.default)
    else:
        a = src
    if dtype is not None and src is not None:
        jd = to_jax_dtype(dtype)
        a = executor(a).apply(("astype", jd), lambda v: v.astype(jd), a)
    if device is not None:
        d = jax_device_of(device)
        if d is not None and not isinstance(a, _Tracer) and not (type(a) is _Lazy and jax.local_device_count() == 1):
            a = jax.device_put(lazy.force(a, f"placement on {device}") if type(a) is _Lazy else a, d)
    if src is not None and a is src and type(a) is not _Lazy:  # (a pending value is immutable: sharing it is a copy)
        a = a + 0 if a.dtype != np.bool_ else a.copy()  # a copy, as torch makes
    return labelled(a, dtype or x.dtype)  # the torch dtype asked for, or the source's


def _copy_(ex, args, kwargs):
    dst, src = args[0], args[1]
    if isinstance(dst, JaxTensor):
        if dst._jt_overlap:
            writes.refuse_internal_overlap(dst)
        write(dst, src._raw() if isinstance(src, JaxTensor) else _host_array(src, aten.copy_.default))
        return dst
    # jax -> cpu copy into a plain tensor
    _cpu_write(aten.copy_.default, dst)
    dst.copy_(array_to_torch(src._concrete("copy_ into a CPU tensor"), copy=False))
    return dst


def _cpu_write(func, dst) -> None:
    """Inside `call_torch`/`extract`'s fn, torch state (a CPU tensor) is never written: the rule of
    `_writes` (checked by `JaxDispatchMode` before any op runs; this is the backstop for writes
    that reach the backend with Python dispatch excluded)."""
    if jax_by_default() and writes.is_torch_state(dst):
        writes.refuse_torch_state_write(func, dst)


def _local_scalar_dense(ex, args, kwargs):
    a = args[0]._concrete("Tensor.item() / bool() / int() / float()")
    if isinstance(a, _Tracer):
        if torch.is_anomaly_enabled():
            raise DataDependentError(
                aten._local_scalar_dense.default,
                "anomaly mode (`torch.autograd.set_detect_anomaly`) reads every gradient's values to look for NaNs, "
                "which a traced backward cannot: turn it on outside jax.jit/jaxtorch.jit (it works eagerly and "
                "lazily), or use JAX's own `jax.config.update('jax_debug_nans', True)` under jit.",
            )
        raise DataDependentError(aten._local_scalar_dense.default, "`.item()`/`bool()`/`int()` of a traced tensor.")
    return np.asarray(a).item()


def _lift_fresh(ex, args, kwargs):
    x = args[0]
    if isinstance(x, JaxTensor) or not jax_by_default():
        return x
    return labelled(tensor_to_jax(x), x.dtype)


def _resized(a, size):
    """The leading elements of `a` in the new shape, new ones zero (torch: uninitialized)."""
    import jax.numpy as jnp

    flat = a.reshape(-1)
    n = int(np.prod(size)) if size else 1
    flat = flat[:n] if flat.shape[0] >= n else jnp.concatenate([flat, jnp.zeros(n - flat.shape[0], flat.dtype)])
    return flat.reshape(size)


def _resized_any(a, size: tuple):
    """`_resized`, recorded when `a` is pending."""
    return executor(a).apply(("resize", size), lambda v: _resized(v, size), a)


def _resize_(ex, args, kwargs):
    t = args[0]
    rebind(t, JaxTensor(_resized_any(t._raw(), tuple(args[1]))))
    return t


def _alias_runner(ex, args, kwargs):
    x = args[0]
    return make_view(x, x._raw(), None)


_SPECIAL: dict[Any, Callable] = {  # keyed by exactly `_routing.SPECIAL_OPS`
    aten._to_copy.default: _to_copy,
    aten.copy_.default: _copy_,
    aten._local_scalar_dense.default: _local_scalar_dense,
    aten.lift_fresh.default: _lift_fresh,
    aten.lift_fresh_copy.default: lambda ex, a, k: _to_copy(ex, a, {}),
    aten.detach.default: _alias_runner,  # (torch's own detaches too: saved tensors; `JaxFunctionMode` sees the user's)
    aten.resize_.default: _resize_,
    aten.resize.default: lambda ex, a, k: labelled(_resized_any(a[0]._raw(), tuple(a[1])), a[0].dtype),
    aten.alias.default: _alias_runner,
}


# ---- the modes ----------------------------------------------------------------------------
def _is_factory(func, args, kwargs) -> bool:
    device = kwargs.get("device")
    if device is not None:
        return is_jax_device(device)
    return (
        jax_by_default()
        and not any(isinstance(a, torch.Tensor) for a in args)
        and "device" in {a.name for a in func._schema.arguments}
    )


class JaxDispatchMode(TorchDispatchMode):
    """Routes ops on `JaxTensor`s, and factories meant for the jax device, to `dispatch`."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:  # no torch._dynamo wrapper on the hot path
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if getattr(_local, "jax_default", 0) > 0:  # (inline `jax_by_default()`): the one write rule
            kwargs = kwargs or {}
            writes.refuse_torch_state_writes(func, args, kwargs)
            return writes.note_fresh(func, args, _mode_dispatch(func, types, args, kwargs))
        return _mode_dispatch(func, types, args, kwargs or {})


_MODE_DISPATCH = JaxDispatchMode.__torch_dispatch__  # (as defined; `install_dispatch` wraps it)


def install_dispatch() -> None:
    """Make the interpreter run every op on the jax device (idempotent; `jaxtorch._install` calls it
    after the device's install, which chose the device guard): `JaxTensor.__torch_dispatch__` calls
    `dispatch`, and with torch's Python guard an exception raised in an op the autograd engine runs
    is kept by both entry points (`engine_entry`).

    **Example:** `install_dispatch(); torch.ones(2, device="jax") + 1`.
    """
    _tensor.install_dispatch(dispatch)
    JaxDispatchMode.__torch_dispatch__ = engine_entry(_MODE_DISPATCH)  # type: ignore[method-assign]


def _mode_dispatch(func, types, args, kwargs):
    """`JaxDispatchMode`'s routing: ops on `JaxTensor`s and jax factories to `dispatch`, the rest to torch."""
    if JaxTensor in types or any(issubclass(t, JaxTensor) for t in types):
        if func is _LIFT_FRESH:
            return _lift_fresh(None, args, kwargs)
        return dispatch(func, args, kwargs)
    if func is _LIFT_FRESH:
        return _lift_fresh(None, args, kwargs)
    if _is_factory(func, args, kwargs):
        like = meta_likes.as_factory(func, args, kwargs)  # `empty_like(meta_t, device="jax")`: its shape only
        if like is not None:
            func, args, kwargs = like
        return _place(dispatch(func, args, kwargs), kwargs.get("device"))
    if _tensor.write_checks and _mutated_args(func):  # a compiled trace: CPU writes are checked too
        writes.check_writes(args, kwargs, _mutated_args(func))
    return func(*args, **kwargs)


def _place(out, device):
    """Put a factory's result on `jax.devices()[N]` for `device="jax:N"`."""
    if device is None or not isinstance(out, JaxTensor) or root(out) is not out:
        return out
    target = jax_device_of(device)
    data = root_data(out)
    if target is not None and not isinstance(data, _Tracer):
        if type(data) is _Lazy and jax.local_device_count() == 1:
            return out  # one device: a pending value will be computed there
        set_root_data(out, jax.device_put(out._concrete(f"placement on {device}"), target))
    return out


_LIFT_FRESH = aten.lift_fresh.default


_BACKWARD_FUNCS = {torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad}
_DATA = TensorBase.__dict__["data"]  # (its `__set__` is the function `t.data = v` calls)


class JaxFunctionMode(TorchFunctionMode):
    """Sees whole torch functions (above autograd). Runs autograd's entry points so that a
    backward under `jax.jit` traces into the same program (see `tracing`)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__self__", None) is _DATA and jax_by_default():  # `t.data = v`: no aten op to see
            writes.refuse_torch_state_writes(aten.set_data.default, args, kwargs)
        if func in _BACKWARD_FUNCS:
            with tracing.backward_in_trace():
                return func(*args, **kwargs)
        if func in _FROM_DATA:
            return _from_data_call(func, args, kwargs)
        if func in _OUTSIDE_GRAPH or (getattr(func, "__self__", None) is _DATA and func.__name__ == "__get__"):
            return _outside_graph_call(func, args, kwargs)
        if func in _ALPHA_OPS and _traced_scalar(kwargs.get("alpha")):
            return _scaled_by_alpha(func, args, kwargs)
        return func(*args, **kwargs)


# ops whose `alpha=` torch's argument parser turns into a number (`.item()`): a traced 0-d tensor there
# (an optimizer's learning rate lifted as a program input by jaxtorch.jit) scales `other` instead
_ALPHA_OPS = frozenset(
    {
        torch.add,
        torch.sub,
        TensorBase.add,
        TensorBase.add_,
        TensorBase.sub,
        TensorBase.sub_,
        foreach_add,
        foreach_add_,
        foreach_sub,
        foreach_sub_,
    }
)


def _traced_scalar(x) -> bool:
    """A 0-d jax tensor holding a tracer (its `.item()` is data-dependent)."""
    return isinstance(x, JaxTensor) and x.dim() == 0 and isinstance(root_data(x), _Tracer)


def _scaled_by_alpha(func, args, kwargs):
    """`func(self, other, alpha=a)` as `func(self, other * a)`: the value torch computes, `a` a traced tensor.

    Example: `p.add_(g, alpha=-lr)` -> `p.add_(g * -lr)`."""
    self_, other, *rest = args
    alpha = kwargs.pop("alpha")
    other = foreach_mul(other, alpha) if isinstance(other, (list, tuple)) else other * alpha
    return func(self_, other, *rest, **kwargs)


# what torch's autograd never differentiates through, seen as the user calls it (torch's own internal
# detaches, such as its saved tensors', are plain aliases: double backward goes through them)
_OUTSIDE_GRAPH = frozenset({TensorBase.detach, TensorBase.detach_, TensorBase.new_tensor, torch.tensor})


# factories from data: torch makes their values on the CPU and copies them to the device below the modes
# (`_to_copy_kernel`); a 0-dim float64 one is a factory's scalar, not an explicit move (see `_to_copy`)
_FROM_DATA = frozenset({TensorBase.new_tensor, torch.tensor, torch.as_tensor, torch.asarray})


def _from_data_call(func, args, kwargs):
    """`func(*args, **kwargs)` for a factory from data (`_FROM_DATA`): its copies to the jax
    device keep the 0-dim scalar rule (`torch.tensor(0.5, dtype=torch.float64)` inside `call_torch`
    is held as float32, as `torch.full((), 0.5, dtype=torch.float64)` is).

    **Example:** `_from_data_call(torch.tensor, (0.5,), {"dtype": torch.float64})`."""
    _local.from_data = getattr(_local, "from_data", 0) + 1
    try:
        return _outside_graph_call(func, args, kwargs) if func in _OUTSIDE_GRAPH else func(*args, **kwargs)
    finally:
        _local.from_data -= 1


def _outside_graph_call(func, args, kwargs):
    """`x.detach()`, `x.data`, `x.detach_()`, `x.new_tensor(t)`, `torch.tensor(t)` under a JAX trace:
    the result is not differentiated by JAX (`_tensor.detach_result`), as torch's is not."""
    out = func(*args, **kwargs)
    if isinstance(out, JaxTensor) and isinstance(out._raw(), _Tracer):
        detach_result(out)
    return out


# ---- factory kernels for the jax device, so `torch.empty(..., device="jax")` and the
# composite factories built on it work with or without the modes ---------------------------
def _empty(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    import jax.numpy as jnp

    dtype = dtype or torch.get_default_dtype()
    size = tuple(size)
    jd = scalar_jax_dtype(dtype) if _scalar_or_empty(size) else to_jax_dtype(dtype)
    return labelled(executor().nullary(("empty", size, jd), lambda: jnp.zeros(size, jd)), dtype)  # (lazy: recorded)


def _empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
    return _empty(size, dtype)


def _copy_from(src, dst, non_blocking=False):
    """Device copies that reach the backend with Python dispatch excluded (e.g. in `torch.tensor`)."""
    if isinstance(dst, JaxTensor):
        if dst.numel() == 0 and tuple(src.shape) == tuple(dst.shape):
            return dst  # nothing to copy (`torch.tensor([])`: no transfer, nothing recorded)
        write(dst, src._raw() if isinstance(src, JaxTensor) else _host_array(src, aten._copy_from.default))
    else:
        _cpu_write(aten._copy_from.default, dst)
        dst.copy_(array_to_torch(src._concrete("copy to a CPU tensor"), copy=False))
    return dst


def _to_copy_kernel(
    x, *, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False, memory_format=None
):
    """`cpu_t.to("jax")` without the modes (a module move, a loader's worker thread): one conversion,
    as under the modes. Without it torch makes `empty` on the device, then copies into it: a second
    array of the tensor's size for a while, whose freed memory the host allocator may keep."""
    return _to_copy(EAGER, (x,), {"dtype": dtype, "device": device})


_backend_lib: list[torch.library.Library] = []  # the library holding the kernels below, once installed


def _is_lowered_factory(op) -> bool:
    """Whether `op` is an ATen factory with a lowering: a `device` argument, no tensor argument,
    nothing written (`torch.arange(3)`, `torch.eye(2)`, `torch.tril_indices(3, 3)`).

    **Example:** `_is_lowered_factory(aten.arange.start_step)` is True; `aten.arange.out` is not.
    """
    schema = op._schema
    return (
        op.namespace == "aten"
        and not schema.is_mutable
        and any(a.name == "device" for a in schema.arguments)
        and not any("Tensor" in str(a.type) for a in schema.arguments)
        and registry.lookup(op) is not None
    )


def _factory_kernel(op) -> Callable:
    """The `jax` backend kernel of the factory `op`: its lowering, through `dispatch`.

    Without it, torch builds these factories for the device itself (`empty`, then the op's
    `out=` overload), and several of those paths loop back into the factory (`arange.out`'s
    reference calls `prims.iota`, whose ATen kernel calls `torch.arange`) or have no kernel at
    all (`tril_indices`). With it, `torch.arange(3, device="jax")` runs as it does under
    `enable_globally`: one op, torch's dtype.
    """

    def kernel(*args, **kwargs):
        return _place(dispatch(op, args, kwargs), kwargs.get("device"))

    kernel.__name__ = f"jax_{op.name().split('::')[1]}"
    return kernel


def _register_factory_kernels() -> list:
    """Give each lowered factory without a `jax` backend kernel one (`_factory_kernel`)."""
    done = []
    for key in registry.registered_ops():
        packet = isinstance(key, OpOverloadPacket)
        overloads = [getattr(key, o) for o in key.overloads()] if packet else [key]
        for op in overloads:
            if not isinstance(op, OpOverload) or not _is_lowered_factory(op):
                continue
            if has_kernel_for_dispatch_key(op.name(), "PrivateUse1"):
                continue  # (`empty`, `empty_strided`: the kernels above)
            _backend_lib[0].impl(op.name().split("::")[1], _factory_kernel(op), "PrivateUse1")
            done.append(op)
    return done


FACTORY_KERNELS: list = []  # the factories given a kernel by `install_backend`


def install_backend() -> None:
    """Register the `jax` device's own backend kernels (idempotent; `jaxtorch._install` calls it,
    after the lowerings are registered): `_copy_from`, `_to_copy`, `empty`, `empty_strided`, and
    one per lowered factory (`_register_factory_kernels`).

    **Example:** `install_backend(); torch.arange(3, device="jax")`.
    """
    if _backend_lib:
        return
    lib = torch.library.Library("aten", "IMPL")
    _backend_lib.append(lib)
    lib.impl("_copy_from", _copy_from, "PrivateUse1")
    lib.impl("_to_copy", _to_copy_kernel, "PrivateUse1")
    lib.impl("empty.memory_format", _empty, "PrivateUse1")
    lib.impl("empty_strided", _empty_strided, "PrivateUse1")
    FACTORY_KERNELS[:] = _register_factory_kernels()
