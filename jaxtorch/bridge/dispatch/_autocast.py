"""`torch.autocast("jax", dtype=torch.bfloat16 | torch.float16)`: torch's CPU autocast policy on the jax device.

Autocast is a dispatch key above autograd (`AutocastPrivateUse1` for the jax device): an op
listed here gets a kernel at that key which casts its floating-point jax-device tensor
arguments, then runs the op below the key, so autograd records the casts (gradients reach
float32 weights in float32), eagerly, in lazy mode and under `jaxtorch.compile`/`jit`. Ops
not listed fall through unchanged. The lists are torch's CPU autocast lists
(`aten/src/ATen/autocast_mode.cpp`, `TORCH_LIBRARY_IMPL(aten, AutocastCPU, m)`), read from the
installed torch by `install` (`import jaxtorch`; they differ between releases): every op with an `AutocastCPU` kernel,
its policy found by calling it under `torch.autocast("cpu")` on storage-less probe tensors
(`probe_cpu_policy`):

- `"lower"`: run in the autocast dtype (matmuls, convolutions, `linear`, attention);
- `"fp32"`: run in float32 (reductions and losses that need the range, linear algebra, FFTs);
- `"promote"`: run in the widest floating dtype among the arguments (`cat`, `stack`, `index_copy`).

An op whose policy is none of these raises `TorchVersionError` under `torch.autocast("jax")`
instead of guessing.

As in torch, float64 tensors are never cast, and only tensors on the autocast's device are.
torch's cast cache (one cast of each weight per autocast region) is not kept: every use of a
weight casts it again, which changes no value (under `jax.jit`, XLA merges the repeated casts).

Example:
    ```python
    with torch.autocast("jax", dtype=torch.bfloat16):
        y = model(x)              # linear layers in bfloat16, losses in float32
    ```
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..._compat import (
    AutoDispatchBelowAutograd,
    DispatchKey,
    DispatchKeySet,
    ExcludeDispatchKeyGuard,
    OpOverload,
    make_wrapper_subclass,
    registrations_for_dispatch_key,
)
from ..._compat import torch_pytree as pytree
from ..core._errors import ProbeStop, TorchVersionError

DEVICE_TYPE = "jax"
_KEY = DispatchKey.AutocastPrivateUse1  # type: ignore[attr-defined]


# ---- torch's CPU policy, read from the installed torch ----------------------------------------
class _Probe(torch.Tensor):
    """A storage-less CPU tensor that stops at the first op torch runs on it."""

    @staticmethod
    def __new__(cls, dtype: torch.dtype):
        return make_wrapper_subclass(cls, (2, 2), dtype=dtype, device=torch.device("cpu"))

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:  # type: ignore[override]
        raise ProbeStop(func, args, kwargs or {})


# a value of each plain schema type, for the required parameters of a probed op
_PLAIN: dict[str, object] = {
    "int": 1, "SymInt": 1, "float": 1.0, "bool": False, "number": 1, "str": "x", "List[int]": [1], "List[SymInt]": [1],
}  # fmt: skip


def _probe_arguments(op: OpOverload, dtypes: list[torch.dtype]) -> tuple[list, dict] | None:
    """Arguments for `op`'s required parameters: `_Probe` tensors of `dtypes` in order (the last one
    repeated), a plain value or None for the others; None when a parameter's type is unknown here."""
    tensors = iter([*dtypes[:-1], *[dtypes[-1]] * 16])
    args: list = []
    kwargs: dict = {}
    for a in op._schema.arguments:
        if a.has_default_value():
            continue
        kind = str(a.type)
        if kind == "Tensor":
            value: object = _Probe(next(tensors))
        elif kind == "List[Tensor]":
            value = [_Probe(next(tensors)), _Probe(next(tensors))]
        elif kind.startswith("Optional["):
            value = None
        elif kind in _PLAIN:
            value = _PLAIN[kind]
        else:
            return None
        if a.kwarg_only:
            kwargs[a.name] = value
        else:
            args.append(value)
    return args, kwargs


