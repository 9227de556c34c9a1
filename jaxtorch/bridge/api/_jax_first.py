"""The JAX-first API: `call_torch`, `call_jax`, `extract`, `torch_module_to_jax`."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import torch

from ..core._precision import matmul_precision
from ..core._random import key_scope
from ..dispatch._environment import default_env
from ..state import _mesh_axes as explicit
from ..state import _scopes as scopes
from ..state._binding import as_found, bound, named_state
from ..state._layouts import ConvLayout, conv_kernels, from_kernels, to_kernels
from ..tensor._convert import jax_view, tensor_to_jax, torch_view, tree_map
from ..tensor._tensor import JaxTensor, labelled


def call_torch(fn: Callable, *args, rng: jax.Array | None = None, **kwargs) -> Any:
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
    (converted as `jnp.asarray` converts them) and Python values; a torch tensor raises
    `TypeError` saying to pass `jaxtorch.to_jax(t)`. Modules `fn` is, is bound to, or gets
    as an argument are left exactly as found (a write to their CPU tensors raises).

    **Returns:** `fn`'s result with each tensor replaced by its `jax.Array`.

    **Example:**
        ```python
        y = jax.jit(lambda x: jaxtorch.call_torch(torch.nn.functional.gelu, x))(jnp.ones(3))
        ```
    """
    targs, tkwargs = torch_view(jax_inputs((args, kwargs), "jaxtorch.call_torch"))
    with as_found(_modules_of(fn, args, kwargs)):
        return _run_torch(fn, targs, tkwargs, rng)


def _modules_of(fn, args, kwargs) -> list[torch.nn.Module]:
    """The modules a `call_torch` call can reach directly: `fn`, its `__self__`, its arguments."""
    found = [fn, getattr(fn, "__self__", None), *args, *kwargs.values()]
    return [m for m in found if isinstance(m, torch.nn.Module)]


def _reject_tensor(where: str):
    def check(x):
        if isinstance(x, torch.Tensor) and not isinstance(x, JaxTensor):
            raise TypeError(
                f"{where} takes JAX arrays, as jax.jit does (which rejects torch tensors before jaxtorch "
                f"sees them); got a torch.Tensor on {x.device} ({x.dtype}, shape {tuple(x.shape)}). Pass "
                "`jaxtorch.to_jax(t)` (zero-copy on the CPU). NumPy arrays are fine: they are converted as "
                "jnp.asarray converts them."
            )
        if isinstance(x, np.ndarray):
            return jnp.asarray(x)
        return x

    return check


def jax_inputs(tree, where: str):
    """`tree` with NumPy arrays as JAX arrays (what `jax.jit` does to them); torch tensors raise.

    One rule for the JAX-first entry points (`call_torch`, `extract`'s `fn`, `TorchModule`),
    the same with and without `jax.jit`.
    """
    return tree_map(_reject_tensor(where), tree)


