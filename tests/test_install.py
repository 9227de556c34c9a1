"""`jaxtorch.installed()`: each step `import jaxtorch` ran is really in place, in the documented order, once.

Every record of `jaxtorch._install.INSTALLS` has a check here (a new record without one fails
`test_every_record_has_a_check`); each check reads torch, JAX or the hooked layer directly.
"""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.utils.checkpoint as torch_checkpoint
from torch.utils import hooks as torch_hooks

import jaxtorch
from jaxtorch import _install
from jaxtorch.bridge.api import _exported
from jaxtorch.bridge.core import _lazy, _pytrees, _registry
from jaxtorch.bridge.dispatch import (
    _collectives,
    _control_flow,
    _custom_function,
    _grad_scaler,
    _hooks,
    _interpreter,
    _remat_torch,
    _routing,
)
from jaxtorch.bridge.tensor import _autograd, _generator, _tensor
from jaxtorch.bridge.tensor import _device as _device_module
from jaxtorch.bridge.tensor._tensor import JaxTensor


def _has_kernel(name: str, key: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(name, key)


def _device() -> None:
    assert torch._C._get_privateuse1_backend_name() == "jax"
    assert torch.device("jax", 0).type == "jax" and hasattr(torch, "jax")
    assert torch.ones(2, device="jax").device.type == "jax"


def _pytree_nodes() -> None:
    assert jax.tree_util.tree_leaves(torch.Size([2, 3])) == [2, 3]
    values, indices = jax.tree_util.tree_leaves(torch.return_types.max((torch.ones(1), torch.zeros(1))))
    assert values.item() == 1.0 and indices.item() == 0.0
    finders = [f for f in sys.meta_path if isinstance(f, _pytrees._AfterImport)]
    hf = sys.modules.get(_pytrees._CACHE_MODULE)
    assert (hf is not None and hf.Cache in _pytrees._registered) or len(finders) == 1


def _jax_inputs() -> None:
    out = jax.jit(lambda x: x * 2)(torch.arange(3.0))
    np.testing.assert_array_equal(np.asarray(out), [0.0, 2.0, 4.0])


def _generator_step() -> None:
    assert torch.Generator is _generator.Generator
    assert torch.Generator(device="jax").manual_seed(0).device.type == "jax"


def _serialization() -> None:
    buf = io.BytesIO()
    torch.save(torch.arange(4.0, device="jax"), buf)
    buf.seek(0)
    back = torch.load(buf, map_location="jax")
    assert isinstance(back, JaxTensor)
    torch.testing.assert_close(back.cpu(), torch.arange(4.0))


def _lazy_settle() -> None:
    assert _lazy._settle[0] is _tensor._settle


def _vjp_node() -> None:
    assert _registry._VJP_NODE == [_autograd.call_jax]


def _lowering_kernels() -> None:
    for name, key in [
        ("aten::rms_norm", "PrivateUse1"),
        ("aten::rms_norm", "AutogradPrivateUse1"),
        ("aten::scaled_dot_product_attention", "PrivateUse1"),
        ("aten::native_batch_norm", "AutogradPrivateUse1"),
        ("aten::rrelu_with_noise", "AutogradPrivateUse1"),
    ]:
        assert _has_kernel(name, key), (name, key)
    assert len(_registry._kernel_lib) == 1
    assert {name for name, _, _ in _registry._KERNELS} >= {"rms_norm", "native_batch_norm", "rrelu_with_noise"}


def _registry_listeners() -> None:
    for listener in (_routing.clear, _interpreter._forget_runners, _lazy.clear_cache):
        assert _registry._LISTENERS.count(listener) == 1


def _backend_kernels() -> None:
    for name in ("aten::_copy_from", "aten::_to_copy", "aten::empty.memory_format", "aten::arange.start_step"):
        assert _has_kernel(name, "PrivateUse1"), name
    assert torch.ops.aten.arange.start_step in _interpreter.FACTORY_KERNELS
    torch.testing.assert_close(torch.arange(3, device="jax").cpu(), torch.arange(3))


def _tensor_dispatch() -> None:
    # the interpreter itself with the C++ device guard, else wrapped to keep backward's exceptions:
    # which one depends on the device step having run first
    entries = [(_tensor._dispatch, _interpreter.dispatch)]
    entries.append((_interpreter.JaxDispatchMode.__torch_dispatch__, _interpreter._MODE_DISPATCH))
    for entry, fn in entries:
        assert getattr(entry, "__wrapped__", entry) is fn
        assert (entry is fn) == bool(_device_module.CPP_GUARD)
    torch.testing.assert_close((torch.ones(2, device="jax") + 1).cpu(), torch.full((2,), 2.0))


def _foreach() -> None:
    import torch.optim.optimizer as optimizer

    assert JaxTensor in optimizer._foreach_supported_types


def _autocast() -> None:
    assert _has_kernel("aten::mm", "AutocastPrivateUse1")
    a = torch.ones(2, 2, device="jax")
    with torch.autocast("jax", torch.bfloat16):
        assert (a @ a).dtype == torch.bfloat16


def _remat_hooks_step() -> None:
    assert hasattr(torch.Tensor.retain_grad, "__wrapped__")


def _custom_function_step() -> None:
    assert torch.autograd.Function.__dict__["apply"].__func__ is _custom_function._apply


def _remat_step() -> None:
    assert torch_checkpoint.CheckpointFunction is _remat_torch.CheckpointFunction
    wrapped = [n for n in _remat_torch.GENERATORS if getattr(getattr(torch_checkpoint, n, None), "_jaxtorch", False)]
    assert len(wrapped) == 1
    assert torch_checkpoint.checkpoint.__wrapped__.__dynamo_disable is _remat_torch.checkpoint


def _grad_scaler_step() -> None:
    GradScaler = torch.amp.GradScaler
    assert GradScaler.scale is _grad_scaler.scale and GradScaler.unscale_ is _grad_scaler.unscale_
    assert GradScaler._maybe_opt_step is _grad_scaler._maybe_opt_step
    assert GradScaler in _pytrees._registered


def _hooks_step() -> None:
    assert torch.Tensor.register_hook is _hooks._register_hook
    assert torch_hooks.BackwardHook._apply_on_tensors is _hooks._apply_on_tensors


def _control_flow_step() -> None:
    assert hasattr(torch.cond, "jaxtorch_wraps") and hasattr(torch.while_loop, "jaxtorch_wraps")
    for hop in _control_flow._KERNELS:
        assert torch._C.DispatchKey.AutogradPrivateUse1 in hop.py_kernels, hop


def _module_moves() -> None:
    Module = torch.nn.Module
    assert Module.to._jaxtorch and Module.cpu._jaxtorch and Module.to_empty._jaxtorch
    m = torch.nn.Linear(2, 2)
    weight = m.weight
    m.to("jax")
    assert m.weight is weight and m.weight.device.type == "jax"


def _collectives_step() -> None:
    if dist.is_available():
        assert _collectives.BACKEND.upper() in dist.Backend._plugins


def _export_marks() -> None:
    assert _exported._STOP is torch.ops.jaxtorch.stop_gradient.default
    assert _exported._KEEP is torch.ops.jaxtorch.keep_tangent.default
    assert _exported._OWN[_exported._STOP] is not None and _exported._OWN[_exported._KEEP] is not None


CHECKS = {
    "device": _device,
    "pytrees": _pytree_nodes,
    "jax-inputs": _jax_inputs,
    "generator": _generator_step,
    "serialization": _serialization,
    "lazy-settle": _lazy_settle,
    "vjp-node": _vjp_node,
    "lowering-kernels": _lowering_kernels,
    "registry-listeners": _registry_listeners,
    "backend-kernels": _backend_kernels,
    "tensor-dispatch": _tensor_dispatch,
    "foreach": _foreach,
    "autocast": _autocast,
    "remat-hooks": _remat_hooks_step,
    "custom-function": _custom_function_step,
    "remat": _remat_step,
    "grad-scaler": _grad_scaler_step,
    "hooks": _hooks_step,
    "control-flow": _control_flow_step,
    "module-moves": _module_moves,
    "collectives": _collectives_step,
    "export-marks": _export_marks,
}


def test_installed_lists_every_step_in_order():
    records = jaxtorch.installed()
    assert [r.name for r in records] == [step.name for step in _install.INSTALLS]
    assert [r.patches for r in records] == [step.patches for step in _install.INSTALLS]
    assert len({r.name for r in records}) == len(records)
    assert all(isinstance(r.name, str) and r.patches for r in records)
    name, patches = records[0]  # (name, patches) records
    assert (name, patches) == (records[0].name, records[0].patches)


def test_every_record_has_a_check():
    assert list(CHECKS) == [r.name for r in jaxtorch.installed()]


def test_each_record_is_in_place():
    failed = []
    for name, check in CHECKS.items():
        try:
            check()
        except AssertionError as e:
            failed.append(f"{name}: {e!r}")
    assert failed == []


def test_install_all_is_idempotent():
    before = (torch.nn.Module.to, torch.Tensor.register_hook, torch.Generator, torch.cond, _registry._kernel_lib[0])
    listeners = list(_registry._LISTENERS)
    _install.install_all()
    after = (torch.nn.Module.to, torch.Tensor.register_hook, torch.Generator, torch.cond, _registry._kernel_lib[0])
    assert before == after and listeners == _registry._LISTENERS
    assert len(jaxtorch.installed()) == len(_install.INSTALLS)
    for step in _install.INSTALLS:  # each step on its own is idempotent too
        step.install()
    assert (torch.nn.Module.to, torch.Tensor.register_hook, torch.Generator, torch.cond) == after[:4]
    assert listeners == _registry._LISTENERS
    _lowering_kernels()


def test_installed_is_public_and_documented():
    assert "installed" in jaxtorch.__all__ and jaxtorch.installed is _install.installed
    doc = jaxtorch.installed.__doc__ or ""
    assert "**Arguments:**" in doc and "**Returns:**" in doc and "**Example:**" in doc


def test_a_submodule_imported_alone_is_installed():
    """Importing one submodule goes through `jaxtorch/__init__.py`, so everything is installed."""
    code = textwrap.dedent(
        """
        import jaxtorch.bridge.tensor._tensor as t
        import jaxtorch, torch
        print(len(jaxtorch.installed()), torch.nn.Module.to._jaxtorch, (torch.ones(2, device="jax") * 2).sum().item())
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [str(len(_install.INSTALLS)), "True", "4.0"]


def test_an_interrupted_install_is_finished_by_the_next_call(monkeypatch):
    """A step that raised during `import jaxtorch` is not marked done: the next `install_all()` runs it
    and every step after it, never leaving jaxtorch half-installed."""
    from jaxtorch import _install

    done = list(_install._DONE)
    calls = []
    steps = tuple(s._replace(install=lambda s=s: calls.append(s.name)) for s in _install.INSTALLS)

    def broken() -> None:
        raise RuntimeError("interrupted")

    monkeypatch.setattr(_install, "INSTALLS", steps[:-2] + (steps[-2]._replace(install=broken), steps[-1]))
    monkeypatch.setattr(_install, "_DONE", done[:-2])
    with pytest.raises(RuntimeError, match="interrupted"):
        _install.install_all()
    assert [r.name for r in _install._DONE] == [r.name for r in done[:-2]] and calls == []
    monkeypatch.setattr(_install, "INSTALLS", steps)
    _install.install_all()
    assert calls == [steps[-2].name, steps[-1].name]
    assert [r.name for r in _install._DONE] == [r.name for r in done]
