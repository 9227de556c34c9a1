"""Every private or version-dependent torch/JAX name jaxtorch uses, in one place.

The rest of the package imports these by plain name (`from jaxtorch._compat import Tracer`);
`tests/test_private_names.py` fails when a private name (a `torch`/`jax` chain with a `_name`
component, `jax.core`/`jax.interpreters`, `torch.__version__`) is used anywhere else. This module
imports only the standard library, torch and jax (layer 0 of `tests/test_architecture.py`).

Checked (imported here, exercised by the test suite) on torch 2.13.0 and 2.14.1 with JAX 0.10.2,
unless a line says otherwise; JAX 0.11.2 (seen on the GPU machine) was not checked for this module.
When a new release breaks a name, this is the one file to change.

Inventory (what each name is for):

torch dispatcher
- `torch._ops.OpOverload` / `OpOverloadPacket` / `HigherOrderOperator`: the types of ATen op handles.
- `torch._C.DispatchKey` / `DispatchKeySet` (`AutocastPrivateUse1`, `AutogradPrivateUse1`,
  `CompositeImplicitAutograd`, `Python`, `PythonTLSSnapshot`): dispatch keys jaxtorch registers at or excludes.
- `torch._C._ExcludeDispatchKeyGuard`, `torch._C._AutoDispatchBelowAutograd`, `torch._C.DisableTorchFunction`,
  `torch._C._disabled_torch_function_impl`: dispatcher guards.
- `torch._C._dispatch_get_all_op_names`, `_dispatch_has_kernel_for_dispatch_key`,
  `_dispatch_get_registrations_for_dispatch_key`: what the dispatcher knows (op names, kernels).
- `torch._C._get_privateuse1_backend_name`,
  `torch.utils.backend_registration._setup_privateuseone_for_python_backend`: the `jax` device.
- `torch.utils._python_dispatch` (`TorchDispatchMode`, `_disable_current_modes`, `_len_torch_dispatch_stack`):
  the `__torch_dispatch__` mode stack.
- `torch._decomp` (`decomposition_table`, `core_aten_decompositions`): torch's decompositions.
- `torch._C.TensorBase`, `torch.Tensor._make_wrapper_subclass`, `torch._C.Generator`,
  `torch._C._swap_tensor_impl`, `torch._C._nn` (and its `_parse_to`): tensor and module internals.
- `torch._foreach_add`/`_foreach_add_`/`_foreach_sub`/`_foreach_sub_`/`_foreach_mul`: the foreach ops.
- `torch._lazy_clone`: copy-on-write storage (None where a torch lacks it; present in 2.13 and 2.14).
- `torch._utils._rebuild_tensor`, `_rebuild_tensor_v2`, `_rebuild_parameter`, `_rebuild_parameter_with_state`,
  `torch._tensor._rebuild_from_type_v2`: pickling (`__reduce_ex__`).
- `torch.__version__`: the C++ guard's cache key and error messages.
- `VERSIONED_OPS`: ATen ops that exist only in some torch releases (`aten::cholesky`, `aten::qr`: 2.13 only).

torch autograd / checkpoint
- `torch._C._current_graph_task_id`, `_current_autograd_node`, `torch._C._autograd._get_sequence_nr`:
  the running backward pass and autograd node numbering.
- `torch.autograd._engine_run_backward`: the backward entry point jaxtorch wraps (without its C++ guard).
- `torch.autograd.function._SingleLevelFunction.setup_context`: the default `setup_context`.
- `torch.utils.hooks.BackwardHook._apply_on_tensors`: module full backward hooks (jaxtorch wraps it).
- `torch.utils.checkpoint._checkpoint_without_reentrant_generator_impl` (torch 2.14) /
  `_checkpoint_without_reentrant_generator` (torch 2.13): `CHECKPOINT_GENERATORS`; also read there:
  `CheckpointFunction`, `noop_context_fn`, `checkpoint.__wrapped__` and its `__dynamo_disable` global.
- `torch._dynamo.disable`: torch's checkpoint called without dynamo's wrapper.

torch pytree
- `torch.utils._pytree` (as `torch_pytree`; `tree_map`, `tree_leaves`): torch's container registry.

torch export / HOPs
- `torch._higher_order_ops.cond.cond_op`, `.map.map_impl`, `.scan.scan_op`, `.while_loop.while_loop_op`:
  control-flow higher-order operators (their `py_kernels` / `py_impl` are read and set).

torch distributed
- `torch.distributed._functional_collectives`: imported for its op registrations.
- `torch.distributed.distributed_c10d._resolve_process_group`: a group's name -> the group.
- `torch.distributed.Backend._plugins`: the registered backends.

torch amp / optim / nn
- `torch.amp.grad_scaler.GradScaler._maybe_opt_step`: wrapped for the jax device
  (GradScaler's `_scale`, `_growth_tracker`, `_per_optimizer_states` are read through its own API).
- `torch.optim.optimizer._foreach_supported_types`: the tensor types foreach optimizers accept.
- `torch.nn.modules.conv._ConvNd`: the base of the convolution modules.
- Private attributes of torch objects, read or set where they are used (not enforced by the test, which
  sees only names rooted at `torch`/`jax`): an op's `_schema`; `nn.Module._parameters`, `_buffers`,
  `_backward_hooks`; a tensor's `_version`, `_cdata`, `_typed_storage()`, `_untyped_storage`;
  GradScaler's `_scale`, `_enabled`, `_per_optimizer_states`, `_unscale_grads_`; `SymInt.node.expr`.

JAX core / tracing
- `jax.core.Tracer`, `jax.core.eval_jaxpr`, `jax.core.ShapedArray`: tracers, jaxpr evaluation, avals.
- `jax._src.core` (`trace_ctx`, `trace_state_clean`, `pytype_aval_mappings`): the current trace; torch
  tensors as JAX inputs.
- `jax._src.lax.lax._convert_element_type`: dtype conversion with `weak_type` control.
- `jax._src.lax.linalg.geqrf`: Householder QR (not re-exported by `jax.lax.linalg`).

JAX dtypes
- `jax._src.dtypes.register_canonicalize_value_handler`: torch tensors as JAX inputs (None where absent).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, TypeAlias

import jax
import torch
import torch._decomp as _decomp
import torch.utils._python_dispatch as _python_dispatch
import torch.utils._pytree as _torch_pytree
import torch.utils.hooks
from jax._src import core as _jax_core
from jax._src.lax import linalg as _jax_lax_linalg
from jax._src.lax.lax import _convert_element_type
from torch.amp.grad_scaler import GradScaler as _GradScaler

# ---- torch dispatcher ----------------------------------------------------------------------------
OpOverload: TypeAlias = torch._ops.OpOverload  # an ATen overload (`aten.add.Tensor`)
OpOverloadPacket: TypeAlias = torch._ops.OpOverloadPacket  # all overloads of one op (`aten.add`)
HigherOrderOperator: TypeAlias = torch._ops.HigherOrderOperator  # `cond`, `while_loop`, ... in exported graphs
DispatchKey = torch._C.DispatchKey
DispatchKeySet = torch._C.DispatchKeySet
ExcludeDispatchKeyGuard = torch._C._ExcludeDispatchKeyGuard  # `with ExcludeDispatchKeyGuard(keyset):`
AutoDispatchBelowAutograd = torch._C._AutoDispatchBelowAutograd  # run the kernels below autograd
DisableTorchFunction = torch._C.DisableTorchFunction  # `__torch_function__` off in the block
disabled_torch_function_impl = torch._C._disabled_torch_function_impl  # a subclass without torch_function
TensorBase: TypeAlias = torch._C.TensorBase  # torch.Tensor's C base (its `data` descriptor, unbound methods)
TorchGenerator = torch._C.Generator  # torch's own generator class (what `torch.Generator` was)
make_wrapper_subclass = torch.Tensor._make_wrapper_subclass  # a tensor subclass without storage
swap_tensor_impl = torch._C._swap_tensor_impl  # swap two tensors' C++ implementations
torch_nn_functions = torch._C._nn  # what torch.nn.functional calls (gelu, linear, ...)
parse_to = torch._C._nn._parse_to  # `Module.to`'s argument parser: (device, dtype, non_blocking, format)

foreach_add = torch._foreach_add
foreach_add_ = torch._foreach_add_
foreach_sub = torch._foreach_sub
foreach_sub_ = torch._foreach_sub_
foreach_mul = torch._foreach_mul

# `torch._lazy_clone(t)`: a copy-on-write clone (torch >= 2.4); None where this torch lacks it
lazy_clone: Callable[[torch.Tensor], Any] | None = getattr(torch, "_lazy_clone", None)


def all_op_names() -> list[str]:
    """Every operator name the dispatcher knows (`"aten::add"`, `"prims::mul"`, ...).

    Example: `"aten::add" in all_op_names()` is True.
    """
    return list(torch._C._dispatch_get_all_op_names())


def has_kernel_for_dispatch_key(name: str, key: str | DispatchKey) -> bool:
    """Whether op `name` (`"aten::gelu"`, or `"aten::add.Tensor"`) has a kernel at dispatch key `key`.

    Example: `has_kernel_for_dispatch_key("aten::linear", "CompositeImplicitAutograd")` is True.
    """
    return bool(torch._C._dispatch_has_kernel_for_dispatch_key(name, key))


def registrations_for_dispatch_key(key: str) -> list[str]:
    """The qualified op names (`"aten::mm"`) with a kernel registered at dispatch key `key`.

    Example: `"aten::mm" in registrations_for_dispatch_key("AutocastCPU")` is True.
    """
    return list(torch._C._dispatch_get_registrations_for_dispatch_key(key))


def privateuse1_backend_name() -> str:
    """The name torch gives the PrivateUse1 device now (`"privateuseone"` until renamed, then `"jax"`)."""
    return str(torch._C._get_privateuse1_backend_name())


def setup_privateuse1_python_backend(name: str, backend_module: Any) -> None:
    """torch's own setup of a Python PrivateUse1 backend named `name` (device module `backend_module`)."""
    import torch.utils.backend_registration as backend_registration

    backend_registration._setup_privateuseone_for_python_backend(name, backend_module=backend_module)


