"""Errors raised by jaxtorch. Each says what went wrong and what to do about it."""

from __future__ import annotations

import traceback
from pathlib import Path

import jax


class JaxtorchError(RuntimeError):
    """Base class of jaxtorch's errors.

    **Example:** every error jaxtorch raises is one; the message names the problem and the way out.
        ```python
        try:
            torch.ones(2, device="jax") + torch.ones(2)     # a CPU tensor mixed in
        except jaxtorch.JaxtorchError as err:               # any of jaxtorch's errors
            caught = err
        ```
    """


class UnsupportedOpError(JaxtorchError, NotImplementedError):
    """An ATen (or custom) op has no JAX lowering and no decomposition.

    **Example:**
        ```python
        @torch.library.custom_op("docs::halve", mutates_args=())
        def halve(x: torch.Tensor) -> torch.Tensor:
            return x / 2

        try:
            torch.ops.docs.halve(torch.ones(2, device="jax"))
        except jaxtorch.UnsupportedOpError as err:
            caught = err   # the way out: jaxtorch.register_op(torch.ops.docs.halve.default, lambda x: x / 2)
        ```
    """

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

    **Example:**
        ```python
        try:
            jax.jit(lambda a: jaxtorch.call_torch(torch.nonzero, a))(jnp.ones(3))
        except jaxtorch.DataDependentError as err:
            caught = err   # the way out: run that part eagerly, or give the size statically
        ```
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
    """A plain CPU tensor was mixed into a computation on the `jax` device.

    **Example:**
        ```python
        try:
            torch.ones(2, device="jax") + torch.ones(2)
        except jaxtorch.DeviceMismatchError as err:
            caught = err   # the way out: `t.to("jax")` for the CPU tensor
        ```
    """

    def __init__(self, op, other_device):
        name = getattr(op, "name", lambda: str(op))()
        super().__init__(
            f"Expected all tensors to be on the same device, but `{name}` got tensors on jax:0 and "
            f"{other_device}. Move the CPU tensor with `t.to('jax')`, create tensors in `forward` with "
            "`device=x.device`, or register it as a module buffer so `model.to('jax')` moves it; inside "
            "`jaxtorch.call_torch`/`extract` CPU tensors are converted automatically."
        )


