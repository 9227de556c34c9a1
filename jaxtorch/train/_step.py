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

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
import torch

from ..bridge.api._jax_first import module_function
from ..bridge.state._binding import split_state
from ..bridge.state._layouts import ConvLayout, to_kernels
from ..bridge.tensor._convert import tensor_to_jax, to_jax, tree_map
from ._precision import MixedPrecision, resolve
from ._state import Trainable, TrainState, check_not_donated, select

Remat = None | bool | str | Callable


def remat_policy(remat: Remat):
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


def _common_sharding(params: dict):
    """A replicated sharding over the devices the params live on (for scalars of the state)."""
    for v in params.values():
        sharding = getattr(v, "sharding", None)
        if isinstance(sharding, jax.sharding.NamedSharding):
            return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
        if sharding is not None:
            return next(iter(sharding.device_set))
    return jax.local_devices()[0]


def _place_like(opt_state, train: dict):
    """Commit each optimizer-state leaf to its parameter's sharding (Adam's `mu["fc.weight"]` like
    `fc.weight`), others (counts) replicated: every later step then sees the same placements."""
    replicated = _common_sharding(train)

    def place(path, leaf):
        for k in reversed(path):
            if isinstance(k, jax.tree_util.DictKey) and k.key in train and train[k.key].shape == leaf.shape:
                return jax.device_put(leaf, train[k.key].sharding)
        return jax.device_put(leaf, replicated)

    return jax.tree_util.tree_map_with_path(place, opt_state)


def _as_call(inputs) -> tuple[tuple, dict]:
    """`inputs` as positional/keyword arguments: a tuple is unpacked, a dict is keywords."""
    if isinstance(inputs, tuple) and not hasattr(type(inputs), "_fields"):
        return inputs, {}
    if isinstance(inputs, dict):
        return (), inputs
    return (inputs,), {}


def _torch_to_jax(tree):
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
      bit-identical, except buffers the forward writes (BatchNorm statistics).
    - `accumulate`: split each batch into this many micro-batches along axis 0, run them
      one after another (buffers threaded through) and apply the averaged gradient once.
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
      `rng` is the JAX key that dropout and other random ops draw from.
    """
    if accumulate < 1:
        raise ValueError(f"accumulate must be >= 1, got {accumulate}")
    fn = module_function(model, train=train, mutable=True, conv_layout=conv_layout)
    shapes = {k: jax.ShapeDtypeStruct(shape, _jax_dtype(dtype)) for k, (shape, dtype) in fn._params_spec.items()}
    mask = select(shapes, trainable)
    frozen_names = [k for k in shapes if not mask[k]]
    state_names = list(fn._state_spec)
    kernels = fn._kernels
    policy = resolve(mixed_precision)
    checkpoint_policy = None if remat is None or remat is False else remat_policy(remat)

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

    def loss_and_state(trained, frozen, state, inputs, targets, key):
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

    if checkpoint_policy is not None:
        loss_and_state = jax.checkpoint(loss_and_state, policy=checkpoint_policy)
    value_and_grad = jax.value_and_grad(loss_and_state, has_aux=True)

    def grads_of(trained, frozen, state, inputs, targets, key):
        if accumulate == 1:
            (_, (loss, written)), grads = value_and_grad(trained, frozen, state, inputs, targets, key)
            return loss, grads, written

        def micro(x):
            if x.shape[0] % accumulate:
                raise ValueError(f"accumulate={accumulate} does not divide the batch size {x.shape[0]}")
            return x.reshape(accumulate, x.shape[0] // accumulate, *x.shape[1:])

        batches = jax.tree_util.tree_map(micro, (inputs, targets))
        keys = jax.random.split(key, accumulate) if key is not None else None

        def body(carry, xs):
            state_c, gsum, lsum = carry
            (x, y), k = xs
            (_, (loss, written)), g = value_and_grad(trained, frozen, state_c, x, y, k)
            return ({**state_c, **written}, jax.tree_util.tree_map(jnp.add, gsum, g), lsum + loss), None

        zeros = jax.tree_util.tree_map(jnp.zeros_like, trained)
        (state_n, gsum, lsum), _ = jax.lax.scan(body, (state, zeros, jnp.zeros((), jnp.float32)), (batches, keys))
        grads = jax.tree_util.tree_map(lambda g: g / accumulate, gsum)
        written = {k: v for k, v in state_n.items() if v is not state[k]}
        return lsum / accumulate, grads, written

    def step(state: TrainState, inputs, targets, rng: jax.Array | None = None) -> tuple[TrainState, jax.Array]:
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
            if jit and isinstance(loss, jax.core.Tracer):
                fn.release_module()  # traced: the compiled step no longer needs the module (a retrace does)
            return TrainState(params=new, model_state=rest, opt_state=opt_state, step=state.step + 1), loss

    compiled = jax.jit(step, donate_argnums=(0,) if donate else ()) if jit else step

    def run(state: TrainState, inputs, targets, rng: jax.Array | None = None) -> tuple[TrainState, jax.Array]:
        inputs, targets = _torch_to_jax((inputs, targets))
        try:
            return compiled(state, inputs, targets, rng)
        except (ValueError, RuntimeError) as e:  # JAX's "deleted or donated" buffer: say which and why
            check_not_donated(state, "step", cause=e)
            raise

    run.__doc__ = step.__doc__ = "step(state, inputs, targets, rng=None) -> (state, loss): one optimizer update."
    run.lower = getattr(compiled, "lower", None)  # type: ignore[attr-defined]  # AOT: step.lower(state, x, y, key).compile()
    run.pure = step  # type: ignore[attr-defined]  # the un-jitted pure function (for make_jaxpr, shard_map, custom jit options)
    run.jitted = compiled  # type: ignore[attr-defined]
    return init, run


def _jax_dtype(dtype):
    """A torch dtype (from the module's tensors) as the JAX dtype `extract` would give."""
    return tensor_to_jax(torch.empty((), dtype=dtype)).dtype if isinstance(dtype, torch.dtype) else dtype


def _copies(tensors: dict[str, torch.Tensor]) -> dict[str, jax.Array]:
    """Committed JAX copies of the module's tensors (not sharing its memory), one at a time."""
    device = jax.local_devices()[0]
    return {k: jax.device_put(tensor_to_jax(t), device, may_alias=False) for k, t in tensors.items()}


__all__ = ["make_train_step", "remat_policy"]