TorchDispatchMode = _python_dispatch.TorchDispatchMode  # the base of `__torch_dispatch__` modes
disable_current_modes = _python_dispatch._disable_current_modes  # `with disable_current_modes():` no mode
decomposition_table = _decomp.decomposition_table  # op -> torch's Python decomposition
core_aten_decompositions = _decomp.core_aten_decompositions  # () -> the table `torch.export` decomposes with


def python_dispatch_stack_len() -> int:
    """How many `__torch_dispatch__` modes are active (0 outside every mode).

    Example: `python_dispatch_stack_len() == 0` outside a `with TorchDispatchMode():` block.
    """
    return int(_python_dispatch._len_torch_dispatch_stack())


# ---- torch pytree ----------------------------------------------------------------------------------
torch_pytree = _torch_pytree  # torch's container registry (`tree_map`, `tree_leaves`, `register_pytree_node`)

# ---- torch export / higher-order operators ---------------------------------------------------------
# (imported by module name: `torch._higher_order_ops.cond` is also the name of a function there)
cond_op = importlib.import_module("torch._higher_order_ops.cond").cond_op  # what `torch.cond` calls
map_impl = importlib.import_module("torch._higher_order_ops.map").map_impl  # the `map` HOP
scan_op = importlib.import_module("torch._higher_order_ops.scan").scan_op  # the `scan` HOP
while_loop_op = importlib.import_module("torch._higher_order_ops.while_loop").while_loop_op  # `while_loop`