def _cast_dtype(op: OpOverload, dtypes: list[torch.dtype]) -> torch.dtype | None:
    """The dtype CPU autocast (to bfloat16) casts `op`'s tensor arguments to when they have `dtypes`;
    None when it casts none. Below autograd, a composite op reaches the probes whole (its body never
    runs), so the first op they see is autocast's cast (`aten.to.dtype`) or `op` itself."""
    built = _probe_arguments(op, dtypes)
    if built is None:
        return None
    args, kwargs = built
    with AutoDispatchBelowAutograd(), torch.autocast("cpu", dtype=torch.bfloat16):
        try:
            op(*args, **kwargs)
        except ProbeStop as stop:
            func, fargs, fkwargs = stop.args
            if func is torch.ops.aten.to.dtype:
                return fargs[1]
            if func is torch.ops.aten._to_copy.default:
                return fkwargs.get("dtype")
            return None
        except Exception:  # (autocast's kernel refused the probes: no policy read)
            return None
    return None


def probe_cpu_policy(op: OpOverload) -> str | None:
    """torch's CPU autocast policy of `op`, read by calling it under `torch.autocast("cpu")` on
    storage-less probe tensors (nothing is computed: the probe stops at the first op it reaches).

    **Arguments:**
    - `op`: an ATen overload with a CPU autocast kernel (`torch.ops.aten.mm.default`).

    **Returns:** `"fp32"` (bfloat16 arguments are cast to float32), `"lower"` (float32 ones are cast
    to the autocast dtype), `"promote"` (mixed bfloat16/float32 ones are cast to float32), or None
    (none of these: a policy this module does not know).

    **Example:** `probe_cpu_policy(torch.ops.aten.mm.default)` is `"lower"`.
    """
    if _cast_dtype(op, [torch.bfloat16]) == torch.float32:
        return "fp32"
    if _cast_dtype(op, [torch.float32]) == torch.bfloat16:
        return "lower"
    if _cast_dtype(op, [torch.bfloat16, torch.float32]) == torch.float32:
        return "promote"
    return None


def _overload(name: str) -> OpOverload | None:
    """The ATen overload named `name` (`"conv1d.padding"`, `"mm"`), or None if this torch lacks it."""
    base, _, overload = name.partition(".")
    packet = getattr(torch.ops.aten, base, None)
    return None if packet is None else getattr(packet, overload or "default", None)


def cpu_policies() -> dict[str, str | None]:
    """torch's CPU autocast lists, from the installed torch: every ATen op with an `AutocastCPU`
    kernel, by `name.overload` (no overload: the default one), with its `probe_cpu_policy`.

    **Returns:** `{"mm": "lower", "mse_loss": "fp32", "cat": "promote", ...}`.

    **Example:** `cpu_policies()["linalg_cholesky"]` is `"fp32"`.
    """
    table: dict[str, str | None] = {}
    for qualified in sorted(registrations_for_dispatch_key("AutocastCPU")):
        namespace, _, name = qualified.partition("::")
        op = _overload(name) if namespace == "aten" else None
        if op is not None:
            table[name] = probe_cpu_policy(op)
    return table


# Recurrent ops, which jaxtorch runs whole (`ops/rnn.py`) where CPU torch decomposes them into
# ops of the lists above (`mkldnn_rnn_layer`, `linear`): those casts decide their results' dtypes
# on the CPU (torch 2.13 and 2.14; tests/adversarial/cases_io.py compares each with CPU torch): RNN
# layers and cells and unprojected LSTM layers give the autocast dtype; GRU, LSTM cells and packed
# LSTMs give float32 (as they do here unchanged).
RECURRENT_LOWER: tuple[str, ...] = (
    "rnn_tanh.input",
    "rnn_tanh.data",
    "rnn_relu.input",
    "rnn_relu.data",
    "rnn_tanh_cell",
    "rnn_relu_cell",
)
RECURRENT_LSTM: tuple[str, ...] = ("lstm.input",)  # lower, but a projected LSTM's cell state stays float32


def _eligible(x) -> bool:
    """A tensor autocast casts: floating point, not float64, on the jax device."""
    return isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64 and x.device.type == "jax"


def _cast_all(tree, dtype: torch.dtype):
    return pytree.tree_map_only(torch.Tensor, lambda t: t.to(dtype) if _eligible(t) and t.dtype != dtype else t, tree)


