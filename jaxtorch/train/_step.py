"""`make_train_step`: a jitted optax training step for a torch module, as `(init, step)`.

The model runs through `extract(model, mutable=True)`, so the step is a pure JAX function
of an explicit `TrainState`: parameters and buffers in, updated parameters and buffers
out (BatchNorm statistics included), optax state in and out.

Example:
    ```python
    def loss_fn(logits, labels):
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    init, step = jaxtorch.train.make_train_step(model, loss_fn, optax.adamw(1e-3))
    state = init()
    for i, (x, y) in enumerate(batches):
        state, loss = step(state, x, y, jax.random.fold_in(key, i))
    jaxtorch.load_into(model, state.params)
    ```
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
import torch

from ..bridge.api._jax_first import extract
from ..bridge.state._layouts import ConvLayout
from ..bridge.tensor._convert import to_jax, tree_map
from ._precision import MixedPrecision, resolve
from ._state import Trainable, TrainState, buffer_names, select

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
    donate: bool = False,
    conv_layout: ConvLayout = "torch",
) -> tuple[Callable[..., TrainState], Callable[..., tuple[TrainState, jax.Array]]]:
    """Build `(init, step)` to train `model` with `loss_fn` and an optax optimizer.

    **Arguments:**
    - `model`: a torch module; its `train()`/`eval()` mode when `step` is first traced
      is the mode used.
    - `loss_fn`: `loss_fn(outputs, targets) -> scalar`, written in JAX.
    - `optimizer`: any `optax.GradientTransformation`.
    - `trainable`: globs, a list of globs or a predicate `(name, array) -> bool`
      selecting the trained parameters; the rest (and all buffers) are frozen and stay
      bit-identical (buffers still update through the forward, e.g. BatchNorm stats).
    - `accumulate`: split each batch into this many micro-batches along axis 0, run them
      one after another (buffers threaded through) and apply the averaged gradient once.
    - `remat`: rematerialize the forward in the backward (`jax.checkpoint`) with this
      policy: True/"full", a `jax.checkpoint_policies` name, or a policy.
    - `mixed_precision`: None, "bf16"/"fp16" or a `MixedPrecision`: compute in low
      precision with float32 master weights (loss scaling off unless set).
    - `jit`: compile `step` with `jax.jit` (default).
    - `donate`: donate the input state's buffers to the output (saves memory; the state
      passed in cannot be used again).
    - `conv_layout`: "flax" keeps convolution weights (and their gradients and optimizer
      state) in the layout XLA's CPU convolutions read, as `<module>.kernel`, as in
      `extract`; `load_into` takes them back.

    **Returns:** `(init, step)`:
    - `init(params=None) -> TrainState`: the model's current values (copied) or
      `params` (e.g. sharded by `shard`), with a fresh optimizer state.
    - `step(state, inputs, targets, rng=None) -> (state, loss)`: one update. `inputs` is
      one array, a tuple of positional arguments or a dict of keyword arguments;
      `rng` is the JAX key that dropout and other random ops draw from.
    """
    if accumulate < 1:
        raise ValueError(f"accumulate must be >= 1, got {accumulate}")
    params0, fn = extract(model, mutable=True, conv_layout=conv_layout)
    buffers = buffer_names(model)
    mask = select(params0, trainable, buffers)
    policy = resolve(mixed_precision)
    checkpoint_policy = None if remat is None or remat is False else remat_policy(remat)

    def split(p: dict) -> tuple[dict, dict]:
        return {k: v for k, v in p.items() if mask[k]}, {k: v for k, v in p.items() if not mask[k]}

    def init(params: dict | None = None) -> TrainState:
        if params is None:  # committed copies: jit outputs are committed, so later steps hit the same cache
            device = jax.local_devices()[0]
            params = {k: jax.device_put(v, device, may_alias=False) for k, v in params0.items()}
        train, _ = split(params)
        opt_state = _place_like(jax.jit(optimizer.init)(train), train)
        count = jax.device_put(jnp.zeros((), jnp.int32), _common_sharding(params))
        return TrainState(params=dict(params), opt_state=opt_state, step=count)

    def loss_and_buffers(train, rest, inputs, targets, key):
        p = {**rest, **train}
        args, kwargs = _as_call(inputs)
        if policy is not None:
            p, args, kwargs = policy.cast_to_compute((p, args, kwargs))
        out, new_p = fn(p, *args, rng=key, **kwargs)
        if policy is not None:
            out = policy.cast_to_output(out)
        loss = loss_fn(out, targets)
        new_buffers = {k: new_p[k].astype(rest[k].dtype) for k in rest if k in buffers}
        scaled = loss * policy.loss_scale if policy is not None and policy.loss_scale else loss
        return scaled, (loss, new_buffers)

    if checkpoint_policy is not None:
        loss_and_buffers = jax.checkpoint(loss_and_buffers, policy=checkpoint_policy)
    value_and_grad = jax.value_and_grad(loss_and_buffers, has_aux=True)

    def grads_of(train, rest, inputs, targets, key):
        if accumulate == 1:
            (_, (loss, new_buffers)), grads = value_and_grad(train, rest, inputs, targets, key)
            return loss, grads, new_buffers

        def micro(x):
            if x.shape[0] % accumulate:
                raise ValueError(f"accumulate={accumulate} does not divide the batch size {x.shape[0]}")
            return x.reshape(accumulate, x.shape[0] // accumulate, *x.shape[1:])

        batches = jax.tree_util.tree_map(micro, (inputs, targets))
        keys = jax.random.split(key, accumulate) if key is not None else None

        def body(carry, xs):
            rest_c, gsum, lsum = carry
            (x, y), k = xs
            (_, (loss, new_buffers)), g = value_and_grad(train, rest_c, x, y, k)
            return ({**rest_c, **new_buffers}, jax.tree_util.tree_map(jnp.add, gsum, g), lsum + loss), None

        zeros = jax.tree_util.tree_map(jnp.zeros_like, train)
        (rest_n, gsum, lsum), _ = jax.lax.scan(body, (rest, zeros, jnp.zeros((), jnp.float32)), (batches, keys))
        grads = jax.tree_util.tree_map(lambda g: g / accumulate, gsum)
        return lsum / accumulate, grads, {k: rest_n[k] for k in rest if k in buffers}

    def step(state: TrainState, inputs, targets, rng: jax.Array | None = None) -> tuple[TrainState, jax.Array]:
        with jax.named_scope("jaxtorch_train_step"):
            train, rest = split(state.params)
            loss, grads, new_buffers = grads_of(train, rest, inputs, targets, rng)
            if policy is not None and policy.loss_scale:
                grads = jax.tree_util.tree_map(lambda g: g / policy.loss_scale, grads)
            updates, opt_state = optimizer.update(grads, state.opt_state, train)
            train = optax.apply_updates(train, updates)
            train = {k: v.astype(state.params[k].dtype) for k, v in train.items()}
            new = {**new_buffers, **train}
            params = {k: new.get(k, v) for k, v in state.params.items()}
            return TrainState(params=params, opt_state=opt_state, step=state.step + 1), loss

    compiled = jax.jit(step, donate_argnums=(0,) if donate else ()) if jit else step

    def run(state: TrainState, inputs, targets, rng: jax.Array | None = None) -> tuple[TrainState, jax.Array]:
        inputs, targets = _torch_to_jax((inputs, targets))
        return compiled(state, inputs, targets, rng)

    run.__doc__ = step.__doc__ = "step(state, inputs, targets, rng=None) -> (state, loss): one optimizer update."
    run.lower = getattr(compiled, "lower", None)  # type: ignore[attr-defined]  # AOT: step.lower(state, x, y, key).compile()
    run.pure = step  # type: ignore[attr-defined]  # the un-jitted pure function (for make_jaxpr, shard_map, custom jit options)
    run.jitted = compiled  # type: ignore[attr-defined]
    return init, run


__all__ = ["make_train_step", "remat_policy"]