class Float64Error(JaxtorchError, TypeError):
    """A float64/complex128 value met JAX with 64-bit mode off.

    **Example:**
        ```python
        try:
            torch.ones(2, dtype=torch.float64, device="jax")
        except jaxtorch.Float64Error as err:
            caught = err   # the way out: jax.config.update("jax_enable_x64", True) first, or float32
        ```
    """

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

    **Example:**
        ```python
        try:
            torch.tensor([2**40]).to("jax")
        except jaxtorch.Int64Error as err:
            caught = err   # the way out: JAX's 64-bit mode, or values that fit in 32 bits
        ```
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
    """A random op ran under tracing without a JAX PRNG key.

    **Example:**
        ```python
        try:
            jax.jit(lambda a: jaxtorch.call_torch(lambda t: t + torch.rand(3, device="jax"), a))(jnp.ones(3))
        except jaxtorch.MissingKeyError as err:
            caught = err   # the way out: pass `rng=jax.random.key(0)` to call_torch (or extract's fn)
        ```
    """

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
    """A random op was given a torch `generator=` under jax tracing.

    **Example:**
        ```python
        g = torch.Generator().manual_seed(0)
        noisy = lambda t: t + torch.rand(3, generator=g, device="jax")
        try:
            jax.jit(lambda a: jaxtorch.call_torch(noisy, a))(jnp.ones(3))
        except jaxtorch.GeneratorUnderTraceError as err:
            caught = err   # the way out: drop `generator=` and pass `rng=` (a JAX key)
        ```
    """

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
    such functions hold it only weakly once traced, so that `del model` frees its weights.

    **Example:**
        ```python
        import optax

        model = torch.nn.Linear(3, 1)
        init, step = jaxtorch.train.make_train_step(model, lambda out, y: jnp.mean((out - y) ** 2), optax.sgd(0.1))
        state, loss = step(init(), jnp.ones((4, 3)), jnp.ones((4, 1)))
        del model                                                  # only the step held it, weakly
        try:
            step(state, jnp.ones((8, 3)), jnp.ones((8, 1)))       # a new shape needs the module again
        except jaxtorch.train.ModuleReleasedError as err:
            caught = err   # the way out: keep the module alive while the step is used
        ```
    """


class OnceDifferentiableError(JaxtorchError):
    """A `torch.autograd.Function` whose backward is `@once_differentiable` was differentiated twice
    under a JAX transformation (`jax.hessian`, grad of grad), which torch refuses too.

    **Example:**
        ```python
        class Cube(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                ctx.save_for_backward(x)
                return x**3

            @staticmethod
            @torch.autograd.function.once_differentiable
            def backward(ctx, g):
                (x,) = ctx.saved_tensors
                return 3 * x**2 * g

        try:
            jax.hessian(lambda a: jaxtorch.call_torch(lambda t: Cube.apply(t).sum(), a))(jnp.ones(2))
        except jaxtorch.OnceDifferentiableError as err:
            caught = err   # the way out: a backward torch can differentiate (no @once_differentiable)
        ```
    """


class HookUnderTraceError(JaxtorchError):
    """A backward hook jaxtorch cannot honour under a JAX transformation (it names the hook and the way out).

    **Example:**
        ```python
        def f(x):
            v = x[0]                        # a view
            v.register_hook(lambda g: g * 2)
            return (v * v).sum()

        try:
            jax.grad(lambda a: jaxtorch.call_torch(f, a))(jnp.ones((2, 2)))
        except jaxtorch.HookUnderTraceError as err:
            caught = err   # the way out: register the hook on `x[0].clone()` or on `x`
        ```
    """


class ExportedProgramError(JaxtorchError):
    """A `torch.export.ExportedProgram` that `jaxtorch.from_exported` cannot turn into a pure JAX
    function: it writes its buffers (without `mutable=True`), its parameters or its inputs, has
    data-dependent sizes, side-effect tokens, custom objects, or higher-order ops (`torch.cond`,
    `torch.map`, ...) left in its graph. The message names what was found and the way out.

    **Example:**
        ```python
        ep = torch.export.export(torch.nn.BatchNorm1d(3).train(), (torch.ones(4, 3),))
        try:
            jaxtorch.from_exported(ep)       # train mode writes the running statistics
        except jaxtorch.ExportedProgramError as err:
            caught = err   # the way out: from_exported(ep, mutable=True), or export in eval mode
        ```
    """


class ExportedInputError(JaxtorchError, ValueError):
    """The arguments given to a function from `jaxtorch.from_exported` do not fit the program:
    another structure, a dtype or rank that differs, a static size that differs, a dynamic size
    outside the program's range (`torch.export.Dim(min=, max=)`), or a symbolic size that is not
    the function's own (`fn.input_specs`). The message names the input and what it should be.

    **Example:**
        ```python
        params, fn = jaxtorch.from_exported(torch.export.export(torch.nn.Linear(3, 2), (torch.ones(1, 3),)))
        try:
            fn(params, jnp.ones((1, 4)))     # exported with 3 features
        except jaxtorch.ExportedInputError as err:
            caught = err   # the way out: the input the program was exported for (see fn.input_specs)
        ```
    """


class StateWriteError(JaxtorchError):
    """A write jaxtorch cannot carry out, raised instead of losing it.

    A compiled function (`jaxtorch.jit`/`compile`) wrote into a tensor that is not program
    state: one reached only through a closure or a global, or a traced value stored on a module
    attribute that is not a parameter or buffer; or torch code run as a pure JAX function
    (`call_torch`, `extract`'s `fn`) wrote to a CPU tensor (`cpu_write`, `torch_state_write`), or a
    non-mutable `extract` function's forward wrote a module buffer (`read_only_write`). The
    message names the tensor and the way out.

    **Example:**
        ```python
        counter = torch.zeros(1)

        def f(x):
            counter.add_(1)                  # a write to a CPU tensor from pure JAX code
            return x * 2

        try:
            jaxtorch.call_torch(f, jnp.ones(2))
        except jaxtorch.StateWriteError as err:
            caught = err   # the way out: return the new value instead of writing it
        ```
    """

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

    **Example:**
        ```python
        import torch.distributed._functional_collectives as funcol

        try:
            jaxtorch.call_torch(lambda t: funcol.all_reduce(t, "sum", "world"), jnp.ones(2))  # no jax.shard_map here
        except jaxtorch.CollectiveError as err:
            caught = err   # the way out: call it inside jax.shard_map (or jax.pmap) over the mesh axis
        ```
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

    **Example:**
        ```python
        def f(x):
            return torch.cond(x.sum() > 0, lambda a: a.add_(1), lambda a: a.clone(), (x,))

        try:
            jaxtorch.call_torch(f, jnp.ones(2))
        except jaxtorch.ControlFlowError as err:
            caught = err   # the way out: write to a `.clone()` and return it
        ```
    """

    def __init__(self, where: str, problem: str, fix: str):
        super().__init__(
            f"{where} {problem}: jaxtorch cannot run that as one control-flow op with torch's meaning. {fix}."
        )


class GradScalerError(JaxtorchError):
    """A `torch.amp.GradScaler` step jaxtorch cannot run with torch's meaning (a scale factor
    float32 cannot hold without 64-bit mode, an optimizer state a compiled skip cannot keep).
    The message names the problem and the way out.

    **Example:**
        ```python
        model = torch.nn.Linear(2, 1).to("jax")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("jax", growth_factor=1.1, growth_interval=1)   # 1.1 is no float32
        scaler.scale(model(torch.ones(1, 2, device="jax")).sum()).backward()
        scaler.step(opt)
        try:
            scaler.update()
        except jaxtorch.GradScalerError as err:
            caught = err   # the way out: a factor float32 holds (2.0), or JAX's 64-bit mode
        ```
    """

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

    **Example:** raised by jaxtorch's checks of the installed torch (it cannot be provoked on a supported one):
        ```python
        try:
            raise jaxtorch.TorchVersionError("torch's checkpoint calls none of the functions jaxtorch wraps")
        except jaxtorch.TorchVersionError as err:
            caught = err   # the way out: a supported torch (`torch>=2.13,<2.15`) or a newer jaxtorch
        ```
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
        model = torch.nn.Linear(2, 2, device="meta")
        try:
            model.to("jax")
        except jaxtorch.MetaTensorError as err:
            caught = err   # the way out: model.to_empty(device="jax"), then load its weights
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


# ---- moved here from the modules that raise them (one module holds every error) ---------------
class ParamsError(JaxtorchError, ValueError):
    """The `params` (or `state`) given to a function from `jaxtorch.extract` (or to `load_into`)
    do not fit the module: a name missing, extra, tied to another, in the wrong dict, or a value
    that is not an array of the right shape. The message names each entry and the way out.

    **Example:**
        ```python
        params, fn = jaxtorch.extract(torch.nn.Linear(2, 2))
        try:
            fn({"weight": params["weight"]}, jnp.ones(2))      # "bias" missing
        except jaxtorch.ParamsError as err:
            caught = err   # the way out: exactly the names extract gave
        ```
    """


class MetaBufferError(JaxtorchError):
    """A non-persistent buffer on the meta device whose value jaxtorch cannot compute."""


class DonatedStateError(JaxtorchError):
    """A `TrainState` (or arrays of one) that an earlier step consumed: `make_train_step` donates
    the state it is given by default, so its memory now holds the next state.

    **Example:**
        ```python
        import optax

        model = torch.nn.Linear(3, 1)
        init, step = jaxtorch.train.make_train_step(model, lambda out, y: jnp.mean((out - y) ** 2), optax.sgd(0.1))
        state = init()
        new_state, loss = step(state, jnp.ones((4, 3)), jnp.ones((4, 1)))
        try:
            step(state, jnp.ones((4, 3)), jnp.ones((4, 1)))      # `state` was donated to the first step
        except jaxtorch.train.DonatedStateError as err:
            caught = err   # the way out: pass the state the last step returned (or donate=False)
        ```
    """


class CheckpointError(JaxtorchError, ValueError):
    """A checkpoint file that cannot be read (missing, truncated, corrupted, not a checkpoint).

    **Example:**
        ```python
        import os, tempfile

        try:
            jaxtorch.load_checkpoint(os.path.join(tempfile.mkdtemp(), "missing.ckpt"))
        except jaxtorch.train.CheckpointError as err:
            caught = err   # the way out: the path of a file `save_checkpoint` wrote
        ```
    """


class CheckpointKeysError(CheckpointError, KeyError):
    """A checkpoint whose names or shapes do not match the model: every problem in one error.

    Attributes: `missing` (model names the file lacks), `unexpected` (file names the model
    lacks), `mismatched` (`{name: (file shape, model shape)}`).

    **Example:**
        ```python
        import os, tempfile
        from safetensors.torch import save_file

        path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
        save_file({"weight": torch.ones(1, 3)}, path)                 # no "bias"
        try:
            jaxtorch.load_params(torch.nn.Linear(3, 1), path)
        except jaxtorch.train.CheckpointKeysError as err:
            caught = err   # err.missing == ["bias"]; or load_params(..., strict=False)
        ```
    """

    def __init__(
        self,
        path: str,
        missing: list[str],
        unexpected: list[str],
        mismatched: dict[str, tuple],
        *,
        on_meta: bool = False,
    ):
        self.missing, self.unexpected, self.mismatched = missing, unexpected, mismatched
        parts = []
        if missing and on_meta:
            parts.append(
                f"{len(missing)} missing from the file, on the meta device in the model, so no value to keep "
                f"for them: {missing} (build the model off the meta device to keep its initial values for them, "
                "as `from_pretrained` initializes them)"
            )
        elif missing:
            parts.append(f"{len(missing)} missing from the file: {missing}")
        if unexpected:
            parts.append(f"{len(unexpected)} in the file but not in the model: {unexpected}")
        if mismatched:
            parts.append(
                f"{len(mismatched)} with another shape (file vs model): "
                + ", ".join(f"{k} {tuple(a)} vs {tuple(b)}" for k, a, b in ((k, *v) for k, v in mismatched.items()))
            )
        super().__init__(
            f"load_params({path!r}): the checkpoint does not match the model: "
            + "; ".join(parts)
            + ". Check that the checkpoint was saved from this architecture and config; names are mapped as "
            "`load_state_dict` / `from_pretrained` map them (tied weights, `base_model_prefix`, Hugging Face renames)"
            + (
                "; strict=False skips unused names and keeps the module's values for missing ones."
                if (missing or unexpected) and not on_meta
                else "."
            )
        )

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class TracedSizesError(jax.errors.ConcretizationTypeError, JaxtorchError):
    """Lengths / batch sizes of a packed sequence are traced (`ops/rnn.py`). A `ConcretizationTypeError`
    (its `__init__`, JAX's): an eager call then runs unjitted, and under `jax.jit` the interpreter
    raises `DataDependentError` with this message."""

    def __str__(self) -> str:
        return (
            "the lengths / batch sizes of a PackedSequence are traced here; torch keeps them on the CPU: "
            "pack with lengths given as a CPU tensor or a constant, not as an input of the jitted function"
        )


class ProbeStop(JaxtorchError):
    """Raised by `dispatch/_autocast.py`'s probe tensor at the first op that reaches it, with
    `(op, args, kwargs)`: how torch's autocast policy is read; caught there, never seen by users."""
