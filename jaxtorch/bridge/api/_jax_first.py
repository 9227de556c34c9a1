"""The JAX-first API: `call_torch`, `call_jax`, `extract`, `torch_module_to_jax`."""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import torch

from ..core._autodiff import stop_gradient
from ..core._errors import JaxtorchError, ModuleReleasedError
from ..core._matmul_precision import matmul_precision
from ..core._random import key_scope
from ..dispatch._environment import default_env
from ..dispatch._hooks import hook_parameter
from ..state import _mesh_axes as explicit
from ..state import _scopes as scopes
from ..state._binding import (
    ParamsError,
    Spec,
    aliases,
    as_found,
    bound,
    check_tree,
    modes_of,
    named_state,
    spec_of,
    split_state,
    training_modes,
)
from ..state._layouts import ConvLayout, conv_kernels, from_kernels, to_kernels
from ..state._meta import check_no_placeholders, with_computed_buffers
from ..tensor._convert import jax_view, module_tensor_to_jax, tensor_to_jax, torch_view, tree_map
from ..tensor._tensor import JaxTensor, labelled


def _concrete_shapes(tree: Any, what: str) -> Any:
    """`tree`, checked to hold arrays of concrete shapes: a symbolic dimension (`jax.export.symbolic_shape`)
    cannot become a torch size, which torch code reads as a Python int (`x.shape[0]`, `view(b, -1)`).

    >>> _concrete_shapes(jax.ShapeDtypeStruct((2, 3), jnp.float32), "f").shape
    (2, 3)
    """
    for leaf in jax.tree_util.tree_leaves(tree):
        shape = getattr(leaf, "shape", ())
        if not all(isinstance(d, (int, np.integer)) for d in shape):  # (jax.core.is_constant_dim: gone in JAX 0.11)
            raise JaxtorchError(
                f"{what} got an array of symbolic shape {tuple(str(d) for d in shape)} (jax.export.symbolic_shape): "
                "torch code needs concrete sizes. To export with a symbolic batch dimension use "
                "jaxtorch.export(model, x, batch_dim=True) (it vmaps the model over examples, so torch sees a "
                "batch of one), or jax.vmap your call over the batch before jax.export."
            )
    return tree


def call_torch(fn: Callable, *args: Any, rng: jax.Array | None = None, **kwargs: Any) -> Any:
    """Run the torch function `fn` on JAX values; return JAX values.

    Every `jax.Array` in `args`/`kwargs` (any nesting) is seen by `fn` as a torch tensor on
    the `jax` device; factories with no device (`torch.zeros(3)`) make JAX values; plain
    CPU tensors that `fn` closes over are converted. The result is a JAX pytree (tuples,
    dicts, dataclasses, `torch.return_types`, Hugging Face `ModelOutput` included), so this
    composes with `jax.jit`, `jax.grad` and `jax.vmap`.

    **Arguments:**
    - `fn`: any callable written with torch.
    - `args`, `kwargs`: its arguments, with `jax.Array`s where tensors go.
    - `rng`: a JAX PRNG key that random ops (dropout, `torch.rand`, ...) draw from.

    Arguments follow `jax.jit`'s rule, with and without it: JAX arrays, NumPy arrays
    (converted as `jnp.asarray` converts them), torch tensors (converted as `jaxtorch.to_jax`
    converts them: snapshots) and Python values. Modules `fn` is, is bound to, or gets
    as an argument are left exactly as found (a write to their CPU tensors raises).

    **Returns:** `fn`'s result with each tensor replaced by its `jax.Array`.

    **Example:**
        ```python
        def torch_fn(x, y):
            return torch.nn.functional.gelu(x @ y).sum(dim=-1)

        out = jax.jit(lambda a, b: jaxtorch.call_torch(torch_fn, a, b))(jnp.ones((2, 3)), jnp.ones((3, 4)))  # (2,)
        ```
    """
    targs, tkwargs = torch_view(
        _concrete_shapes(jax_inputs((args, kwargs), "jaxtorch.call_torch"), "jaxtorch.call_torch")
    )
    with as_found(_modules_of(fn, args, kwargs)), torch.enable_grad():  # (see `_run_torch`)
        return _run_torch(fn, targs, tkwargs, rng)


