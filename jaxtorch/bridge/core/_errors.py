"""Errors raised by jaxtorch. Each says what went wrong and what to do about it."""

from __future__ import annotations

import traceback
from pathlib import Path


class JaxtorchError(RuntimeError):
    """Base class of jaxtorch's errors."""


class UnsupportedOpError(JaxtorchError, NotImplementedError):
    """An ATen (or custom) op has no JAX lowering and no decomposition."""

    def __init__(self, op, detail: str = ""):
        name = getattr(op, "name", lambda: str(op))()
        if "::" in name and "." not in name.split("::")[1]:
            name = f"{name}.default"
        msg = (
            f"jaxtorch has no JAX lowering for the op `{name}`"
            + (f" ({detail})" if detail else "")
            + ". Register one with `jaxtorch.register_op(torch.ops."
            + name.replace("::", ".")
            + ", jax_impl)`, where jax_impl takes and returns jax arrays; "
            "or run the model through `jaxtorch.coverage.check(model, *args)` to list every missing op."
        )
        super().__init__(msg)
        self.op = op


# Frames that are machinery between the user's line and the op (jaxtorch, torch's dispatch, jax).
_MACHINERY = (
    str(Path(__file__).resolve().parents[2]),
    "torch/_ops.py",
    "torch/overrides.py",
    "torch/_tensor.py",
    "torch/utils/_python_dispatch.py",
    "torch/utils/_device.py",
    "torch/_prims_common",
    "/jax/",
    "torch/_decomp",
    "torch/_refs",
    "torch/utils/_contextlib.py",
    "torch/nn/modules/module.py",
)


def source_line() -> str:
    """`file:line: code` of the innermost Python frame outside jaxtorch and torch's dispatch
    machinery: the line (of the user's code, or of torch's own Python code) that asked for a value."""
    for frame in reversed(traceback.extract_stack()[:-1]):
        if not any(m in frame.filename for m in _MACHINERY):
            name = frame.filename.split("site-packages/")[-1]
            return f"{name}:{frame.lineno}: `{(frame.line or '').strip()}`"
    return ""


class DataDependentError(JaxtorchError):
    """An op whose output shape or Python value depends on array values ran under tracing.

    The message names the Python line that asked for the value (`source_line`).
    """

    def __init__(self, op, hint: str = ""):
        name = getattr(op, "name", lambda: str(op))()
        where = source_line()
        msg = (
            f"`{name}` produces a shape or Python value that depends on the data, so it cannot be "
            "traced by jax.jit/grad/vmap (the values are abstract tracers there). "
            + (f"It was asked for at {where}. " if where else "")
            + (hint.rstrip(". ") + ". " if hint else "")
            + "Run it eagerly (outside jax.jit), or rewrite it with a static shape: "
            "`torch.where(mask, x, 0)` instead of `x[mask]`, `nonzero(size=...)`-style padding, "
            "or tensor ops instead of `.item()` in Python control flow."
        )
        super().__init__(msg)
        self.op = op


class DeviceMismatchError(JaxtorchError):
    """A plain CPU tensor was mixed into a computation on the `jax` device."""

    def __init__(self, op, other_device):
        name = getattr(op, "name", lambda: str(op))()
        super().__init__(
            f"Expected all tensors to be on the same device, but `{name}` got tensors on jax:0 and "
            f"{other_device}. Move the CPU tensor with `t.to('jax')`, create tensors in `forward` with "
            "`device=x.device`, or register it as a module buffer so `model.to('jax')` moves it; inside "
            "`jaxtorch.call_torch`/`extract` CPU tensors are converted automatically."
        )


class Float64Error(JaxtorchError, TypeError):
    """A float64/complex128 value met JAX with 64-bit mode off."""

    def __init__(self, dtype):
        super().__init__(
            f"{dtype} needs JAX's 64-bit mode, which is off. Either call "
            "`jax.config.update('jax_enable_x64', True)` before creating arrays, or use float32 "
            "(`tensor.float()`, `torch.set_default_dtype(torch.float32)`)."
        )


