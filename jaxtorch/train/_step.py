"""`make_train_step`: a jitted optax training step for a torch module, as `(init, step)`.

The model runs through `extract(model, mutable=True)`'s function, so the step is a pure JAX
function of an explicit `TrainState`: trained parameters, the model's state (buffers, frozen
parameters) and the optax state in, their updates out (BatchNorm statistics through the
forward only). The state passed in is donated by default (its memory is reused).

Example:
    ```python
    def loss_fn(logits, labels):
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    init, step = jaxtorch.train.make_train_step(model, loss_fn, optax.adamw(1e-3))
    state = init()
    for i, (x, y) in enumerate(batches):
        state, loss = step(state, x, y, jax.random.fold_in(key, i))
    jaxtorch.load_into(model, state)
    ```
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
from jax.sharding import NamedSharding, PartitionSpec

from .._compat import Tracer
from ..bridge.api._jax_first import module_function
from ..bridge.core import _checks
from ..bridge.state._binding import split_state
from ..bridge.state._layouts import ConvLayout, to_kernels
from ..bridge.tensor._convert import tensor_to_jax, to_jax, tree_map
from ._mixed_precision import MixedPrecision, resolve
from ._state import Trainable, TrainState, check_not_donated, select

Remat = None | bool | str | Callable


def remat_policy(remat: Remat) -> Callable[..., Any] | None:
    """`jax.checkpoint` policy for `remat`: True/"full" saves nothing; a name from
    `jax.checkpoint_policies` ("dots_saveable", "nothing_saveable", ...) or a policy callable."""
    if remat is True or remat == "full":
        return jax.checkpoint_policies.nothing_saveable
    if isinstance(remat, str):
        policy = getattr(jax.checkpoint_policies, remat, None)
        if policy is None or remat.startswith("_"):
            raise ValueError(f"remat: unknown policy {remat!r}; see jax.checkpoint_policies")
        return policy
    if callable(remat):
        return remat
    raise ValueError(f"remat: expected None, True, a policy name or callable, got {remat!r}")


def _common_sharding(params: dict) -> Any:
    """A replicated sharding over the devices the params live on (for scalars of the state)."""
    for v in params.values():
        sharding = getattr(v, "sharding", None)
        if isinstance(sharding, jax.sharding.NamedSharding):
            return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
        if sharding is not None:
            return next(iter(sharding.device_set))
    return jax.local_devices()[0]


def _place_like(opt_state: Any, train: dict) -> Any:
    """Commit each optimizer-state leaf to its parameter's sharding (Adam's `mu["fc.weight"]` like
    `fc.weight`), others (counts) replicated: every later step then sees the same placements."""
    replicated = _common_sharding(train)

    def place(path: Any, leaf: Any) -> Any:
        for k in reversed(path):
            if isinstance(k, jax.tree_util.DictKey) and k.key in train and train[k.key].shape == leaf.shape:
                return jax.device_put(leaf, train[k.key].sharding)
        return jax.device_put(leaf, replicated)

    return jax.tree_util.tree_map_with_path(place, opt_state)


def _as_call(inputs: Any) -> tuple[tuple, dict]:
    """`inputs` as positional/keyword arguments: a tuple is unpacked, a dict (any mapping, such as
    Hugging Face's `BatchEncoding`) is keywords."""
    if isinstance(inputs, tuple) and not hasattr(type(inputs), "_fields"):
        return inputs, {}
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    return (inputs,), {}


def _check_selection(mask: dict[str, bool], trainable: Trainable, model: torch.nn.Module) -> None:
    """Raise `ValueError` when `trainable` selects no parameter, or one of its globs matches none (a
    typo trains nothing, silently; torch's optimizers refuse an empty parameter list), naming the
    parameters there are.

    **Example:** `_check_selection({"fc.weight": False}, "head.*", model)` raises, naming `fc.weight`.
    """
    globs = [trainable] if isinstance(trainable, str) else [] if trainable is None or callable(trainable) else trainable
    unmatched = [g for g in globs if not any(fnmatch.fnmatchcase(n, g) for n in mask)]
    if any(mask.values()) and not unmatched:
        return
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    names = list(mask)
    shown = ", ".join(names[:12]) + (f", ... ({len(names)} in all)" if len(names) > 12 else "")
    what = f"the globs {unmatched} match" if unmatched else f"trainable={trainable!r} selects"
    raise ValueError(
        f"make_train_step: {what} no trainable parameter, so nothing would be trained (torch's optimizers "
        f"refuse an empty parameter list). The trainable parameters are: {shown or 'none'}"
        + (f"; frozen (requires_grad=False, never trained): {frozen[:12]}" if frozen else "")
        + ". Fix the pattern (globs match whole names: 'fc.*', '*.bias'), or set requires_grad=True."
    )


@dataclasses.dataclass(frozen=True, eq=False)
class _Static:
    """A non-array input (a Python scalar, bool, string) carried as part of the step's static
    signature: the model sees the Python value, as in torch, and a new value retraces. Compared by
    type and value (`1`, `1.0` and `True` are three programs; floats by `repr`: `-0.0`, `nan`)."""

    value: Any

    def _key(self) -> tuple:
        v = self.value
        return (type(v), repr(v) if isinstance(v, float) else v)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Static) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


