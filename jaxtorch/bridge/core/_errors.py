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
            "or tensor ops instead of `.item()` in Python control flow; for a branch or a loop on a traced value, "
            "`torch.cond(pred, true_fn, false_fn, (x,))` (or `torch._higher_order_ops.while_loop` / `scan`), "
            "which becomes one `lax.cond` (`lax.while_loop`, `lax.scan`)."
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


class ExportedProgramError(JaxtorchError):
    """A `torch.export.ExportedProgram` that `jaxtorch.from_exported` cannot turn into a pure JAX
    function: it writes its buffers (without `mutable=True`), its parameters or its inputs, has
    data-dependent sizes, side-effect tokens, custom objects, or higher-order ops (`torch.cond`,
    `torch.map`, ...) left in its graph. The message names what was found and the way out."""


class ExportedInputError(JaxtorchError, ValueError):
    """The arguments given to a function from `jaxtorch.from_exported` do not fit the program:
    another structure, a dtype or rank that differs, a static size that differs, a dynamic size
    outside the program's range (`torch.export.Dim(min=, max=)`), or a symbolic size that is not
    the function's own (`fn.input_specs`). The message names the input and what it should be."""


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


class CollectiveError(JaxtorchError):
    """A `torch.distributed` collective jaxtorch cannot run as a JAX collective.

    jaxtorch runs torch's collectives (`dist.all_reduce`, the functional collectives of
    `torch.distributed._functional_collectives`) as JAX collectives over mesh axes, inside
    `jax.shard_map` or `jax.pmap`. The message names what is missing or has no JAX form (no axis
    bound, an unknown axis, a group whose size is not the axis size, a reduce op or call JAX
    lacks, uneven all_to_all splits) and the way out.

    **Example:** `CollectiveError.no_axis("all_reduce")`.
    """

    @classmethod
    def no_axis(cls, what: str) -> CollectiveError:
        """The error for a collective run outside `jax.shard_map` / `jax.pmap` (eagerly, or under
        a plain `jax.jit`), where no mesh axis is bound."""
        return cls(
            f"`{what}` is a torch.distributed collective, which jaxtorch runs as a JAX collective over "
            "mesh axes, but no mesh axis is bound here (it ran eagerly, or under a plain jax.jit). Run the "
            "torch code inside `jax.shard_map(..., mesh=mesh, ...)` or `jax.pmap(..., axis_name=...)`, "
            "e.g. `jax.shard_map(lambda x: jaxtorch.call_torch(step, x), mesh=mesh, in_specs=P('data'), "
            "out_specs=P())`; or, for data parallelism without collectives, let GSPMD place the batch "
            "(`jaxtorch.train.shard_batch`, see docs/api/collectives.md)."
        )

    @classmethod
    def unknown_axis(cls, what: str, axes: tuple) -> CollectiveError:
        """The error for axes (from `jaxtorch.collectives_axis`) that the enclosing map does not bind."""
        return cls(
            f"`{what}` runs over the mesh axes {axes} (given to `jaxtorch.collectives_axis`), but the "
            "enclosing jax.shard_map / jax.pmap binds no axis of that name. Pass the name of an axis the "
            "shard_map maps over manually (one of its mesh's axis names, `axis_names=`), or the pmap's "
            "`axis_name`; or leave `jaxtorch.collectives_axis` out to use every axis the shard_map binds."
        )

    @classmethod
    def group_size(cls, what: str, group: str, size: int, axes: tuple, axis_size: int) -> CollectiveError:
        """The error for a process group whose size is not the size of the axes it runs over."""
        return cls(
            f"`{what}` runs over the process group `{group}` of {size} ranks, but its mesh axes {axes} hold "
            f"{axis_size} devices: each rank is one device along the axes, so the sizes must agree. Make the "
            f"group as large as the axes (`dist.init_process_group('jax', rank=0, world_size={axis_size}, "
            "store=dist.HashStore())`), or bind the group to axes of its size with "
            "`jaxtorch.collectives_axis(axis, group=group)`."
        )

    @classmethod
    def reduce_op(cls, what: str, op: str, why: str) -> CollectiveError:
        """The error for a reduce op with no JAX collective (`band`, `bor`, `bxor`, `premul_sum`)."""
        return cls(
            f"`{what}` asks for the reduce op `{op}`, which jaxtorch cannot run as a JAX collective ({why}). "
            "Use SUM, AVG, MAX, MIN or PRODUCT (`dist.ReduceOp.SUM`, or 'sum' in the functional API); "
            "for bitwise reductions gather the values (`dist.all_gather_into_tensor`) and reduce them "
            "with torch ops."
        )

    @classmethod
    def uneven_split(cls, what: str, rows: int, size: int, splits: object) -> CollectiveError:
        """The error for an all_to_all whose splits are not all equal (`lax.all_to_all` splits evenly)."""
        return cls(
            f"`{what}` was asked to split {rows} rows into the sizes {splits} over {size} ranks, but JAX's "
            "all_to_all exchanges equal blocks only. Pad the input so that every rank sends and receives "
            f"the same number of rows (a multiple of {size} rows, `input_split_sizes=None`), or exchange "
            "the sizes first and pad to the largest."
        )

    @classmethod
    def unsupported_call(cls, what: str, instead: str) -> CollectiveError:
        """The error for a call with no JAX SPMD form (`dist.reduce`, `gather`, `scatter`, `send`, `recv`)."""
        return cls(
            f"`{what}` has no SPMD form in jaxtorch: inside jax.shard_map every device runs the same "
            "program, so a collective whose result lives on one rank only (reduce, gather, scatter) or a "
            f"point-to-point message (send, recv) cannot be expressed as a JAX collective. {instead}"
        )