def _run_torch(fn: Callable, targs, tkwargs, rng, data=None, dtypes: list | None = None) -> Any:
    """Run `fn` on torch-side arguments inside the jax-by-default environment; JAX result.

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


def _jaxify_leftovers(tree):
    """Plain CPU tensors in a result (constants, a module's own tensor) become JAX arrays too:
    snapshots, so a later torch write to them does not reach the result."""
    return tree_map(
        lambda x: tensor_to_jax(x) if isinstance(x, torch.Tensor) and not isinstance(x, JaxTensor) else x, tree
    )


def extract(
    module: torch.nn.Module, *, mutable: bool = False, conv_layout: ConvLayout = "torch"
) -> tuple[dict[str, jax.Array], Callable]:
    """Turn a `torch.nn.Module` into `(params, fn)`: a dict of JAX arrays and a pure JAX function.

    `params` holds every parameter and buffer by the name `named_parameters` /
    `named_buffers` gives; tied weights (GPT-2's `lm_head.weight` and
    `transformer.wte.weight`) are one entry. `fn(params, *args, rng=None, **kwargs)` runs
    the module's forward with those values and returns JAX values; it holds no hidden
    state, so `jax.jit`, `jax.grad` and `jax.vmap` apply. The module's mode
    (`train()`/`eval()`) at call time is used; random ops draw from `rng`.

    `params` never change afterwards, whatever torch does to the module (a train-mode
    forward updating BatchNorm statistics, an optimizer step, `load_state_dict`): on the
    CPU they share the module's memory, made copy-on-write, so the module's next in-place
    write copies the tensor it writes first and `params` keep the values they had (no copy
    until then; reads do not copy). `fn` leaves the module exactly as it found it. Its
    arguments follow `jax.jit`'s rule (see `call_torch`).

    With `mutable=True`, `fn` returns `(output, new_params)`: buffers the forward writes
    in place (BatchNorm running statistics, ...) come back updated, the rest unchanged.

    With `conv_layout="flax"`, each convolution's weight is given once transposed to the
    layout XLA's CPU convolutions read, `(*kernel, in, out)`, under Flax's name
    (`conv1.kernel` for `conv1.weight`), so the jitted program does not relayout every
    weight on every call (a ResNet-18 forward ~1.4x faster on the CPU); gradients come in
    the same layout, and `load_into` transposes back (see `bridge/layouts.py`). These
    arrays are copies, not views of the module's memory.

    **Example:**
        ```python
        params, fn = jaxtorch.extract(model)
        logits = jax.jit(fn)(params, input_ids)
        grads = jax.grad(lambda p: fn(p, x).sum())(params)
        ```
    """
    kernels = conv_kernels(module, conv_layout)
    params = {name: tensor_to_jax(t) for name, t in to_kernels(named_state(module), kernels).items()}
    return params, _module_fn(module, mutable, kernels)


def _module_fn(module: torch.nn.Module, mutable: bool, kernels: dict | None = None) -> Callable:
    """The pure function of `extract`: runs `module` with the given params, leaves it as found.
    `kernels` (from `layouts.conv_kernels`) are the weights it takes in Flax's layout."""
    lock = _module_lock(module)
    scopes.name_modules(module)
    kernels = kernels or {}
    dtypes = {name: t.dtype for name, t in named_state(module).items()}  # (int64 buffers are held as int32)

    def fn(params: dict[str, jax.Array], *args, rng: jax.Array | None = None, **kwargs):
        tparams = {
            name: labelled(value, dtypes[name]) if name in dtypes else JaxTensor(value)
            for name, value in from_kernels(params, kernels).items()
        }
        targs, tkwargs = torch_view(jax_inputs((args, kwargs), "the function from jaxtorch.extract"))
        with lock, scopes.module_scopes(), bound(module, tparams):
            out = _run_torch(module, targs, tkwargs, rng, data=(targs, tkwargs))
        if not mutable:
            return out
        return out, to_kernels({name: t.elem for name, t in tparams.items()}, kernels)

    return fn


_locks: weakref.WeakKeyDictionary[torch.nn.Module, threading.RLock] = weakref.WeakKeyDictionary()
_locks_guard = threading.Lock()


def _module_lock(module: torch.nn.Module) -> threading.RLock:
    with _locks_guard:
        lock = _locks.get(module)
        if lock is None:
            lock = _locks[module] = threading.RLock()
        return lock


class TorchModule(eqx.Module):
    """An Equinox module running a torch module: its parameters are JAX leaves.

    Made by `torch_module_to_jax`. Call it like the torch module, with JAX arrays.
    """

    params: dict[str, jax.Array]
    module: torch.nn.Module = eqx.field(static=True)
    conv_layout: ConvLayout = eqx.field(static=True, default="torch")

    def __call__(self, *args, rng: jax.Array | None = None, **kwargs):
        return _fn_cache(self.module, self.conv_layout)(self.params, *args, rng=rng, **kwargs)

    def __repr__(self) -> str:
        n = sum(int(v.size) for v in jax.tree_util.tree_leaves(self.params))
        tree = "\n".join("  " + line for line in repr(self.module).splitlines())
        return f"TorchModule({type(self.module).__name__}, {len(self.params)} arrays, {n:,} values,\n{tree}\n)"


# one pure function per (module, layout), dropped with the module
_fns: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, Callable]] = weakref.WeakKeyDictionary()


def _fn_cache(module: torch.nn.Module, conv_layout: ConvLayout) -> Callable:
    with _locks_guard:
        per_layout = _fns.setdefault(module, {})
    fn = per_layout.get(conv_layout)
    if fn is None:
        fn = per_layout[conv_layout] = _module_fn(module, False, conv_kernels(module, conv_layout))
    return fn


def torch_module_to_jax(module: torch.nn.Module, *, conv_layout: ConvLayout = "torch") -> TorchModule:
    """Wrap a torch module as an `equinox.Module` whose parameters are JAX arrays.

    The arrays are `extract`'s: they never change afterwards, whatever torch does to the
    module, and calling the wrapper leaves the module as found. `conv_layout="flax"` keeps
    convolution weights in XLA's layout, as in `extract`.

    **Example:**
        ```python
        m = jaxtorch.torch_module_to_jax(torch_model)
        grads = eqx.filter_grad(lambda m, x: m(x).sum())(m, x)
        m = eqx.apply_updates(m, updates)
        ```
    """
    params, _ = extract(module, conv_layout=conv_layout)
    return TorchModule(params=params, module=module, conv_layout=conv_layout)
