"""`torch.amp.GradScaler("jax")`: fp16 loss scaling on the jax device, eagerly, lazily and compiled.

torch's `GradScaler` runs on the jax device as written, through the lowerings of its two kernels
(`ops/amp.py`), except for two lines, replaced here for a scaler whose scale is a jax tensor
(scalers on other devices run torch's code unchanged):

- `unscale_` computes the inverse scale as `scale.double().reciprocal().float()`, which needs
  float64; here it is `f32_reciprocal` (`bridge/core/_float_bits.py`) of the scale, the same float32 value (the
  correctly rounded reciprocal) without 64-bit mode, recorded like any op in lazy mode and traced under jit.
- `step` skips `optimizer.step()` when an inf/NaN was found, by reading `found_inf.item()`. Eagerly
  and in lazy mode (where `.item()` runs the pending graph) that is what happens here too. Under
  a JAX trace (`jaxtorch.jit`, `jaxtorch.compile`) the value is not known when the step is traced,
  so the step is taken and undone where an inf/NaN was found: parameters and optimizer state
  become `where(found_inf, before, after)`, one program for skipped and taken steps. A step that
  would create optimizer state (the first step of Adam, SGD with momentum) or change non-tensor
  state cannot be undone so, and raises `GradScalerError`: take the first step eagerly.

The scale and growth tracker are tensors on the scaler object: a compiled function given the
scaler as an argument (`train_step(model, opt, scaler, x, y)`) carries them as program state
(read at every call, written back after it), so a new scale compiles nothing again.

Example:
    ```python
    scaler = torch.amp.GradScaler("jax")
    with torch.autocast("jax", dtype=torch.float16):
        loss = loss_fn(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)          # skipped if a gradient is inf/NaN
    scaler.update()           # backs off or grows the scale
    ```
"""

from __future__ import annotations

import weakref
from typing import Any

import jax
import torch
from torch.amp.grad_scaler import GradScaler, OptState

from ..._compat import Tracer, get_grad_scaler_maybe_opt_step, set_grad_scaler_maybe_opt_step
from ..core import _pytrees as pytrees
from ..core._errors import GradScalerError
from ..core._executor import executor
from ..core._float_bits import f32_reciprocal
from ..tensor._tensor import JaxTensor, labelled, root, root_data

_Tracer = Tracer
_torch_scale = GradScaler.scale
_torch_unscale_ = GradScaler.unscale_
_torch_maybe_opt_step = get_grad_scaler_maybe_opt_step()
# the scalers a compiled call made from its arguments (`ArgState.rebuild` unflattens them): program state
_COPIES: weakref.WeakSet[GradScaler] = weakref.WeakSet()


def inverse_scale(scale: JaxTensor) -> JaxTensor:
    """`scale.double().reciprocal().float()` of a float32 jax tensor, without float64.

    **Arguments:** `scale`: a float32 tensor on the jax device (GradScaler's 0-d scale).

    **Returns:** a new float32 jax tensor, the correctly rounded reciprocal (pending in lazy mode).

    **Example:** `inverse_scale(torch.full((), 3.0, device="jax"))` holds `0.33333334`.
    """
    data = root_data(scale) if root(scale) is scale else scale.elem
    return labelled(executor(data).apply(("f32_reciprocal",), f32_reciprocal, data), torch.float32)


def _on_jax(scaler: GradScaler) -> bool:
    return bool(scaler._enabled) and isinstance(scaler._scale, JaxTensor)


def unscale_(self: GradScaler, optimizer: torch.optim.Optimizer) -> None:
    """torch's `GradScaler.unscale_`, with the inverse scale from `inverse_scale` on the jax device."""
    if not _on_jax(self):
        return _torch_unscale_(self, optimizer)
    self._check_scale_growth_tracker("unscale_")
    state = self._per_optimizer_states[id(optimizer)]
    if state["stage"] is OptState.UNSCALED:
        raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
    if state["stage"] is OptState.STEPPED:
        raise RuntimeError("unscale_() is being called after step().")
    scale = self._scale
    assert isinstance(scale, JaxTensor)  # (`_on_jax`)
    found_inf = torch.full((), 0.0, dtype=torch.float32, device=scale.device)
    state["found_inf_per_device"] = self._unscale_grads_(optimizer, inverse_scale(scale), found_inf, False)
    state["stage"] = OptState.UNSCALED
    return None


def _traced(t: Any) -> bool:
    return isinstance(t, JaxTensor) and isinstance(root_data(t), _Tracer)