def promote_type(tree, lower: torch.dtype) -> torch.dtype:
    """torch's `promote_type`: float32 if any eligible tensor is float32, else the autocast dtype.

    Example: `promote_type(([bf16_t, f32_t],), torch.bfloat16)` is `torch.float32`.
    """
    current = lower
    for x in pytree.tree_leaves(tree):
        if not _eligible(x):
            continue
        if x.dtype == torch.float32 or current == torch.float32:
            current = torch.float32
        elif x.dtype != lower:
            raise RuntimeError(
                f"jaxtorch autocast: {x.dtype} tensor in an op that promotes its arguments under "
                f"autocast({lower}) (torch: 'Unexpected floating ScalarType in at::autocast::prioritize'); "
                "cast it first."
            )
    return current


def _projected(hx) -> bool:
    """Whether `lstm`'s `(h0, c0)` belong to a projected LSTM (`proj_size`: h smaller than c)."""
    return len(hx) == 2 and hx[0].shape[-1] != hx[1].shape[-1]


def _kernel(op: OpOverload, policy: str | None) -> Callable:
    """The `AutocastPrivateUse1` kernel of `op`: cast as `policy` says, run `op` below autocast
    (a policy that `probe_cpu_policy` could not read raises `TorchVersionError`)."""
    exclude = DispatchKeySet(_KEY)

    def kernel(*args, **kwargs):
        if policy is None:
            raise TorchVersionError(
                f"torch.autocast('jax'): this torch autocasts {op} on the CPU with a policy jaxtorch could not "
                "read (it knows 'lower', 'fp32' and 'promote'); run this op outside autocast "
                "(`with torch.autocast('jax', enabled=False):`) with inputs you cast yourself"
            )
        lower = torch.get_autocast_dtype(DEVICE_TYPE)
        with ExcludeDispatchKeyGuard(exclude):
            if policy in ("lower", "lstm"):
                target = lower
            elif policy == "fp32":
                target = torch.float32
            else:
                target = promote_type((args, kwargs), lower)
            cast_args, cast_kwargs = _cast_all((args, kwargs), target)
            out = op(*cast_args, **cast_kwargs)
        if policy == "lstm" and _projected(args[1]):  # (output, h, c): CPU torch keeps c in float32
            out = (*out[:2], _cast_all(out[2], torch.float32))
        return out

    return kernel


_POLICIES: dict[str, str | None] = {}  # name.overload -> policy, filled by install()


def policy_of() -> dict[str, str | None]:
    """`{"aten::name.overload": "lower" | "fp32" | "promote" | "lstm" | None}` for every op autocast
    changes on the jax device: torch's CPU lists (`cpu_policies`) and the recurrent ops.

    **Example:** `policy_of()["aten::mm"]` is `"lower"`.
    """
    return {f"aten::{n}": policy for n, policy in _POLICIES.items()}


_lib: torch.library.Library | None = None


def install() -> None:
    """Register the kernels at `AutocastPrivateUse1`, and a fallthrough for every other op (once)."""
    global _lib
    if _lib is not None:
        return
    _POLICIES.update(cpu_policies())
    _POLICIES.update(dict.fromkeys(RECURRENT_LOWER, "lower"))
    _POLICIES.update(dict.fromkeys(RECURRENT_LSTM, "lstm"))
    lib = torch.library.Library("aten", "IMPL")
    for name, policy in _POLICIES.items():
        op = _overload(name)
        if op is not None:
            lib.impl(name, _kernel(op, policy), "AutocastPrivateUse1")
    fallthrough = torch.library.Library("_", "IMPL")
    fallthrough.fallback(torch.library.fallthrough_kernel, "AutocastPrivateUse1")
    _lib = lib
    _keep.append(fallthrough)


_keep: list = []


def state() -> tuple:
    """This thread's autocast settings for the jax device (part of a compiled program's key:
    a program traced under autocast casts, one traced without does not).

    Example: `state()` is `(True, torch.bfloat16)` inside `torch.autocast("jax", torch.bfloat16)`.
    """
    if not torch.is_autocast_enabled(DEVICE_TYPE):
        return (False,)
    return (True, torch.get_autocast_dtype(DEVICE_TYPE))