class ControlFlowError(JaxtorchError):
    """A `torch.cond` / `while_loop` / `scan` / `map` call jaxtorch cannot run as one `lax` op with
    torch's meaning: what torch refuses (an output aliasing an input, a write to an input, a carry
    changing shape or dtype, branches returning different things, an empty scan) and what one `lax`
    op cannot carry (a write to a tensor from outside the body). The message names the body and the way out.

    **Example:** `ControlFlowError("torch.cond's true_fn", "returns its input `x` itself", "return `x.clone()`")`.
    """

    def __init__(self, where: str, problem: str, fix: str):
        super().__init__(
            f"{where} {problem}: jaxtorch cannot run that as one control-flow op with torch's meaning. {fix}."
        )


class GradScalerError(JaxtorchError):
    """A `torch.amp.GradScaler` step jaxtorch cannot run with torch's meaning (a scale factor
    float32 cannot hold without 64-bit mode, an optimizer state a compiled skip cannot keep).
    The message names the problem and the way out."""

    @classmethod
    def inexact_factor(cls, name: str, value: float) -> GradScalerError:
        """The error for a growth/backoff factor that float32 does not hold exactly (64-bit mode off).

        **Example:** `GradScalerError.inexact_factor("growth_factor", 1.1)`.
        """
        return cls(
            f"GradScaler's {name} {value!r} is not a float32 value, and torch multiplies the float32 scale by it "
            "in float64 before rounding to float32; with JAX's 64-bit mode off that product cannot be formed, "
            "and a float32 product would drift from torch's scale. Use a factor float32 holds exactly (a power "
            "of two such as 2.0 or 0.5, or any `float(numpy.float32(f))`), or call "
            "`jax.config.update('jax_enable_x64', True)` before creating arrays."
        )

    @classmethod
    def not_program_state(cls) -> GradScalerError:
        """The error for a scaler used under a JAX trace that is not an argument of the compiled function."""
        return cls(
            "A torch.amp.GradScaler scales a traced loss (inside jaxtorch.jit / jaxtorch.compile, or another JAX "
            "trace), but the scaler is not an argument of the compiled function (it is a global, a closure "
            "variable or an attribute): its scale and growth tracker would be read and written once, when the "
            "function is traced, and the traced values would leak. Pass the scaler as an argument "
            "(`train_step(model, opt, scaler, x, y)`): its scale and growth tracker are then program state, "
            "read at every call and written back after it."
        )

    @classmethod
    def lazy_optimizer_state(cls, optimizer: str, keys: list[str]) -> GradScalerError:
        """The error for a compiled step whose optimizer creates state (or changes non-tensor state).

        **Example:** `GradScalerError.lazy_optimizer_state("Adam", ["exp_avg", "step"])`.
        """
        return cls(
            f"GradScaler.step({optimizer}) runs under a JAX trace (jaxtorch.jit / jaxtorch.compile), where "
            "whether the step is skipped (an inf/NaN gradient) is known only when the program runs, so the "
            "step is taken and then undone (`where(found_inf, before, after)`) on the parameters and the "
            f"optimizer state. But this step creates optimizer state ({', '.join(keys)}) or changes non-tensor "
            "state, which a skipped step would have left absent or unchanged, and which a compiled program cannot "
            "undo. Take the first steps eagerly (outside the compiled function) until `opt.state` holds tensor "
            "state for every parameter (the first step GradScaler did not skip), then call the compiled step."
        )


class TorchVersionError(JaxtorchError):
    """The installed torch no longer works the way a part of jaxtorch relies on (a function jaxtorch
    wraps was renamed, an autocast policy changed), so jaxtorch refuses instead of computing a wrong
    result. The message names what changed; the way out is a torch release jaxtorch supports
    (`torch>=2.13,<2.15`, see pyproject.toml) or a newer jaxtorch.

    **Example:** `raise TorchVersionError("torch 2.15's checkpoint calls none of ...")`.
    """

    def __init__(self, detail: str):
        from ..._compat import torch_version  # this module imports nothing heavy at load time

        super().__init__(
            f"{detail}. jaxtorch was checked on torch 2.13 and 2.14 (this is torch {torch_version()}): install "
            "one of those (`pip install 'torch>=2.13,<2.15'`) or a jaxtorch release that supports this torch."
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