def scale(self: GradScaler, outputs):
    """torch's `GradScaler.scale`; under a JAX trace, only for a scaler that is program state (an
    argument of the compiled function): another one (a global, a closure) raises `GradScalerError`,
    as its scale would be written once at trace time and its traced value would leak."""
    first = outputs[0] if isinstance(outputs, (list, tuple)) and outputs else outputs
    if self._enabled and _traced(first) and self not in _COPIES:
        raise GradScalerError.not_program_state()
    return _torch_scale(self, outputs)


def _maybe_opt_step(self: GradScaler, optimizer, optimizer_state: dict, *args, **kwargs):
    """torch's `_maybe_opt_step`; under a JAX trace, the step taken and undone where an inf/NaN was found."""
    found = list(optimizer_state["found_inf_per_device"].values())
    if not any(_traced(f) for f in found):
        return _torch_maybe_opt_step(self, optimizer, optimizer_state, *args, **kwargs)
    found_inf = found[0]
    for f in found[1:]:
        found_inf = found_inf + f.to(found_inf.device)
    return step_unless(optimizer, found_inf, *args, **kwargs)


def _snapshot(optimizer: torch.optim.Optimizer) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
    """Copies of the optimizer's parameters and of its per-parameter state (tensors cloned)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    with torch.no_grad():
        values = [p.detach().clone() for p in params]
        states = [
            {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in optimizer.state.get(p, {}).items()}
            for p in params
        ]
    return values, states


def _changed_keys(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """Keys a step added, removed, retyped, or (non-tensor values) changed."""
    out = [k for k in after if k not in before] + [k for k in before if k not in after]
    for k in after.keys() & before.keys():
        old, new = before[k], after[k]
        if isinstance(old, torch.Tensor) != isinstance(new, torch.Tensor):
            out.append(k)
        elif isinstance(new, torch.Tensor):
            if new.shape != old.shape or new.dtype != old.dtype:
                out.append(k)
        elif new is not old and not _equal(new, old):
            out.append(k)
    return sorted(out)


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # (an array-like without one truth value: count it as changed)
        return False


def step_unless(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor, *args, **kwargs):
    """`optimizer.step()`, then parameters and optimizer state put back where `found_inf != 0`.

    For a traced `found_inf` (under `jaxtorch.jit`): the compiled form of GradScaler's skipped step.
    Raises `GradScalerError` when the step creates optimizer state or changes non-tensor state.

    **Example:** `step_unless(opt, found_inf)` leaves `opt`'s parameters as they were if `found_inf` is 1.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    values, states = _snapshot(optimizer)
    retval = optimizer.step(*args, **kwargs)
    changed = sorted({k for p, old in zip(params, states) for k in _changed_keys(old, optimizer.state.get(p, {}))})
    if changed:
        raise GradScalerError.lazy_optimizer_state(type(optimizer).__name__, changed)
    with torch.no_grad():
        skip = found_inf != 0  # (NaN too, as `if not found_inf.item()` skips it)
        for p, old, old_state in zip(params, values, states):
            p.copy_(torch.where(skip, old, p))
            for k, v in optimizer.state.get(p, {}).items():
                if isinstance(v, torch.Tensor):
                    v.copy_(torch.where(skip, old_state[k], v))
    return retval


def install() -> None:
    """Put the two replacements on `torch.amp.GradScaler` (idempotent; other devices unchanged), and
    make it a pytree whose tensors are state: a compiled function given a scaler reads its scale and
    growth tracker at every call and writes them back, also when its first call creates them."""
    GradScaler.scale = scale  # type: ignore[method-assign]
    GradScaler.unscale_ = unscale_  # type: ignore[method-assign]
    set_grad_scaler_maybe_opt_step(_maybe_opt_step)
    pytrees.register(GradScaler, _flatten, _unflatten, _flatten_with_keys)  # (registers once)


def _flatten(obj: GradScaler):
    names, children, static = pytrees.object_split(obj)
    return children, (names, static)


def _flatten_with_keys(obj: GradScaler):
    names, children, static = pytrees.object_split(obj)
    return tuple((jax.tree_util.GetAttrKey(n), c) for n, c in zip(names, children)), (names, static)


def _unflatten(aux, children) -> GradScaler:
    names, static = aux
    copy = pytrees.object_rebuild(GradScaler, names, tuple(children), static)
    _COPIES.add(copy)
    return copy