jax.tree_util.register_static(_Static)


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def wrap_static(tree: Any) -> Any:
    """`tree` with each non-array leaf wrapped as static (see `_Static`); arrays stay program inputs.

    **Example:** `wrap_static({"x": x, "use_cache": False})` -> `{"x": x, "use_cache": _Static(False)}`.
    """

    def wrap(x: Any) -> Any:
        if _is_array(x):
            return x
        try:
            hash(_Static(x))
        except TypeError:
            raise TypeError(
                f"step: the input {x!r} ({type(x).__name__}) is neither an array nor hashable, so it can be "
                "neither a program input nor a static value; pass arrays, tensors or Python scalars"
            ) from None
        return _Static(x)

    return jax.tree_util.tree_map(wrap, tree)


def unwrap_static(tree: Any) -> Any:
    """The inverse of `wrap_static`: static leaves back to their Python values."""
    return jax.tree_util.tree_map(
        lambda x: x.value if isinstance(x, _Static) else x, tree, is_leaf=lambda x: isinstance(x, _Static)
    )


def micro_batches(tree: Any, accumulate: int) -> tuple[list, Callable[[list], Any]]:
    """Split the batch arrays of `(inputs, targets)` into `accumulate` micro-batches.

    The rule: every array with a leading dimension is a batch array, split along axis 0; all of
    them must share that size (the batch size), which `accumulate` must divide. Everything else
    (Python scalars and bools such as `use_cache=False`, None, 0-d arrays) goes unchanged to every
    micro-step. An array of another leading size is ambiguous (a batch of another size, or a
    constant such as a table?): refused, naming it.

    **Returns:** `(parts, rebuild)`: the split arrays, each `(accumulate, batch // accumulate, ...)`,
    and `rebuild(slices) -> (inputs, targets)` for one micro-step's slices.

    **Example:**
        ```python
        parts, rebuild = micro_batches(({"x": x, "use_cache": False}, y), 2)   # x, y: 8 rows
        inputs, targets = rebuild([p[0] for p in parts])                       # the first 4 rows
        ```
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves = [x for _, x in flat]
    batch = [i for i, x in enumerate(leaves) if _is_array(x) and np.ndim(x) >= 1]
    sizes = sorted({leaves[i].shape[0] for i in batch})

    def name(i: int) -> str:
        path = flat[i][0]
        return ("inputs" if path[0].idx == 0 else "targets") + jax.tree_util.keystr(path[1:])

    if not batch:
        raise ValueError(f"accumulate={accumulate}: the inputs and targets hold no array with a batch dimension")
    if len(sizes) > 1:
        shapes = ", ".join(f"{name(i)}: {tuple(leaves[i].shape)}" for i in batch)
        raise ValueError(
            f"accumulate={accumulate} splits every input and target array along its first dimension, the batch, "
            f"but their first dimensions differ ({shapes}). Give batch arrays of one batch size; hold constants "
            "(tables, masks shared by every row) in the module (a buffer) or pass them as Python values"
        )
    if sizes[0] % accumulate:
        raise ValueError(f"accumulate={accumulate} does not divide the batch size {sizes[0]}")
    parts = [leaves[i].reshape(accumulate, sizes[0] // accumulate, *leaves[i].shape[1:]) for i in batch]

    def rebuild(slices: list) -> Any:
        out = list(leaves)
        for i, part in zip(batch, slices):
            out[i] = part
        return jax.tree_util.tree_unflatten(treedef, out)

    return parts, rebuild


def _concrete(x: Any) -> bool:
    """Whether `x` is a `jax.Array` with a buffer (not a tracer: the step may run under a user's jit)."""
    return isinstance(x, jax.Array) and not isinstance(x, Tracer)


def _deleted(x: Any) -> bool:
    return _concrete(x) and x.is_deleted()


def place_state(state: TrainState, batch: Any) -> TrainState:
    """`state` placed where `batch` is, when a `DeviceLoader`/`shard_batch` batch spans a mesh.

    A state on one device (`init()`'s) is replicated over the batch's mesh (data parallelism: the
    same math). A state spread over other devices than the batch's is refused, naming
    `shard(state, mesh)`. Anything else is returned as it is (JAX places uncommitted batches).

    **Example:** `state = place_state(init(), shard_batch((x, y), mesh))` -> replicated on `mesh`.
    """
    mesh = next(
        (
            x.sharding.mesh
            for x in jax.tree_util.tree_leaves(batch)
            if _concrete(x) and isinstance(x.sharding, NamedSharding) and x.sharding.mesh.size > 1
        ),
        None,
    )
    if mesh is None or not _concrete(state.step) or _deleted(state.step):
        return state
    devices = state.step.sharding.device_set
    if devices == set(mesh.devices.flat):
        return state
    check_not_donated(state, "step")
    leaves = [x for x in jax.tree_util.tree_leaves(state) if isinstance(x, jax.Array)]  # (concrete: step is)
    local = all(d.process_index == jax.process_index() for d in mesh.devices.flat)  # (else: shard() assembles)
    if local and all(len(x.sharding.device_set) == 1 for x in leaves):
        return jax.device_put(state, NamedSharding(mesh, PartitionSpec()))
    raise ValueError(
        f"step: the state lives on {len(devices)} devices and the batch on a mesh of {mesh.size} others "
        f"({dict(mesh.shape)}); place the state on the batch's mesh first: "
        "`state = jaxtorch.train.shard(state, mesh, rules)` (the mesh your DeviceLoader/shard_batch uses)"
    )


def _torch_to_jax(tree: Any) -> Any:
    return tree_map(lambda x: to_jax(x) if isinstance(x, torch.Tensor) else x, tree)


def make_train_step(
    model: torch.nn.Module,
    loss_fn: Callable[[Any, Any], jax.Array],
    optimizer: optax.GradientTransformation,
    *,
    trainable: Trainable = None,
    accumulate: int = 1,
    remat: Remat = None,
    mixed_precision: None | str | MixedPrecision = None,
    jit: bool = True,
    donate: bool = True,
    train: bool | None = None,
    conv_layout: ConvLayout = "torch",
) -> tuple[Callable[..., TrainState], Callable[..., tuple[TrainState, jax.Array]]]:
    """Build `(init, step)` to train `model` with `loss_fn` and an optax optimizer.

    **Arguments:**
    - `model`: a torch module. Its trainable parameters (float, `requires_grad=True`: see
      `extract`) are trained; frozen parameters and buffers are never trained.
    - `loss_fn`: `loss_fn(outputs, targets) -> scalar`, written in JAX.
    - `optimizer`: any `optax.GradientTransformation`.
    - `trainable`: globs, a list of globs or a predicate `(name, array) -> bool`
      selecting the trained parameters among the trainable ones; the rest go to
      `TrainState.model_state` with the buffers and frozen parameters. Everything there stays
      bit-identical, except buffers the forward writes (BatchNorm statistics). A selection of
      no parameter, or a glob matching none, raises `ValueError` naming the parameters (torch's
      optimizers refuse an empty parameter list).
    - `accumulate`: split each batch into this many micro-batches along axis 0, run them
      one after another (buffers threaded through) and apply the averaged gradient once:
      torch's `(loss / accumulate).backward()` per micro-batch, then one `opt.step()`; the
      loss returned is the micro-batch losses' mean. Every input or target array with a leading
      dimension is a batch array and is split; they must share that size. Python values
      (`use_cache=False`, a scalar), None and 0-d arrays go unchanged to every micro-step.
    - `remat`: rematerialize the forward in the backward (`jax.checkpoint`) with this
      policy: True/"full", a `jax.checkpoint_policies` name, or a policy.
    - `mixed_precision`: None, "bf16"/"fp16" or a `MixedPrecision`: compute in low
      precision with float32 master weights (loss scaling off unless set).
    - `jit`: compile `step` with `jax.jit` (default).
    - `donate`: (default True) donate the state passed to `step` to the new one: its
      arrays' memory is reused (an AdamW step needs ~3.6x the weights, not ~6.9x), so the
      state passed in cannot be used again (`state, loss = step(state, ...)` is the idiom;
      passing it to `step` or `load_into` again raises `DonatedStateError`). Arrays given to
      `init(params=...)` become the state's and are donated with it. Pass `donate=False` to
      keep old states usable (e.g. to compare two steps), or copy one state to keep
      (`jax.tree_util.tree_map(jnp.copy, state)`).
    - `train`: the mode the model runs in, fixed here as in `extract` (None: each
      submodule's mode now, usually `model.train()`).
    - `conv_layout`: "flax" keeps convolution weights (and their gradients and optimizer
      state) in the layout XLA's CPU convolutions read, as `<module>.kernel`, as in
      `extract`; `load_into` takes them back.

    **The module's weights are not kept.** `init()` copies the module's values when it is
    called, and only the `TrainState` holds them from then on. `init` and `step` hold the
    module itself until they have used it (the first `init()`, the first traced step), then
    only weakly: `del model` after those frees the torch weights (AdamW's peak is then the
    state's 3x plus the step's temporaries; a script that keeps the module pays its 1x on
    top). A retrace (new input shapes or dtypes) or `init()` without `params=` after the
    module is freed raises `ModuleReleasedError` (a `ReferenceError`): keep the module while
    the step may retrace. With `jit=False` every step runs the module, so it is kept.

    **Returns:** `(init, step)`:
    - `init(params=None, model_state=None) -> TrainState`: copies of the model's current
      values, or the given `params` (`extract`-style: every trainable parameter, e.g.
      sharded by `shard`) and `model_state` (`fn.state`-style), with a fresh optimizer state.
    - `step(state, inputs, targets, rng=None) -> (state, loss)`: one update. `inputs` is
      one array, a tuple of positional arguments or a dict of keyword arguments;
      `rng` is the JAX key that dropout and other random ops draw from. Arrays and tensors
      are the program's inputs; other values (Python scalars and bools such as HF's
      `use_cache=False`, strings) reach the model as the Python values they are, as in torch,
      and a new value compiles a new program (pass a 0-d array for a value that changes every
      step). A state on one device (`init()`'s) given a batch spread over a mesh
      (`DeviceLoader`, `shard_batch`) is replicated onto that mesh; a state on other devices
      raises, naming `shard(state, mesh)`. Under `jaxtorch.checks()` the step runs checked
      and does not donate: a failed check raises torch's error (an out-of-range target's
      `IndexError`) and the state given stays usable.

    **Example:**
        ```python
        import optax

        model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        init, step = jaxtorch.train.make_train_step(model, lambda out, y: jnp.mean((out - y) ** 2), optax.adam(1e-2))
        state = init()
        for _ in range(3):
            state, loss = step(state, jnp.ones((4, 3)), jnp.zeros((4, 1)))
        jaxtorch.load_into(model, state)                # the trained weights, back in the torch module
        ```
    """
    if accumulate < 1:
        raise ValueError(f"accumulate must be >= 1, got {accumulate}")
    fn = module_function(model, train=train, mutable=True, conv_layout=conv_layout)
    shapes = {k: jax.ShapeDtypeStruct(shape, _jax_dtype(dtype)) for k, (shape, dtype) in fn._params_spec.items()}
    if trainable is not None and not isinstance(trainable, str) and not callable(trainable):
        trainable = list(trainable)  # (read twice: a generator would be empty the second time)
    mask = select(shapes, trainable)
    _check_selection(mask, trainable, model)
    frozen_names = [k for k in shapes if not mask[k]]
    state_names = list(fn._state_spec)
    kernels = fn._kernels
    policy = resolve(mixed_precision)
    remat_saveable = None if remat is None or remat is False else remat_policy(remat)

    # init's own strong reference to the module, dropped after its first call (see `_release`)
    held: list[torch.nn.Module] = [model]

    def init(params: dict | None = None, model_state: dict | None = None) -> TrainState:
        # committed copies: jit outputs are committed, so later steps hit the same cache; the
        # module's tensors are read now, not kept
        if params is None or model_state is None:
            params_t, state_t = split_state(fn.module)
            if params is None:
                params = _copies(to_kernels(params_t, kernels))
            if model_state is None:
                model_state = _copies(state_t)
            del params_t, state_t
        held.clear()
        if set(params) != set(shapes):
            raise KeyError(
                f"init: params must have exactly the module's trainable parameters ({len(shapes)} names, as "
                f"`extract` gives); missing {sorted(set(shapes) - set(params))[:5]}, "
                f"extra {sorted(set(params) - set(shapes))[:5]}"
            )
        trained = {k: v for k, v in params.items() if mask[k]}
        rest = {**{k: params[k] for k in frozen_names}, **model_state}
        opt_state = _place_like(jax.jit(optimizer.init)(trained), trained)
        count = jax.device_put(jnp.zeros((), jnp.int32), _common_sharding({**trained, **rest}))
        return TrainState(params=trained, model_state=rest, opt_state=opt_state, step=count)

    def loss_and_state(trained: Any, frozen: Any, state: Any, inputs: Any, targets: Any, key: Any) -> Any:
        p = {**frozen, **trained}
        args, kwargs = _as_call(inputs)
        computed = state
        if policy is not None:
            p, computed, args, kwargs = policy.cast_to_compute((p, state, args, kwargs))
        out, new_state = fn(p, *args, state=computed, rng=key, **kwargs)
        if policy is not None:
            out = policy.cast_to_output(out)
        loss = loss_fn(out, targets)
        # entries the forward wrote (at trace time, a new value); the rest stay the arrays given
        written = {k: new_state[k].astype(state[k].dtype) for k in state if new_state[k] is not computed[k]}
        scaled = loss * policy.loss_scale if policy is not None and policy.loss_scale else loss
        return scaled, (loss, written)

    if remat_saveable is not None:
        loss_and_state = jax.checkpoint(loss_and_state, policy=remat_saveable)
    value_and_grad = jax.value_and_grad(loss_and_state, has_aux=True)

    def grads_of(trained: Any, frozen: Any, state: Any, inputs: Any, targets: Any, key: Any) -> Any:
        if accumulate == 1:
            (_, (loss, written)), grads = value_and_grad(trained, frozen, state, inputs, targets, key)
            return loss, grads, written

        batches, rebuild = micro_batches((inputs, targets), accumulate)
        keys = jax.random.split(key, accumulate) if key is not None else None

        def body(carry: Any, xs: Any) -> Any:
            state_c, gsum, lsum = carry
            parts, k = xs
            x, y = rebuild(parts)
            (_, (loss, written)), g = value_and_grad(trained, frozen, state_c, x, y, k)
            return ({**state_c, **written}, jax.tree_util.tree_map(jnp.add, gsum, g), lsum + loss), None

        zeros = jax.tree_util.tree_map(jnp.zeros_like, trained)
        (state_n, gsum, lsum), _ = jax.lax.scan(body, (state, zeros, jnp.zeros((), jnp.float32)), (batches, keys))
        grads = jax.tree_util.tree_map(lambda g: g / accumulate, gsum)
        written = {k: v for k, v in state_n.items() if v is not state[k]}
        return lsum / accumulate, grads, written

    def step(
        state: TrainState, inputs: Any, targets: Any, rng: jax.Array | None = None
    ) -> tuple[TrainState, jax.Array]:
        inputs, targets = unwrap_static((inputs, targets))
        with jax.named_scope("jaxtorch_train_step"):
            trained = state.params
            frozen = {k: state.model_state[k] for k in frozen_names}
            model_state = {k: state.model_state[k] for k in state_names}
            loss, grads, written = grads_of(trained, frozen, model_state, inputs, targets, rng)
            if policy is not None and policy.loss_scale:
                grads = jax.tree_util.tree_map(lambda g: g / policy.loss_scale, grads)
            updates, opt_state = optimizer.update(grads, state.opt_state, trained)
            new = optax.apply_updates(trained, updates)
            new = {k: v.astype(trained[k].dtype) for k, v in new.items()}
            rest = {k: written.get(k, v) for k, v in state.model_state.items()}
            if jit and isinstance(loss, Tracer):
                fn.release_module()  # traced: the compiled step no longer needs the module (a retrace does)
            return TrainState(params=new, model_state=rest, opt_state=opt_state, step=state.step + 1), loss

    compiled = jax.jit(step, donate_argnums=(0,) if donate else ()) if jit else step
    checked: list[Callable] = []  # built at the first step under `jaxtorch.checks()`

    def run(state: TrainState, inputs: Any, targets: Any, rng: jax.Array | None = None) -> tuple[TrainState, jax.Array]:
        if isinstance(inputs, Mapping) and not isinstance(inputs, dict):  # BatchEncoding: JAX walks dicts
            inputs = dict(inputs)
        inputs, targets = wrap_static(_torch_to_jax((inputs, targets)))
        state = place_state(state, (inputs, targets))
        if _checks.enabled():  # checkify'd and not donated: a failed check raises torch's error, state intact
            if not checked:
                checked.append(_checks.jit(step) if jit else step)
            return checked[0](state, inputs, targets, rng)
        alive = not _deleted(state.step)
        try:
            return compiled(state, inputs, targets, rng)
        except (ValueError, RuntimeError) as e:  # JAX's "deleted or donated" buffer: say which and why
            if alive and _deleted(state.step):  # donated to this very call, which then failed
                e.add_note(
                    "jaxtorch: this state was donated to the step that failed, so it is gone; rerun with "
                    "`jaxtorch.checks()` (torch's errors, the state kept) or `make_train_step(..., donate=False)`"
                )
                raise
            check_not_donated(state, "step", cause=e)
            raise

    def lower(state: TrainState, inputs: Any, targets: Any, rng: jax.Array | None = None) -> Any:
        inputs, targets = wrap_static(_torch_to_jax((inputs, targets)))
        return compiled.lower(state, inputs, targets, rng)  # type: ignore[union-attr]

    run.__doc__ = step.__doc__ = "step(state, inputs, targets, rng=None) -> (state, loss): one optimizer update."
    run.lower = lower if jit else None  # type: ignore[attr-defined]  # AOT: step.lower(state, x, y, key).compile()
    run.pure = step  # type: ignore[attr-defined]  # the un-jitted pure function (for make_jaxpr, shard_map, custom jit options)
    run.jitted = compiled  # type: ignore[attr-defined]
    return init, run


def _jax_dtype(dtype: Any) -> Any:
    """A torch dtype (from the module's tensors) as the JAX dtype `extract` would give."""
    return tensor_to_jax(torch.empty((), dtype=dtype)).dtype if isinstance(dtype, torch.dtype) else dtype


def _copies(tensors: dict[str, torch.Tensor]) -> dict[str, jax.Array]:
    """Committed JAX copies of the module's tensors (not sharing its memory), one at a time."""
    device = jax.local_devices()[0]
    return {k: jax.device_put(tensor_to_jax(t), device, may_alias=False) for k, t in tensors.items()}


__all__ = ["make_train_step", "remat_policy"]