def _modules_of(fn: Callable[..., Any], args: Any, kwargs: Any) -> list[torch.nn.Module]:
    """The modules a `call_torch` call can reach directly: `fn`, its `__self__`, its arguments."""
    found = [fn, getattr(fn, "__self__", None), *args, *kwargs.values()]
    return [m for m in found if isinstance(m, torch.nn.Module)]


def _reject_tensor(where: str) -> Callable[[Any], Any]:
    def check(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and not isinstance(x, JaxTensor):
            return tensor_to_jax(x)  # a snapshot, as `jax.jit` converts it (`tensor._convert`)
        if isinstance(x, np.ndarray):
            return jnp.asarray(x)
        return x

    return check


def jax_inputs(tree: Any, where: str) -> Any:
    """`tree` with NumPy arrays and torch tensors as JAX arrays (what `jax.jit` does to them;
    tensors are read as snapshots, as `jaxtorch.to_jax` reads them).

    One rule for the JAX-first entry points (`call_torch`, `extract`'s `fn`, `TorchModule`),
    the same with and without `jax.jit`.
    """
    return tree_map(_reject_tensor(where), tree)


def _run_torch(
    fn: Callable, targs: Any, tkwargs: Any, rng: jax.Array | None, data: Any = None, dtypes: list | None = None
) -> Any:
    """Run `fn` on torch-side arguments inside the jax-by-default environment; JAX result.

    The JAX-first entry points (`call_torch`, `extract`'s `fn`) call it with torch's grad mode on,
    whatever the caller's, as `torch.func.grad` does: JAX's transformations decide what is
    differentiated; a `torch.no_grad()` inside the function is honoured (`core._autodiff`).

    Explicitly sharded arguments (and tensors of `fn`'s module) run with their mesh's axes Auto
    (`explicit.auto_axes`);
    `data` is the part of the arguments that is data, not parameters (default: all); `dtypes`,
    if given, receives the torch dtypes of the result's tensors, in order (an int64 result is
    an int32 array without x64)."""
    with (
        default_env(jax_by_default=True),
        key_scope(rng),
        matmul_precision(),
        explicit.auto_axes((fn, targs, tkwargs), data) as region,
    ):
        out = fn(*targs, **tkwargs)
    if dtypes is not None:
        tree_map(lambda x: dtypes.append(x.dtype) if isinstance(x, torch.Tensor) else None, out)
    return region.finish(jax_view(_jaxify_leftovers(out)))  # jax_view's walk registers new containers


def _jaxify_leftovers(tree: Any) -> Any:
    """Plain CPU tensors in a result (constants, a module's own tensor) become JAX arrays too:
    snapshots, so a later torch write to them does not reach the result."""
    return tree_map(
        lambda x: tensor_to_jax(x) if isinstance(x, torch.Tensor) and not isinstance(x, JaxTensor) else x, tree
    )


def extract(
    module: torch.nn.Module,
    *,
    train: bool | None = None,
    mutable: bool = False,
    conv_layout: ConvLayout = "torch",
) -> tuple[dict[str, jax.Array], ModuleFunction]:
    """Turn a `torch.nn.Module` into `(params, fn)`: its trainable parameters as JAX arrays
    and a pure JAX function.

    `params` holds the **trainable parameters** only: floating (or complex) dtype,
    `requires_grad=True`, by the name `named_parameters` gives; tied weights (GPT-2's
    `lm_head.weight` and `transformer.wte.weight`) are one entry, under the first name.
    Everything else is **state**, in `fn.state` (a dict name -> `jax.Array`): buffers
    (persistent or not: BatchNorm statistics, `num_batches_tracked`, rotary `inv_freq`),
    frozen parameters (`requires_grad=False`) and non-float parameters. So
    `jax.grad(loss)(params)` and any optax optimizer work on `params` unchanged, and never
    touch a buffer or a frozen weight (the rule: `jaxtorch.bridge.state._binding.split_state`).

    `fn(params, *args, state=None, rng=None, **kwargs)` runs the module's forward with those
    values and returns JAX values; it holds no hidden state, so `jax.jit`, `jax.grad` and
    `jax.vmap` apply. `state=None` uses `fn.state` (constants of a jitted program); pass
    `state=` explicitly to make it an input (new values, no recompilation). Random ops draw
    from `rng`. `params` (and `state=`) must have exactly the names given here, each an array
    of its shape; anything else (a buffer in params, a tied alias, a torch tensor, `None`)
    raises `ParamsError` naming the entry and the way out.

    **The mode is fixed here.** `train=None` (default) takes the mode each submodule has now
    (`module.training`, mixed modes kept); `train=True`/`False` asks for train/eval mode.
    `fn.training` tells which. `fn` runs the module in that mode whatever `train()`/`eval()`
    is called later (it sets the flags around each call and puts the module's own back), so a
    `jax.jit(fn)` compiled once can never run a stale mode: for the other mode, extract again
    (`extract(model, train=False)`); both functions share the module.

    `params` and `fn.state` never change afterwards, whatever torch does to the module (a
    train-mode forward updating BatchNorm statistics, an optimizer step,
    `load_state_dict`): on the CPU they share the module's memory, made copy-on-write, so
    the module's next in-place write copies the tensor it writes first and they keep the
    values they had (no copy until then; reads do not copy). `fn` leaves the module exactly
    as it found it. Its arguments follow `jax.jit`'s rule (see `call_torch`).

    With `mutable=True`, `fn` returns `(output, new_state)`: the whole state dict, the
    buffers the forward writes in place (BatchNorm running statistics, ...) updated, the
    rest the very arrays given. Thread it through: `out, state = fn(params, x, state=state)`.

    With `conv_layout="flax"`, each trainable convolution weight is given once transposed to
    the layout XLA's CPU convolutions read, `(*kernel, in, out)`, under Flax's name
    (`conv1.kernel` for `conv1.weight`), so the jitted program does not relayout every
    weight on every call (a ResNet-18 forward ~1.4x faster on the CPU); gradients come in
    the same layout, and `load_into` transposes back (see `bridge/layouts.py`). These
    arrays are copies, not views of the module's memory.

    **Arguments:**
    - `module`: the torch module.
    - `train`: None (default) keeps each submodule's mode; True / False asks for train / eval mode.
    - `mutable`: `fn` also returns the new state dict (`(output, new_state)`).
    - `conv_layout`: `"torch"` (default) or `"flax"` (convolution weights transposed, see above).

    **Returns:** `(params, fn)`: a dict name -> `jax.Array` of the trainable parameters and a `ModuleFunction`,
    `fn(params, *args, state=None, rng=None, **kwargs)`, with `fn.state` and `fn.training`.

    **Example:**
        ```python
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
        x = jnp.ones((2, 4))
        params, fn = jaxtorch.extract(model, train=False)
        y = jax.jit(fn)(params, x)                           # (2, 8); BatchNorm's statistics stay in fn.state
        grads = jax.grad(lambda p: fn(p, x).sum())(params)  # the same names as params

        params, fn = jaxtorch.extract(model, train=True, mutable=True)
        y, state = fn(params, x, state=fn.state)             # the updated running statistics
        jaxtorch.load_into(model, params, state)             # back into the torch module
        ```
    """
    params_t, state_t = split_state(module)
    kernels = {k: v for k, v in conv_kernels(module, conv_layout).items() if k in params_t}
    params = _snapshot(to_kernels(params_t, kernels))
    state = _snapshot(with_computed_buffers(module, state_t))  # meta device: non-persistent buffers computed
    fn = ModuleFunction(
        module, modes=modes_of(module, train), mutable=mutable, kernels=kernels, params=params, state=state
    )
    return params, fn


def _labelled(value: Any, dtype: torch.dtype | None) -> JaxTensor:
    """A module tensor's value as a tensor of its torch dtype (`tensor._tensor.labelled`)."""
    return JaxTensor(value) if dtype is None else labelled(value, dtype)


def _snapshot(tensors: dict[str, torch.Tensor]) -> dict[str, jax.Array]:
    """The module's tensors as JAX arrays (copy-on-write views on the CPU): the one
    conversion `extract` makes, for params and state alike."""
    return {name: module_tensor_to_jax(t) for name, t in tensors.items()}


def module_function(
    module: torch.nn.Module, *, train: bool | None = None, mutable: bool = False, conv_layout: ConvLayout = "torch"
) -> ModuleFunction:
    """`extract`'s function without its snapshot (no arrays made or kept): `fn.state` is
    None, so every call passes `state=` (what `make_train_step` does; it holds no reference
    to the module's weight memory)."""
    params_t, state_t = split_state(module)
    kernels = {k: v for k, v in conv_kernels(module, conv_layout).items() if k in params_t}
    return ModuleFunction(
        module,
        modes=modes_of(module, train),
        mutable=mutable,
        kernels=kernels,
        params=to_kernels(params_t, kernels),
        state=None,
        state_spec=spec_of(state_t),
    )


class ModuleFunction:
    """The pure function `extract` returns: `fn(params, *args, state=None, rng=None, **kwargs)`.

    Attributes: `training` (the mode it runs the module in, fixed when made), `state` (the
    snapshot used when `state=None`), `mutable` (whether it returns `(out, new_state)`),
    `module` (the torch module it runs).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        modes: tuple[tuple[torch.nn.Module, bool], ...],
        mutable: bool,
        kernels: dict,
        params: Mapping[str, Any],
        state: dict[str, jax.Array] | None,
        state_spec: Spec | None = None,
    ):
        self._module: torch.nn.Module | None = module  # None once `release_module` ran: then weakly held
        self._module_ref = weakref.ref(module)
        self.mutable = mutable
        self.training = modes[0][1]
        self.state = state
        self._held_modes: tuple[tuple[torch.nn.Module, bool], ...] | None = modes
        self._weak_modes = tuple((weakref.ref(m), flag) for m, flag in modes)
        self._kernels = kernels
        self._params_spec = spec_of(params)
        self._state_spec = spec_of(state) if state is not None else (state_spec or {})
        self._tied = aliases(module)
        self._renamed = {name: new for name, (new, _) in kernels.items()}
        self._lock = _module_lock(module)
        self._dtypes = {name: t.dtype for name, t in named_state(module).items()}
        scopes.name_modules(module)

    @property
    def module(self) -> torch.nn.Module:
        """The torch module this function runs (`ModuleReleasedError` if it was released and freed)."""
        module = self._module if self._module is not None else self._module_ref()
        if module is None:
            raise ModuleReleasedError(
                "jaxtorch: the torch module this function runs was freed: `make_train_step` keeps it only weakly "
                "after the first init() and the first traced step (so that `del model` frees its weights), and "
                "running the forward again (a retrace for new input shapes or dtypes, init() without params=) "
                "needs it. Keep a reference to the module (`model`) while the step may retrace, or pass "
                "init(params=..., model_state=...)."
            )
        return module

    @property
    def _modes(self) -> tuple[tuple[torch.nn.Module, bool], ...]:
        if self._held_modes is not None:
            return self._held_modes
        return tuple((m, flag) for ref, flag in self._weak_modes if (m := ref()) is not None)

    def release_module(self) -> None:
        """From now on hold the module (and its submodules) only by weak references: the function
        keeps working while someone else keeps the module alive, and raises `ModuleReleasedError`
        once it is freed. `make_train_step` calls this after tracing its step, so that the step
        holds no reference to the module's weight memory."""
        self._module = None
        self._held_modes = None

    def __repr__(self) -> str:
        module = self._module_ref()
        name = type(module).__name__ if module is not None else "a freed module"
        return (
            f"<jaxtorch function of {name}: {'train' if self.training else 'eval'} mode, "
            f"{len(self._params_spec)} params, {len(self._state_spec)} state entries"
            f"{', mutable' if self.mutable else ''}>"
        )

    def __call__(
        self, params: dict[str, jax.Array], *args: Any, state: Any = None, rng: jax.Array | None = None, **kwargs: Any
    ) -> Any:
        check_tree(
            params,
            self._params_spec,
            what="params",
            other=self._state_spec,
            other_what="`state=`",
            tied=self._tied,
            renamed=self._renamed,
        )
        if state is None:
            state = self.state
            if state is None:
                raise ParamsError(
                    "jaxtorch: this function keeps no state snapshot (made for `make_train_step`): pass `state=`"
                )
        else:
            check_tree(
                state, self._state_spec, what="state=", other=self._params_spec, other_what="params", tied=self._tied
            )
        check_no_placeholders(params, "params")  # (a meta-device model's, before its weights are loaded)
        check_no_placeholders(state, "state")
        params, state = jax_inputs((params, state), "the function from jaxtorch.extract")
        dtypes = self._dtypes  # (int64 tensors are held as int32 without x64: keep their torch dtype)
        values = {name: _labelled(v, dtypes.get(name)) for name, v in from_kernels(params, self._kernels).items()}
        module = self.module
        hooked = {n: p for n, p in module.named_parameters() if p._backward_hooks or p._post_accumulate_grad_hooks}
        for name, p in hooked.items():  # a parameter's own backward hooks see its cotangent (`dispatch._hooks`)
            if name in values:
                values[name] = hook_parameter(values[name], p)
        # state is what torch never differentiates (buffers, frozen parameters): not JAX either
        tstate = {name: _labelled(stop_gradient(v), dtypes.get(name)) for name, v in state.items()}
        targs, tkwargs = torch_view(
            _concrete_shapes(jax_inputs((args, kwargs), "the function from jaxtorch.extract"), "extract's function")
        )
        binding = bound(module, {**values, **tstate}, mutable=self.mutable)
        with self._lock, scopes.module_scopes(), training_modes(self._modes), binding, torch.enable_grad():
            out = _run_torch(module, targs, tkwargs, rng, data=(targs, tkwargs))
        if not self.mutable:
            return out
        return out, {name: t.elem for name, t in tstate.items()}


_locks: weakref.WeakKeyDictionary[torch.nn.Module, threading.RLock] = weakref.WeakKeyDictionary()
_locks_guard = threading.Lock()


def _module_lock(module: torch.nn.Module) -> threading.RLock:
    with _locks_guard:
        lock = _locks.get(module)
        if lock is None:
            lock = _locks[module] = threading.RLock()
        return lock


class _Frozen:
    """What a `TorchModule` holds outside its leaves: the state snapshot and the modes its
    torch module had, with the functions made from them. Hashed and compared by identity (an
    Equinox static field), so `eqx.apply_updates` copies keep it and `eqx.filter_jit` compiles
    once; its arrays are closed-over constants, which JAX passes to the compiled program as
    arguments (not embedded in it)."""

    def __init__(
        self, module: torch.nn.Module, modes: Any, kernels: dict, params: dict, state: dict[str, jax.Array]
    ) -> None:
        self.state = state
        self._args = (module, modes, kernels, spec_params(params))
        self._fns: dict[tuple[bool, bool], ModuleFunction] = {}

    def function(self, training: bool, mutable: bool) -> ModuleFunction:
        fn = self._fns.get((training, mutable))
        if fn is None:
            module, modes, kernels, params = self._args
            if modes[0][1] != training:
                modes = tuple((m, training) for m, _ in modes)
            fn = self._fns[(training, mutable)] = ModuleFunction(
                module, modes=modes, mutable=mutable, kernels=kernels, params=params, state=self.state
            )
        return fn


def spec_params(params: dict) -> dict:
    """Stand-ins with the arrays' shapes and dtypes (what `ModuleFunction` checks against)."""
    return {k: jax.ShapeDtypeStruct(tuple(v.shape), v.dtype) for k, v in params.items()}


class TorchModule(eqx.Module):
    """An Equinox module running a torch module: its trainable parameters are the JAX leaves.

    Made by `torch_module_to_jax`. Call it like the torch module, with JAX arrays. The
    leaves `eqx.filter_grad` differentiates and `eqx.apply_updates` changes are the
    trainable parameters only (`params`); the state (buffers, frozen parameters) is a
    snapshot outside the leaves (`.state`), never differentiated nor updated by an
    optimizer. `m(x, state=s)` runs with explicit state and returns `(out, new_state)`.

    The mode is the field `inference` (as in Equinox's `Dropout`/`BatchNorm`):
    `m.train()` / `m.eval()` return a module in the other mode, and
    `eqx.nn.inference_mode(m)` works. It is a Python bool, static under `eqx.filter_jit`;
    plain `jax.jit` would trace it: close over the module, or use `eqx.filter_jit`.

    **Arguments:**
    Made by `torch_module_to_jax(module, train=..., conv_layout=...)`, not built directly; its fields are
    `params` (the trainable parameters, the leaves), and, static, the mode, the torch module and its state.

    **Returns:** calling it, `m(*args, state=None, rng=None, **kwargs)`, returns the module's output as JAX values.

    **Example:**
        ```python
        m = jaxtorch.torch_module_to_jax(torch.nn.Linear(3, 2))
        assert isinstance(m, jaxtorch.TorchModule) and set(m.params) == {"weight", "bias"}
        y = m(jnp.ones((1, 3)))
        ```
    """

    params: dict[str, jax.Array]
    inference: bool
    module: torch.nn.Module = eqx.field(static=True)
    frozen: _Frozen = eqx.field(static=True)
    conv_layout: ConvLayout = eqx.field(static=True, default="torch")

    def __call__(
        self, *args: Any, state: dict[str, jax.Array] | None = None, rng: jax.Array | None = None, **kwargs: Any
    ) -> Any:
        if not isinstance(self.inference, (bool, np.bool_)):
            raise TypeError(
                "jaxtorch: TorchModule.inference is traced (the module went through jax.jit as an argument); the "
                "mode must be static: use `eqx.filter_jit`, or close over the module"
            )
        fn = self.frozen.function(not self.inference, state is not None)
        if state is None:
            return fn(self.params, *args, rng=rng, **kwargs)
        return fn(self.params, *args, state=state, rng=rng, **kwargs)

    @property
    def state(self) -> dict[str, jax.Array]:
        """The state snapshot (buffers, frozen parameters) used when `state=` is not given."""
        return self.frozen.state

    @property
    def training(self) -> bool:
        return not self.inference

    def train(self, mode: bool = True) -> TorchModule:
        """This module in train mode (`mode=False`: eval mode), as a new module; the arrays are shared."""
        return eqx.tree_at(lambda m: m.inference, self, not mode)

    def eval(self) -> TorchModule:
        """This module in eval mode, as a new module (`eqx.nn.inference_mode(m)` does the same)."""
        return self.train(False)

    def with_state(self, state: dict[str, jax.Array]) -> TorchModule:
        """A module whose state snapshot is `state` (e.g. what `m(x, state=s)` returned); a new
        snapshot, so `eqx.filter_jit` compiles once more for it."""
        check_tree(state, spec_of(self.frozen.state), what="state=")
        module, modes, kernels, params = self.frozen._args
        return dataclasses.replace(self, frozen=_Frozen(module, modes, kernels, params, dict(state)))

    def __repr__(self) -> str:
        n = sum(int(v.size) for v in jax.tree_util.tree_leaves(self.params))
        tree = "\n".join("  " + line for line in repr(self.module).splitlines())
        return (
            f"TorchModule({type(self.module).__name__}, {'eval' if self.inference else 'train'} mode, "
            f"{len(self.params)} params ({n:,} values), {len(self.state)} state entries,\n{tree}\n)"
        )


def torch_module_to_jax(
    module: torch.nn.Module, *, train: bool | None = None, conv_layout: ConvLayout = "torch"
) -> TorchModule:
    """Wrap a torch module as an `equinox.Module` whose leaves are its trainable parameters.

    The arrays are `extract`'s (params as leaves, state as a snapshot outside them): they
    never change afterwards, whatever torch does to the module, and calling the wrapper
    leaves the module as found. The mode is fixed here as in `extract` (`train=None`: the
    module's modes now) and kept in the field `inference`; flip it with `m.train()` /
    `m.eval()` / `eqx.nn.inference_mode(m)`. `conv_layout="flax"` keeps convolution weights
    in XLA's layout, as in `extract`.

    **Arguments:**
    - `module`: the torch module.
    - `train`, `conv_layout`: as for `extract`.

    **Returns:** a `TorchModule` (an `equinox.Module`): call it like the torch module, with JAX arrays.

    **Example:**
        ```python
        import equinox as eqx

        m = jaxtorch.torch_module_to_jax(torch.nn.Linear(3, 2))
        y = m(jnp.ones((4, 3)))                                               # (4, 2)
        grads = eqx.filter_grad(lambda m, x: m(x).sum())(m, jnp.ones((4, 3)))  # a TorchModule of gradients
        ```
    """
    params, fn = extract(module, train=train, conv_layout=conv_layout)
    frozen = _Frozen(module, fn._modes, fn._kernels, params, fn.state or {})
    return TorchModule(params=params, inference=not fn.training, module=module, frozen=frozen, conv_layout=conv_layout)