class Int64Error(JaxtorchError, OverflowError):
    """An int64/uint64 value outside the 32-bit range met JAX with 64-bit mode off.

    With 64-bit mode off JAX holds `torch.int64` data as int32 (and `uint64` as uint32); a value
    that does not fit would wrap, so jaxtorch refuses it instead.
    """

    def __init__(self, dtype, value, where: str = ""):
        at = f" in {where}" if where else ""
        super().__init__(
            f"{dtype} value {value}{at} does not fit in 32 bits, and JAX's 64-bit mode, which is off, "
            "is what holds wider integers: it would wrap. Either call "
            "`jax.config.update('jax_enable_x64', True)` before creating arrays, or keep the values "
            "within the int32 range."
        )


class MissingKeyError(JaxtorchError):
    """A random op ran under tracing without a JAX PRNG key."""

    def __init__(self, op):
        name = getattr(op, "name", lambda: str(op))()
        super().__init__(
            f"`{name}` draws random numbers under jax tracing, but no PRNG key was given, and "
            "baking one key into the compiled function would repeat the same randomness every call. "
            "Pass a key: `fn(params, *args, rng=jax.random.key(step))` for `extract`, "
            "`step(state, x, y, rng=key)` for `jaxtorch.train.make_train_step`, `fast(x, rng=key)` for "
            "`jaxtorch.compile`, or `jaxtorch.call_torch(f, *args, rng=key)`; or turn dropout off: call `model.eval()` "
            "(`extract`'s fn keeps the mode it was made with: make it with "
            "`jaxtorch.extract(model, train=False)`)."
        )


class GeneratorUnderTraceError(JaxtorchError):
    """A random op was given a torch `generator=` under jax tracing."""

    def __init__(self, op):
        name = getattr(op, "name", lambda: str(op))() if op is not None else "a random op"
        super().__init__(
            f"`{name}` was given a torch `generator=` under jax tracing (`jax.jit`, `jaxtorch.jit`, "
            "`jaxtorch.compile`, a train step): the generator would be read once, when the function is "
            "traced, and the compiled function would repeat the same numbers at every call. Drop "
            "`generator=` and pass a JAX key for the call instead (`rng=jax.random.key(step)`), or run "
            "the op eagerly (outside the compiled function)."
        )


class ModuleReleasedError(JaxtorchError, ReferenceError):
    """A function made from a torch module (`make_train_step`'s step and init) needs the module
    again (to trace a new input shape, to read its current values) after the caller freed it;
    such functions hold it only weakly once traced, so that `del model` frees its weights."""


class OnceDifferentiableError(JaxtorchError):
    """A `torch.autograd.Function` whose backward is `@once_differentiable` was differentiated twice
    under a JAX transformation (`jax.hessian`, grad of grad), which torch refuses too."""


class HookUnderTraceError(JaxtorchError):
    """A backward hook jaxtorch cannot honour under a JAX transformation (it names the hook and the way out)."""


