"""Everything `import jaxtorch` changes in torch and JAX, and every hook between layers, in one place.

The other modules define and expose; none changes torch, JAX or another layer when imported
(`tests/test_architecture.py` refuses a module-level install anywhere else). `jaxtorch/__init__.py`
calls `install_all()` once; `INSTALLS` lists the steps in the order they run, each a record
(name, what it changes, the function that does it); `jaxtorch.installed()` reports those done.

The order matters where one step relies on another:
- the `jax` device first: the other steps name it (autocast's `AutocastPrivateUse1` kernels, the
  generator, the module moves) and the C++ device guard must be in place before any backward;
- the lowerings' kernels after `jaxtorch.ops` is imported (importing it fills the registry), and
  the backend kernels after them (one kernel per lowered factory);
- the remat note on `register_hook` (`remat-hooks`) before the backward hooks, which
  wrap whatever `Tensor.register_hook` is then (so both run);
- `torch.cond`/`while_loop` after the interpreter's dispatch, which their kernels call.

Example:
    ```python
    import jaxtorch
    [r.name for r in jaxtorch.installed()]   # ['device', 'pytrees', 'jax-inputs', ...]
    ```
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from . import ops  # noqa: F401  (importing the lowerings fills the registry; it changes nothing in torch)
from .bridge.api import _exported
from .bridge.core import _pytrees, _registry
from .bridge.dispatch import (
    _autocast,
    _collectives,
    _control_flow,
    _custom_function,
    _foreach,
    _grad_scaler,
    _hooks,
    _interpreter,
    _remat_jax,
    _remat_torch,
)
from .bridge.state import _moves
from .bridge.tensor import _autograd, _convert, _device, _generator, _serialization, _tensor


class Installed(NamedTuple):
    """One thing `import jaxtorch` installed: its name and what it changes in torch or JAX."""

    name: str
    patches: str


class Install(NamedTuple):
    """One installation step: its name, what it changes in torch or JAX, and the function doing it."""

    name: str
    patches: str
    install: Callable[[], None]


INSTALLS: tuple[Install, ...] = (
    Install(
        "device",
        "torch's PrivateUse1 backend renamed 'jax', torch.jax its device module, the C++ device guard "
        "(compiled at the first import, else torch's Python guard keeping backward's exceptions)",
        _device.install,
    ),
    Install(
        "pytrees",
        "JAX's pytree registry: torch.Size and torch.return_types as nodes; a sys.meta_path finder that "
        "registers transformers' caches when transformers.cache_utils is imported",
        _pytrees.install,
    ),
    Install(
        "jax-inputs",
        "JAX's pytype_aval_mappings and canonicalize handlers: torch.Tensor accepted as a JAX input",
        _convert.install,
    ),
    Install("generator", "torch.Generator: a subclass accepting device='jax'", _generator.install),
    Install(
        "serialization",
        "torch.serialization's location tags: torch.load(map_location='jax') restores jax storages",
        lambda: _serialization.install(_tensor.JaxTensor),
    ),
    Install(
        "lazy-settle", "jaxtorch's lazy executor <- the tensor layer's walk over live tensors", _tensor.install_settle
    ),
    Install(
        "vjp-node",
        "jaxtorch's lowerings registry <- the tensor layer's call_jax (one autograd node per whole op)",
        lambda: _registry.install_vjp_node(_autograd.call_jax),
    ),
    Install(
        "lowering-kernels",
        "torch.library aten kernels at PrivateUse1 / AutogradPrivateUse1 for the ops kept whole "
        "(keep_whole: sdpa, rms_norm, RNNs, ...), batch norm and rrelu",
        _registry.install_kernels,
    ),
    Install(
        "registry-listeners",
        "jaxtorch's lowerings registry -> the routes, runners and lazy programs forgotten on each change",
        _interpreter.install_listeners,
    ),
    Install(
        "backend-kernels",
        "torch.library aten kernels at PrivateUse1: _copy_from, _to_copy, empty, empty_strided, lowered factories",
        _interpreter.install_backend,
    ),
    Install(
        "tensor-dispatch",
        "JaxTensor.__torch_dispatch__ and JaxDispatchMode.__torch_dispatch__ <- the dispatch layer's "
        "interpreter (keeping backward's exceptions under torch's Python guard)",
        _interpreter.install_dispatch,
    ),
    Install(
        "foreach",
        "torch.optim.optimizer._foreach_supported_types: JaxTensor added (foreach optimizer steps)",
        lambda: _foreach.enable_for_optimizers(_tensor.JaxTensor),
    ),
    Install(
        "autocast",
        "torch.library aten kernels at AutocastPrivateUse1 (torch's CPU autocast lists), fallthrough elsewhere",
        _autocast.install,
    ),
    Install(
        "remat-hooks",
        "torch.Tensor.register_hook / retain_grad: noted while a checkpointed region is traced",
        _remat_jax.install,
    ),
    Install(
        "custom-function",
        "torch.autograd.Function.apply: a jax.custom_vjp under a JAX transformation",
        _custom_function.install,
    ),
    Install(
        "remat",
        "torch.utils.checkpoint: its non-reentrant generator, CheckpointFunction and checkpoint's "
        "dynamo-disabled target",
        _remat_torch.install,
    ),
    Install(
        "grad-scaler",
        "torch.amp.GradScaler.scale / unscale_ / _maybe_opt_step for the jax device; GradScaler a pytree",
        _grad_scaler.install,
    ),
    Install(
        "hooks",
        "torch.Tensor.register_hook and torch.utils.hooks.BackwardHook._apply_on_tensors under a JAX trace",
        _hooks.install,
    ),
    Install(
        "control-flow",
        "torch.cond / torch.while_loop wrapped; jax-device kernels for the control-flow HOPs",
        lambda: _control_flow.install(_interpreter.JaxDispatchMode),
    ),
    Install(
        "module-moves",
        "torch.nn.Module.to / .cpu / .to_empty keep Parameter objects across the jax device",
        _moves.install_module_moves,
    ),
    Install("collectives", "torch.distributed: the 'jax' process-group backend", _collectives.install_jax_backend),
    Install(
        "export-marks",
        "torch.library custom ops jaxtorch::stop_gradient and jaxtorch::keep_tangent (from_exported's gradient cuts)",
        _exported.install_marks,
    ),
)

_DONE: list[Installed] = []


def install_all() -> None:
    """Run every step of `INSTALLS` in order, once (a second call does nothing). A step that raised
    (an interrupted first import) is run again by the next call, with the ones after it.

    **Example:** `install_all(); installed()[0].name` is `"device"`.
    """
    for step in INSTALLS[len(_DONE) :]:
        step.install()
        _DONE.append(Installed(step.name, step.patches))


def installed() -> tuple[Installed, ...]:
    """What `import jaxtorch` changed in torch and JAX (and the hooks between its layers), in order.

    **Arguments:** none.

    **Returns:** a tuple of `(name, patches)` records, one per installation step that ran, in the
    order they ran: `name` is short (`"module-moves"`), `patches` says what it changes in torch or
    JAX (`"torch.nn.Module.to / .cpu / .to_empty keep Parameter objects across the jax device"`).

    **Example:**
        ```python
        import jaxtorch
        for name, patches in jaxtorch.installed():
            print(f"{name}: {patches}")
        ```
    """
    return tuple(_DONE)
