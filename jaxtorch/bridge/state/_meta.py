"""Modules on the meta device: the values of their non-persistent buffers.

A model built under `with torch.device("meta"):` (or Hugging Face's empty-weights
construction) has shapes and dtypes but no data. Its weights come from a checkpoint
(`jaxtorch.load_params`), but non-persistent buffers (rotary `inv_freq`, causal masks) are
never saved: they are computed by the module's own code. `computed_buffers` gets them by
re-running that code on the CPU for a copy of the owning submodule only:

1. a Hugging Face model's `_init_weights(submodule)` (what `from_pretrained` runs for
   weights missing from a checkpoint: it recomputes every rotary embedding's `inv_freq`);
2. else the submodule's `reset_parameters()` / `_reset_parameters()` (torch's convention);

and checks the result: a buffer that neither filled (it still holds the NaN it was set to)
raises `MetaBufferError` naming it and the way out. Nothing of the original module changes.

Example:
    ```python
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    computed_buffers(model, ["model.rotary_emb.inv_freq"])  # {"model.rotary_emb.inv_freq": tensor([...])}
    ```
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import torch

from ..core._errors import MetaBufferError, ParamsError


def non_persistent_names(module: torch.nn.Module) -> set[str]:
    """Names (as `named_buffers` gives them) of the buffers `state_dict` leaves out."""
    out = set()
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for b in getattr(sub, "_non_persistent_buffers_set", ()):
            if sub._buffers.get(b) is not None:
                out.add(f"{prefix}.{b}" if prefix else b)
    return out


def is_meta(t: torch.Tensor) -> bool:
    return t.device.type == "meta"


def _init_hook(root: torch.nn.Module):
    """The Hugging Face `_init_weights` of `root` (or of its first `PreTrainedModel` part), or None."""
    for sub in root.modules():
        hook = getattr(sub, "_init_weights", None)
        if callable(hook) and hasattr(sub, "config"):
            return hook
    return None


def _recompute(root: torch.nn.Module, owner: torch.nn.Module, fill: int = 0) -> torch.nn.Module:
    """A CPU copy of `owner` whose buffers were computed by its own initialization code; before
    it runs, floating buffers hold NaN and the others `fill` (so a buffer it leaves alone shows).

    The copy first gets only its buffers on the CPU (its parameters stay on the meta device,
    where initializing them costs nothing: an embedding owning a scalar buffer, as Gemma's
    `embed_scale`, is not materialized); only code that needs parameter values (it fails on
    the meta device, or leaves the buffer there) runs again on a fully materialized copy."""
    try:
        clone = _initialized(root, _materialized(owner, buffers_only=True), fill)
        if not any(is_meta(b) or (b.is_floating_point() and bool(b.isnan().any())) for b in clone.buffers(False)):
            return clone
    except (RuntimeError, NotImplementedError, ValueError, TypeError):
        pass  # (initialization code that reads parameters: run it on real ones)
    return _initialized(root, _materialized(owner, buffers_only=False), fill)


def _materialized(owner: torch.nn.Module, *, buffers_only: bool) -> torch.nn.Module:
    """A copy of `owner` with uninitialized CPU memory for its buffers (and parameters)."""
    clone = copy.deepcopy(owner)
    if not buffers_only:
        return clone.to_empty(device="cpu")
    for m in clone.modules():
        for name, b in m._buffers.items():
            if b is not None and is_meta(b):
                m._buffers[name] = torch.empty_like(b, device="cpu")
    return clone


def _initialized(root: torch.nn.Module, clone: torch.nn.Module, fill: int) -> torch.nn.Module:
    """`clone` after its NaN/`fill` marking and its initialization code (see `_recompute`)."""
    with torch.no_grad():
        for b in clone.buffers(recurse=False):
            b.fill_(float("nan") if b.dtype.is_floating_point or b.dtype.is_complex else fill)
    hook = _init_hook(root)
    # (the initialization code draws random weights: the caller's random stream must not move)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        if hook is not None:
            for m in clone.modules():
                for flag in ("_is_hf_initialized",):
                    for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)):
                        if hasattr(t, flag):
                            delattr(t, flag)
                hook(m)
        for m in clone.modules():
            reset = getattr(m, "reset_parameters", None) or getattr(m, "_reset_parameters", None)
            if hook is None and callable(reset):
                reset()
    return clone


def computed_buffers(module: torch.nn.Module, names: Iterable[str]) -> dict[str, torch.Tensor]:
    """The values of the buffers `names` of `module`: their own if they have data, else
    (on the meta device) computed by re-running the owning submodule's initialization on a
    CPU copy (see the module docstring). Raises `MetaBufferError` for one it cannot compute."""
    out: dict[str, torch.Tensor] = {}
    clones: dict[str, torch.nn.Module] = {}
    for name in names:
        t = module.get_buffer(name)
        if not is_meta(t):
            out[name] = t
            continue
        prefix, _, leaf = name.rpartition(".")
        if prefix not in clones:
            clones[prefix] = _recompute(module, module.get_submodule(prefix))
        value = clones[prefix].get_buffer(leaf)
        if value.dtype.is_floating_point or value.dtype.is_complex:
            unset = bool(torch.isnan(value).any())
        else:  # no NaN for integers and booleans: run it again from another fill, compare
            again = _recompute(module, module.get_submodule(prefix), fill=1).get_buffer(leaf)
            unset = not torch.equal(value, again)
        if unset:
            raise MetaBufferError(
                f"jaxtorch: the buffer {name!r} is on the meta device and not saved in checkpoints "
                f"(non-persistent), and neither a Hugging Face `_init_weights` nor "
                f"`{type(module.get_submodule(prefix)).__name__}.reset_parameters()` computes it. Build that "
                "submodule outside `torch.device('meta')` (its buffers then have values), or give the buffer "
                f"its value before extracting: `model.get_submodule({prefix!r}).register_buffer({leaf!r}, value, "
                "persistent=False)`."
            )
        out[name] = value
    return out


def check_no_placeholders(tree: Mapping[str, Any], what: str) -> None:
    """Raise `ParamsError` for an entry of `tree` that is a `jax.ShapeDtypeStruct`: the
    placeholder `extract` gives for a tensor on the meta device, which has no value to run with.

    Example: `check_no_placeholders(extract(meta_model)[0], "params")` raises.
    """
    for name, value in tree.items():
        if isinstance(value, jax.ShapeDtypeStruct):
            raise ParamsError(
                f"jaxtorch: {what}[{name!r}] is a jax.ShapeDtypeStruct, the placeholder of a tensor on the meta "
                "device (it has no data to run with). Load the weights first: "
                "`params, state = jaxtorch.load_params(model, path)`, then `fn(params, x, state=state)` "
                "(`jax.eval_shape(fn, params, x)` accepts the placeholders)."
            )


def with_computed_buffers(module: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` (named as `named_state` names them) with each non-persistent buffer on the meta
    device replaced by its computed value (`computed_buffers`); others unchanged."""
    todo = [n for n in non_persistent_names(module) if n in tensors and is_meta(tensors[n])]
    return {**tensors, **computed_buffers(module, todo)} if todo else tensors


__all__ = [
    "MetaBufferError",
    "check_no_placeholders",
    "computed_buffers",
    "with_computed_buffers",
    "is_meta",
    "non_persistent_names",
]