class StateWriteError(JaxtorchError):
    """A write jaxtorch cannot carry out, raised instead of losing it.

    A compiled function (`jaxtorch.jit`/`compile`) wrote into a tensor that is not program
    state: one reached only through a closure or a global, or a traced value stored on a module
    attribute that is not a parameter or buffer; or torch code run as a pure JAX function
    (`call_torch`, `extract`'s `fn`) wrote to a CPU tensor (`cpu_write`, `torch_state_write`), or a
    non-mutable `extract` function's forward wrote a module buffer (`read_only_write`). The
    message names the tensor and the way out."""

    @classmethod
    def cpu_write(cls, op, shape) -> StateWriteError:
        """The error for a write to a CPU tensor inside `call_torch` / `extract`'s `fn`."""
        name = getattr(op, "name", lambda: str(op))()
        return cls(
            f"`{name}` writes to a CPU tensor of shape {tuple(shape)} inside `jaxtorch.call_torch` (or the "
            "function from `jaxtorch.extract`), which runs torch code as a pure JAX function: it never changes "
            "torch state, eagerly or under jax.jit. If the tensor is a module buffer (BatchNorm running "
            "statistics), use `params, fn = jaxtorch.extract(model, mutable=True)`: `fn` returns the new values; "
            "or call `model.eval()`."
        )

    @classmethod
    def torch_state_write(cls, op, what: str) -> StateWriteError:
        """The error for an op writing a plain torch tensor (`what` names it) inside a JAX-first function.

        **Example:** `StateWriteError.torch_state_write(aten.add_.Tensor, "`Counter.count` (...)")`.
        """
        name = getattr(op, "name", lambda: str(op))()
        return cls(
            f"`{name}` writes in place to {what} inside `jaxtorch.call_torch` / the function from "
            "`jaxtorch.extract` / a `TorchModule`, which run torch code as a pure JAX function: torch state is "
            "never changed there, eagerly or under jax.jit (under jit the write would happen once, at trace "
            "time, and never again). Ways out: return the new value instead of writing it; or make the tensor a "
            "module buffer (`self.register_buffer('name', tensor)`) and use "
            "`params, fn = jaxtorch.extract(model, mutable=True)`, whose `fn` returns the new buffer values; for "
            "BatchNorm statistics, `extract(model, mutable=True)` or `model.eval()`; for a scratch tensor, "
            "create it inside the function (on the jax device, the default there) or write to a `.clone()`."
        )

    @classmethod
    def read_only_write(cls, owner: str, name: str, shape: tuple, dtype) -> StateWriteError:
        """The error for a write to a module tensor a non-mutable `extract` function bound read-only."""
        return cls(
            f"The forward of {owner} writes in place to `{name}` (shape {shape}, dtype {dtype}), but this function "
            "returns only the output (`jaxtorch.extract(model)` without `mutable=True`, or a `TorchModule`), so "
            "the new value would be lost (BatchNorm's running statistics in train mode, a counter buffer). Use "
            "`params, fn = jaxtorch.extract(model, mutable=True)`: `fn` returns `(output, new_state)`; or put "
            "the module in eval mode (`model.eval()`) if the statistics should not change."
        )


class MetaTensorError(JaxtorchError, NotImplementedError, ValueError):
    """An op reached jaxtorch with a tensor on the meta device, which has a shape and a dtype but no data.

    A model built under `torch.device("meta")` (or by a loader's empty-weights step) needs its
    values before it can run on the jax device. `torch.empty_like` / `zeros_like` / `new_empty`
    and the other factories "like" a meta tensor onto the jax device are fine (they read only
    its shape and dtype); anything that would read its values raises this error, which names
    the op and the ways out. A `NotImplementedError`, as torch's own "Cannot copy out of meta
    tensor" is, and a `ValueError`, as jaxtorch's conversions raised before.

    **Example:**
        ```python
        with torch.device("meta"):
            model = torch.nn.Linear(4, 2)
        model.to("jax")   # MetaTensorError: `aten::copy_` ... to_empty ... load_into ... device_map="jax"
        ```
    """

    def __init__(self, op, shape: tuple, dtype):
        name = op if isinstance(op, str) else f"`{getattr(op, 'name', lambda: str(op))()}`"
        self.op = op
        super().__init__(
            f"{name} got a tensor on the meta device (shape {tuple(shape)}, {dtype}): it has a shape and a "
            "dtype but no data, so there is nothing to run on the jax device. Ways out: give the module memory on "
            "the jax device first, `model.to_empty(device='jax')`, then load its weights "
            "(`model.load_state_dict(sd)`); or read a checkpoint into it, "
            "`jaxtorch.load_into(model, *jaxtorch.load_params(model, path))`, then `model.to('jax')`; or, for a "
            "Hugging Face model, `from_pretrained(path, device_map='jax')`, which loads the weights straight "
            "onto the jax device. (`torch.empty_like`/`zeros_like`/`new_empty` of a meta tensor onto the jax "
            "device read only its shape and dtype, and work.)"
        )