def torch_version() -> str:
    """The installed torch's version string, read at each call (`"2.13.0+cpu"`)."""
    return str(torch.__version__)


# ---- ATen ops that exist only in some torch releases ---------------------------------------------
# `name.overload` -> the torch releases it was checked in. A lowering names such an op through
# `ops.registry.versioned(...)`, which yields only what the installed torch has.
VERSIONED_OPS: dict[str, str] = {
    "cholesky.default": "in torch 2.13; removed in 2.14 (torch.linalg.cholesky replaces it)",
    "qr.default": "in torch 2.13; removed in 2.14 (torch.linalg.qr replaces it)",
}


def versioned_op(name: str) -> OpOverload | None:
    """The ATen overload `name` (`"cholesky.default"`, listed in `VERSIONED_OPS`) in this torch, or None.

    Example: `versioned_op("cholesky.default")` is None on torch 2.14.
    """
    if name not in VERSIONED_OPS:
        raise KeyError(f"jaxtorch: {name!r} is not in VERSIONED_OPS (jaxtorch/_compat.py); list it there first")
    base, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, base, None), overload or "default", None)


# ---- torch serialization -------------------------------------------------------------------------
rebuild_tensor_v2 = torch._utils._rebuild_tensor_v2
rebuild_parameter = torch._utils._rebuild_parameter
rebuild_parameter_with_state = torch._utils._rebuild_parameter_with_state
rebuild_from_type_v2 = torch._tensor._rebuild_from_type_v2
rebuild_tensor_code = torch._utils._rebuild_tensor.__code__  # (found on the stack while unpickling)


# ---- torch autograd / checkpoint -----------------------------------------------------------------
def current_graph_task_id() -> int:
    """The id of the backward pass running on this thread, -1 outside one."""
    return int(torch._C._current_graph_task_id())


def current_autograd_node() -> Any:
    """The autograd node being evaluated on this thread (None outside a backward pass)."""
    return torch._C._current_autograd_node()


def autograd_sequence_nr() -> int:
    """The sequence number the next autograd node made on this thread will get."""
    return int(torch._C._autograd._get_sequence_nr())


def get_engine_run_backward() -> Callable:
    """`torch.autograd._engine_run_backward`: what `backward()` and `torch.autograd.grad` call."""
    import torch.autograd as autograd

    return autograd._engine_run_backward


def set_engine_run_backward(fn: Callable) -> None:
    """Make `fn` what `backward()` and `torch.autograd.grad` call (see `get_engine_run_backward`)."""
    import torch.autograd as autograd

    autograd._engine_run_backward = fn


default_setup_context = torch.autograd.function._SingleLevelFunction.setup_context  # (not overridden)


def get_backward_hook_apply_on_tensors() -> Callable:
    """`torch.utils.hooks.BackwardHook._apply_on_tensors` (module full backward hooks)."""
    return torch.utils.hooks.BackwardHook._apply_on_tensors


def set_backward_hook_apply_on_tensors(fn: Callable) -> None:
    """Replace `BackwardHook._apply_on_tensors` with `fn`."""
    torch.utils.hooks.BackwardHook._apply_on_tensors = fn  # type: ignore[method-assign]


# torch's non-reentrant checkpoint hands the function it checkpoints to a generator, which calls it
# again to recompute; its name and signature changed between releases (newest first):
# - torch 2.14: `_checkpoint_without_reentrant_generator_impl(fn, args, kwargs, *, preserve_rng_state, ...)`
#   (`_checkpoint_without_reentrant_generator` is kept only as a shim that calls it);
# - torch 2.13: `_checkpoint_without_reentrant_generator(fn, preserve_rng_state, context_fn, ..., *args, **kwargs)`.
CHECKPOINT_GENERATORS: tuple[str, ...] = (
    "_checkpoint_without_reentrant_generator_impl",
    "_checkpoint_without_reentrant_generator",
)


def dynamo_disable(fn: Callable, recursive: bool = True, wrapping: bool = False) -> Callable:
    """`torch._dynamo.disable(fn, recursive, wrapping=wrapping)` (imports dynamo on first use)."""
    import torch._dynamo

    return torch._dynamo.disable(fn, recursive, wrapping=wrapping)


# ---- torch distributed ---------------------------------------------------------------------------
def import_functional_collectives() -> None:
    """Import `torch.distributed._functional_collectives` (it registers `_c10d_functional` autograd)."""
    if torch.distributed.is_available():
        importlib.import_module("torch.distributed._functional_collectives")


def resolve_process_group(name: str) -> Any:
    """The process group registered in torch.distributed under `name` (raises when there is none)."""
    from torch.distributed.distributed_c10d import GroupName, _resolve_process_group

    return _resolve_process_group(GroupName(name))


def c10d_backend_plugins() -> dict[str, Any]:
    """torch.distributed's registered third-party backends, by upper-case name."""
    return torch.distributed.Backend._plugins


# ---- torch amp / optim / nn ----------------------------------------------------------------------
def get_grad_scaler_maybe_opt_step() -> Callable:
    """`GradScaler._maybe_opt_step` (steps the optimizer unless an inf/NaN was found)."""
    return _GradScaler._maybe_opt_step


def set_grad_scaler_maybe_opt_step(fn: Callable) -> None:
    """Replace `GradScaler._maybe_opt_step` with `fn`."""
    _GradScaler._maybe_opt_step = fn  # type: ignore[method-assign]


def foreach_supported_types() -> list | None:
    """The list of tensor types torch's foreach optimizers accept (None where this torch has none)."""
    import torch.optim.optimizer as optimizer

    supported = getattr(optimizer, "_foreach_supported_types", None)
    return supported if isinstance(supported, list) else None


ConvNd = torch.nn.modules.conv._ConvNd


# ---- JAX core / tracing --------------------------------------------------------------------------
Tracer: TypeAlias = jax.core.Tracer
ShapedArray = jax.core.ShapedArray
eval_jaxpr = jax.core.eval_jaxpr
trace_ctx = _jax_core.trace_ctx  # the thread's current trace (`trace_ctx.trace`, `.is_top_level()`)
trace_state_clean = _jax_core.trace_state_clean  # True outside every JAX transformation
pytype_aval_mappings: dict[type, Callable] | None = getattr(_jax_core, "pytype_aval_mappings", None)
convert_element_type = _convert_element_type  # `(operand, new_dtype, weak_type, sharding)`
geqrf = _jax_lax_linalg.geqrf  # Householder QR: (reflectors, taus)

# ---- JAX dtypes ----------------------------------------------------------------------------------
try:
    from jax._src.dtypes import register_canonicalize_value_handler
except ImportError:  # pragma: no cover - another JAX
    register_canonicalize_value_handler = None
