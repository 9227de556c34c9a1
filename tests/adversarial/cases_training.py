"""Training (issue 30): `make_train_step` against a plain torch loop, the step's inputs, its state, loaders.

Each case trains a tiny model both ways (torch on the CPU, eagerly; jaxtorch) and compares the losses and every
entry of the state dict, or checks that a misuse is refused with an error naming the way out.
"""

from __future__ import annotations

import copy
import math
import os
import subprocess
import sys
import tempfile
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
import torch.nn.functional as F
from torch import nn

import jaxtorch
import jaxtorch.xla as xm
from jaxtorch.train import (
    DeviceLoader,
    DonatedStateError,
    load_checkpoint,
    load_into,
    make_train_step,
    save_checkpoint,
)

from .harness import case, close, equal, refuses, refuses_or


def _mlp(seed: int = 0, d_in: int = 4, hidden: int = 8, d_out: int = 3) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, d_out))


def _batches(n: int = 3, rows: int = 8, d_in: int = 4, d_out: int = 3, seed: int = 1) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, d_in, generator=g), torch.randn(rows, d_out, generator=g)) for _ in range(n)]


def _mse(out, y):
    return jnp.mean((out - y) ** 2)


def _xent(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _torch_run(model, opt, batches, loss=F.mse_loss, clip=None, sched=None) -> list[float]:
    """The plain torch loop: zero_grad, forward, loss, backward, (clip), step, (scheduler)."""
    losses = []
    for x, y in batches:
        opt.zero_grad()
        value = loss(model(x), y)
        value.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(value.item())
    return losses


def _jax_run(model, optimizer, batches, loss=_mse, keys=None, **kwargs):
    init, step = make_train_step(model, loss, optimizer, **kwargs)
    state, losses = init(), []
    for i, (x, y) in enumerate(batches):
        state, value = step(state, x, y, None if keys is None else keys[i])
        losses.append(float(value))
    return state, losses


def _matches(state, losses, model, torch_losses) -> None:
    """Same losses and the same value for every entry of the torch module's state dict."""
    close(np.array(losses), np.array(torch_losses), rtol=1e-5, atol=1e-6)
    values = {**state.params, **state.model_state}
    missing = set(model.state_dict()) - set(values)  # (values may hold non-persistent buffers too)
    assert not missing, missing
    for name, t in model.state_dict().items():
        close(np.asarray(values[name], np.float64), t.double(), rtol=1e-5, atol=1e-5)


def _versus_torch(make_torch_opt, optimizer, model_fn=_mlp, batches=None, **kwargs) -> None:
    model = model_fn()
    ref = copy.deepcopy(model)
    batches = _batches() if batches is None else batches
    state, losses = _jax_run(model, optimizer, batches, **kwargs)
    _matches(state, losses, ref, _torch_run(ref, make_torch_opt(ref), batches))


# ---- optimizers: make_train_step with optax's equivalent of torch's -----------------------------------
@case("training/opt/sgd")
def _sgd():
    _versus_torch(lambda m: torch.optim.SGD(m.parameters(), lr=0.1), optax.sgd(0.1))


@case("training/opt/sgd_momentum")
def _sgd_momentum():
    _versus_torch(lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), optax.sgd(0.1, momentum=0.9))


@case("training/opt/sgd_nesterov")
def _sgd_nesterov():
    _versus_torch(
        lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, nesterov=True),
        optax.sgd(0.1, momentum=0.9, nesterov=True),
    )


@case("training/opt/sgd_weight_decay")
def _sgd_wd():
    _versus_torch(
        lambda m: torch.optim.SGD(m.parameters(), lr=0.1, weight_decay=0.01),
        optax.chain(optax.add_decayed_weights(0.01), optax.sgd(0.1)),
    )


@case("training/opt/sgd_maximize")
def _sgd_maximize():  # torch's maximize ascends: optax's sgd with a negative rate
    _versus_torch(lambda m: torch.optim.SGD(m.parameters(), lr=0.1, maximize=True), optax.sgd(-0.1))


@case("training/opt/adam")
def _adam():
    _versus_torch(lambda m: torch.optim.Adam(m.parameters(), lr=1e-2), optax.adam(1e-2))


@case("training/opt/adamw_weight_decay")
def _adamw():
    _versus_torch(
        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1), optax.adamw(1e-2, weight_decay=0.1)
    )


@case("training/opt/rmsprop")
def _rmsprop():  # torch: eps outside the root, no bias correction; optax's rmsprop: eps inside: eps_in_sqrt=False
    _versus_torch(
        lambda m: torch.optim.RMSprop(m.parameters(), lr=1e-2, alpha=0.99, eps=1e-8),
        optax.rmsprop(1e-2, decay=0.99, eps=1e-8, eps_in_sqrt=False),
    )


@case("training/opt/param_groups_different_lr")
def _param_groups():
    labels = {"0.weight": "fast", "0.bias": "fast", "2.weight": "slow", "2.bias": "slow"}
    _versus_torch(
        lambda m: torch.optim.SGD(
            [{"params": m[0].parameters(), "lr": 0.2}, {"params": m[2].parameters(), "lr": 0.01}], lr=0.5
        ),
        optax.multi_transform({"fast": optax.sgd(0.2), "slow": optax.sgd(0.01)}, labels),
    )


@case("training/opt/grad_clipping")
def _clip():
    model = _mlp()
    ref = copy.deepcopy(model)
    batches = [(x * 5, y * 5) for x, y in _batches()]  # gradients above the norm: the clip acts
    state, losses = _jax_run(model, optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(0.1)), batches)
    torch_losses = _torch_run(ref, torch.optim.SGD(ref.parameters(), lr=0.1), batches, clip=0.5)
    _matches(state, losses, ref, torch_losses)


@case("training/opt/step_lr_schedule")
def _schedule():
    model = _mlp()
    ref = copy.deepcopy(model)
    batches = _batches(n=4)
    schedule = optax.piecewise_constant_schedule(0.1, {2: 0.5})  # torch's StepLR(step_size=2, gamma=0.5)
    state, losses = _jax_run(model, optax.sgd(schedule), batches)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    torch_losses = _torch_run(ref, opt, batches, sched=torch.optim.lr_scheduler.StepLR(opt, 2, 0.5))
    _matches(state, losses, ref, torch_losses)
    assert int(state.step) == 4, state.step


# ---- the model: frozen parameters, buffers, modes, randomness, tied weights -----------------------------
@case("training/model/frozen_requires_grad_false")
def _frozen():
    def frozen():
        m = _mlp()
        m[0].weight.requires_grad_(False)
        return m

    model = frozen()
    before = model[0].weight.detach().clone()
    ref = copy.deepcopy(model)
    state, losses = _jax_run(model, optax.adam(1e-2), _batches())
    opt = torch.optim.Adam([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    _matches(state, losses, ref, _torch_run(ref, opt, _batches()))
    assert "0.weight" not in state.params
    equal(np.asarray(state.model_state["0.weight"]), before.numpy())


def _bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5, bias=False), nn.BatchNorm1d(5), nn.ReLU(), nn.Linear(5, 3))


@case("training/model/batchnorm_running_stats_each_step")
def _bn_stats():
    _versus_torch(lambda m: torch.optim.SGD(m.parameters(), lr=0.1), optax.sgd(0.1), model_fn=_bn_net)


@case("training/model/eval_mode_uses_running_stats")
def _bn_eval():
    def evaluated():
        m = _bn_net()
        m[1].running_mean.fill_(0.5)
        m[1].running_var.fill_(2.0)
        return m.eval()

    _versus_torch(lambda m: torch.optim.SGD(m.parameters(), lr=0.1), optax.sgd(0.1), model_fn=evaluated)


@case("training/model/train_false_freezes_stats_of_a_train_mode_module")
def _train_false():
    model = _bn_net().train()
    ref = copy.deepcopy(model).eval()
    state, losses = _jax_run(model, optax.sgd(0.1), _batches(), train=False)
    _matches(state, losses, ref, _torch_run(ref, torch.optim.SGD(ref.parameters(), lr=0.1), _batches()))
    assert model.training  # the module's own mode is left alone


def _dropout_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.5), nn.Linear(16, 3)).train()


@case("training/model/dropout_mask_follows_the_step_key")
def _dropout_keys():
    model = _dropout_net()  # kept: the step without a key retraces, which needs the module
    init, step = make_train_step(model, _mse, optax.sgd(0.0), donate=False)
    state, (x, y) = init(), _batches(1)[0]
    a, b, c = (float(step(state, x, y, jax.random.key(k))[1]) for k in (0, 0, 1))
    assert a == b and a != c, (a, b, c)
    refuses(lambda: step(state, x, y), "dropout in train mode ran without a key", "key")


@case("training/model/dropout_eval_mode_is_deterministic_like_torch")
def _dropout_eval():
    _versus_torch(
        lambda m: torch.optim.SGD(m.parameters(), lr=0.1), optax.sgd(0.1), model_fn=lambda: _dropout_net().eval()
    )


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(10, 4)
        self.proj = nn.Linear(4, 10, bias=False)
        self.proj.weight = self.emb.weight

    def forward(self, ids):
        return self.proj(self.emb(ids))


@case("training/model/tied_weights_train_as_one_tensor")
def _tied():
    model = _Tied()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randint(0, 10, (6,), generator=g), torch.randint(0, 10, (6,), generator=g)) for _ in range(3)]
    state, losses = _jax_run(model, optax.sgd(0.5), batches, loss=_xent)
    torch_losses = _torch_run(ref, torch.optim.SGD(ref.parameters(), lr=0.5), batches, loss=F.cross_entropy)
    close(np.array(losses), np.array(torch_losses), rtol=1e-5, atol=1e-6)
    load_into(model, state)
    close(model.emb.weight, ref.emb.weight, rtol=1e-5, atol=1e-6)
    assert model.proj.weight is model.emb.weight  # still tied


class _DictOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = _mlp()

    def forward(self, x):
        out = self.net(x)
        return {"logits": out, "aux": (out.mean(), out.sum())}


@case("training/model/dict_and_tuple_outputs_reach_the_loss")
def _dict_out():
    model = _DictOut()
    ref = copy.deepcopy(model)
    batches = _batches()
    state, losses = _jax_run(model, optax.sgd(0.1), batches, loss=lambda o, y: _mse(o["logits"], y) + o["aux"][0] ** 2)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    torch_losses = _torch_run(ref, opt, batches, loss=lambda o, y: F.mse_loss(o["logits"], y) + o["aux"][0] ** 2)
    _matches(state, losses, ref, torch_losses)


@case("training/loss/tuple_loss_is_refused_clearly")
def _tuple_loss():
    init, step = make_train_step(_mlp(), lambda o, y: (_mse(o, y), o.mean()), optax.sgd(0.1))
    x, y = _batches(1)[0]
    refuses(lambda: step(init(), x, y), "a loss_fn returning a tuple trained", "scalar")


@case("training/loss/int64_and_int32_labels")
def _int_labels():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 4, generator=g)
    for dtype in (torch.int64, torch.int32, torch.uint8):
        labels = torch.randint(0, 3, (8,), generator=g).to(dtype)
        model = _mlp()
        ref = copy.deepcopy(model)
        state, losses = _jax_run(model, optax.sgd(0.1), [(x, labels)], loss=_xent)
        opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        _matches(state, losses, ref, _torch_run(ref, opt, [(x, labels.long())], loss=F.cross_entropy))


@case("training/loss/zero_size_batch_sum_loss")
def _empty_batch():
    model = _mlp()
    ref = copy.deepcopy(model)
    batches = [(torch.zeros(0, 4), torch.zeros(0, 3))]
    state, losses = _jax_run(model, optax.sgd(0.1), batches, loss=lambda o, y: jnp.sum((o - y) ** 2))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    torch_losses = _torch_run(ref, opt, batches, loss=lambda o, y: ((o - y) ** 2).sum())
    _matches(state, losses, ref, torch_losses)


# ---- gradient accumulation ----------------------------------------------------------------------------
@case("training/accumulate/adam_equals_one_big_batch")
def _accumulate_big():
    model = _mlp()
    batches = _batches(n=2, rows=12)
    big, big_losses = _jax_run(model, optax.adam(1e-2), batches)
    acc, acc_losses = _jax_run(model, optax.adam(1e-2), batches, accumulate=3)
    close(np.array(acc_losses), np.array(big_losses), rtol=1e-5, atol=1e-6)
    for k in big.params:
        close(acc.params[k], big.params[k], rtol=1e-5, atol=1e-5)


@case("training/accumulate/matches_torch_micro_batches_with_cross_entropy")
def _accumulate_torch():
    model = _mlp()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(4)
    x, labels = torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)
    state, losses = _jax_run(model, optax.sgd(0.1), [(x, labels)], loss=_xent, accumulate=4)
    opt, total = torch.optim.SGD(ref.parameters(), lr=0.1), 0.0
    for xs, ys in zip(x.chunk(4), labels.chunk(4)):
        part = F.cross_entropy(ref(xs), ys) / 4
        part.backward()
        total += part.item()
    opt.step()
    _matches(state, losses, ref, [total])


class _Kw(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = _mlp()

    def forward(self, x, labels=None, scale=1.0, use_cache=True, past_key_values=None):
        assert use_cache is False and past_key_values is None
        out = self.net(x) * scale
        return F.cross_entropy(out, labels) if labels is not None else out


@case("training/accumulate/hf_style_kwargs_and_no_targets")
def _accumulate_kwargs():
    model = _Kw()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(5)
    x, labels = torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)
    inputs = {"x": x, "labels": labels, "scale": 0.5, "use_cache": False, "past_key_values": None}
    init, step = make_train_step(model, lambda loss, _: loss, optax.sgd(0.1), accumulate=2)
    state, loss = step(init(), inputs, None)
    opt, total = torch.optim.SGD(ref.parameters(), lr=0.1), 0.0
    for xs, ys in zip(x.chunk(2), labels.chunk(2)):
        part = ref(xs, ys, scale=0.5, use_cache=False) / 2
        part.backward()
        total += part.item()
    opt.step()
    _matches(state, [float(loss)], ref, [total])


@case("training/accumulate/0d_array_goes_to_every_micro_step")
def _accumulate_0d():
    model = _Kw()
    ref = copy.deepcopy(model)
    x, y = _batches(1)[0]
    init, step = make_train_step(model, _mse, optax.sgd(0.1), accumulate=2)
    state, loss = step(init(), {"x": x, "scale": jnp.float32(3.0), "use_cache": False}, y)
    opt, total = torch.optim.SGD(ref.parameters(), lr=0.1), 0.0
    for xs, ys in zip(x.chunk(2), y.chunk(2)):
        part = F.mse_loss(ref(xs, scale=3.0, use_cache=False), ys) / 2
        part.backward()
        total += part.item()
    opt.step()
    _matches(state, [float(loss)], ref, [total])


@case("training/accumulate/indivisible_batch_refused")
def _accumulate_indivisible():
    init, step = make_train_step(_mlp(), _mse, optax.sgd(0.1), accumulate=3)
    x, y = _batches(1)[0]
    refuses(lambda: step(init(), x, y), "accumulate=3 split 8 rows", "does not divide", error=ValueError)


# ---- Python values as inputs --------------------------------------------------------------------------
class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = _mlp()

    def forward(self, x, scale):
        sign = math.copysign(1.0, scale) if isinstance(scale, float) else 2.0 if scale is True else 1.0
        return self.net(x) * sign * abs(scale)


@case("training/inputs/python_scalar_new_value_is_used")
def _scalar_values():
    model = _Scaled()
    init, step = make_train_step(model, _mse, optax.sgd(0.0), donate=False)
    state, (x, y) = init(), _batches(1)[0]
    for scale in (2.0, 3.0, 1, True, 0.0, -0.0, -2.0):
        _, loss = step(state, (x, scale), y)
        expected = F.mse_loss(model(x, scale), y).item()
        close(np.float32(loss), np.float32(expected), rtol=1e-6, atol=1e-7)


@case("training/inputs/unhashable_python_value_refused")
def _unhashable():
    class Takes(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = _mlp()

        def forward(self, x, opts):
            return self.net(x)

    init, step = make_train_step(Takes(), _mse, optax.sgd(0.1))
    x, y = _batches(1)[0]
    refuses_or(lambda: step(init(), (x, {1, 2}), y), "hashable")


# ---- trainable= selections ----------------------------------------------------------------------------
@case("training/trainable/typo_in_one_glob_refused")
def _typo():
    e = refuses(
        lambda: make_train_step(_mlp(), _mse, optax.sgd(0.1), trainable=["2.*", "O.*"]),
        "a glob matching nothing was accepted",
        "O.*",
        error=ValueError,
    )
    assert "0.weight" in str(e), e


@case("training/trainable/all_frozen_refused")
def _all_frozen():
    model = _mlp()
    for p in model.parameters():
        p.requires_grad_(False)
    refuses(
        lambda: make_train_step(model, _mse, optax.sgd(0.1)),
        "a model with every parameter frozen trained nothing without a word",
        "no trainable parameter",
        error=ValueError,
    )


@case("training/trainable/predicate_selects_like_torch_param_list")
def _predicate():
    model = _mlp()
    ref = copy.deepcopy(model)
    state, losses = _jax_run(model, optax.sgd(0.1), _batches(), trainable=lambda name, v: name.startswith("2."))
    _matches(state, losses, ref, _torch_run(ref, torch.optim.SGD(ref[2].parameters(), lr=0.1), _batches()))


# ---- the state: donation, failures, checkpoints -------------------------------------------------------
@case("training/state/survives_a_step_that_failed_to_trace")
def _survives_trace_error():
    model = _mlp()
    ref = copy.deepcopy(model)
    init, step = make_train_step(model, _mse, optax.sgd(0.1))
    state = init()
    refuses(  # wrong width: torch's shape error
        lambda: step(state, torch.randn(8, 5), torch.randn(8, 3)),
        "a (8, 5) batch went through Linear(4, 8)",
        "shape",
        "mat1",
    )
    x, y = _batches(1)[0]
    state, loss = step(state, x, y)
    _matches(state, [float(loss)], ref, _torch_run(ref, torch.optim.SGD(ref.parameters(), lr=0.1), [(x, y)]))


@case("training/state/checks_keep_the_state_after_an_embedding_index_error")
def _checks_embedding():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(5, 3), nn.Flatten(), nn.Linear(6, 2))
    ref = copy.deepcopy(model)
    init, step = make_train_step(model, _mse, optax.sgd(0.1))
    state, y = init(), torch.randn(4, 2)
    with jaxtorch.checks():
        refuses(
            lambda: step(state, torch.tensor([[0, 5]] * 4), y),
            "index 5 of 5 rows was read",
            "index out of range",
            error=IndexError,
        )
        good = torch.tensor([[0, 4], [1, 2], [3, 3], [2, 0]])
        state, loss = step(state, good, y)
    _matches(state, [float(loss)], ref, _torch_run(ref, torch.optim.SGD(ref.parameters(), lr=0.1), [(good, y)]))


@case("training/state/donated_state_reuse_names_the_idiom")
def _donated():
    init, step = make_train_step(_mlp(), _mse, optax.sgd(0.1))
    state, (x, y) = init(), _batches(1)[0]
    step(state, x, y)
    for again in (lambda: step(state, x, y), lambda: load_into(_mlp(), state)):
        refuses(lambda: again(), "a donated state was used again", "state, loss = step(state", error=DonatedStateError)


@case("training/state/checkpoint_round_trip_mid_training")
def _resume():
    batches = _batches(n=4)
    straight, straight_losses = _jax_run(_mlp(), optax.adam(1e-2), batches)
    init, step = make_train_step(_mlp(), _mse, optax.adam(1e-2))
    state, losses = init(), []
    with tempfile.TemporaryDirectory() as d:
        for i, (x, y) in enumerate(batches):
            if i == 2:
                save_checkpoint(state, os.path.join(d, "mid.safetensors"))
                state = load_checkpoint(os.path.join(d, "mid.safetensors"))
            state, loss = step(state, x, y)
            losses.append(float(loss))
    equal(np.array(losses), np.array(straight_losses))
    for a, b in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(straight)):
        equal(np.asarray(a), np.asarray(b))


@case("training/state/load_into_then_torch_continues_like_torch")
def _continue_in_torch():
    model = _mlp()
    ref = copy.deepcopy(model)
    batches = _batches(n=4)
    state, _ = _jax_run(model, optax.sgd(0.1), batches[:2])
    load_into(model, state)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tail = _torch_run(model, opt, batches[2:])
    torch_all = _torch_run(ref, torch.optim.SGD(ref.parameters(), lr=0.1), batches)
    close(np.array(tail), np.array(torch_all[2:]), rtol=1e-5, atol=1e-6)
    for a, b in zip(model.parameters(), ref.parameters()):
        close(a, b, rtol=1e-5, atol=1e-5)


# ---- loaders --------------------------------------------------------------------------------------------
def _dataset(n: int = 20):
    return torch.utils.data.TensorDataset(torch.arange(n * 2.0).reshape(n, 2), torch.arange(n))


@case("training/loader/device_loader_len_epochs_and_short_last_batch")
def _loader_epochs():
    loader = torch.utils.data.DataLoader(_dataset(), batch_size=8, drop_last=False)
    placed = DeviceLoader(loader)
    assert len(placed) == len(loader) == 3
    for _ in range(2):  # each `for` is a new epoch
        got = [(np.asarray(x), np.asarray(y)) for x, y in placed]
        want = [(x.numpy(), y.numpy()) for x, y in loader]
        assert [g[0].shape for g in got] == [(8, 2), (8, 2), (4, 2)]
        for (gx, gy), (wx, wy) in zip(got, want):
            equal(gx, wx)
            equal(gy, wy.astype(gy.dtype))


@case("training/loader/set_epoch_reshuffles_like_the_loader")
def _set_epoch():
    data = _dataset(16)
    sampler = torch.utils.data.distributed.DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=3)
    loader = torch.utils.data.DataLoader(data, batch_size=4, sampler=sampler)
    placed = DeviceLoader(loader)
    orders = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        want = np.concatenate([y.numpy() for _, y in loader])
        got = np.concatenate([np.asarray(y) for _, y in placed])
        equal(got, want.astype(got.dtype))
        orders.append(got)
    assert not np.array_equal(orders[0], orders[1])


@case("training/loader/refilled_buffer_does_not_change_placed_batches")
def _refill():
    buffer = torch.zeros(4, 2)

    def batches():
        for i in range(3):
            buffer.fill_(i)
            yield (buffer,)

    got = [np.asarray(b[0]) for b in DeviceLoader(batches(), prefetch=2)]
    for i, b in enumerate(got):
        equal(b, np.full((4, 2), i, np.float32))


@case("training/loader/mp_device_loader_torch_loop_matches_cpu")
def _mp_loop():
    g = torch.Generator().manual_seed(6)
    data = torch.utils.data.TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 3, generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    model = _mlp()
    ref = copy.deepcopy(model)
    torch_losses = _torch_run(ref, torch.optim.Adam(ref.parameters(), lr=1e-2), list(loader))
    with jaxtorch.default_env():
        device = xm.xla_device(lazy=False)
        model.to(device)
        opt, losses = torch.optim.Adam(model.parameters(), lr=1e-2), []
        batches = xm.MpDeviceLoader(loader, device)
        assert len(batches) == 2
        for x, y in batches:
            assert xm.is_xla_tensor(x)
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            xm.optimizer_step(opt)
            losses.append(loss.item())
        got = {k: v.cpu() for k, v in model.state_dict().items()}
    close(np.array(losses), np.array(torch_losses), rtol=1e-5, atol=1e-6)
    for k, v in ref.state_dict().items():
        close(got[k], v, rtol=1e-5, atol=1e-5)


# ---- torch's own optimizers on the jax device (the PyTorch-first loop) -----------------------------------
_TORCH_OPTS = {
    "adam_amsgrad": lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True),
    "adamw_amsgrad_weight_decay": lambda p: torch.optim.AdamW(p, lr=1e-2, amsgrad=True, weight_decay=0.05),
    "sgd_nesterov_maximize": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, maximize=True),
    "adam_maximize": lambda p: torch.optim.Adam(p, lr=1e-2, maximize=True),
    "rmsprop_centered_momentum": lambda p: torch.optim.RMSprop(p, lr=1e-2, centered=True, momentum=0.5),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),
}

for _name, _make in _TORCH_OPTS.items():

    @case(f"training/torch_loop/{_name}")
    def _torch_loop(make=_make):
        model = _mlp()
        ref = copy.deepcopy(model)
        batches = _batches()
        torch_losses = _torch_run(ref, make(ref.parameters()), batches)
        with jaxtorch.default_env():
            model.to("jax")
            losses = _torch_run(model, make(model.parameters()), [(x.to("jax"), y.to("jax")) for x, y in batches])
            got = {k: v.cpu() for k, v in model.state_dict().items()}
        close(np.array(losses), np.array(torch_losses), rtol=1e-5, atol=1e-6)
        for k, v in ref.state_dict().items():
            close(got[k], v, rtol=1e-5, atol=1e-5)


@case("training/torch_loop/param_groups_with_own_lr_and_frozen")
def _torch_groups():
    def build():
        m = _mlp()
        m[0].bias.requires_grad_(False)
        return m

    def make(m):
        return torch.optim.SGD(
            [{"params": [m[0].weight], "lr": 0.2}, {"params": m[2].parameters(), "momentum": 0.9}], lr=0.05
        )

    model, ref = build(), build()
    batches = _batches()
    torch_losses = _torch_run(ref, make(ref), batches)
    with jaxtorch.default_env():
        model.to("jax")
        losses = _torch_run(model, make(model), [(x.to("jax"), y.to("jax")) for x, y in batches])
        got = {k: v.cpu() for k, v in model.state_dict().items()}
    close(np.array(losses), np.array(torch_losses), rtol=1e-5, atol=1e-6)
    for k, v in ref.state_dict().items():
        close(got[k], v, rtol=1e-5, atol=1e-5)


# ---- 8 simulated devices (a subprocess) ---------------------------------------------------------------------
_EIGHT = """
import os, numpy as np, jax, jax.numpy as jnp, optax, torch
from torch import nn
from jax.sharding import Mesh
from jaxtorch.train import DeviceLoader, make_train_step, shard, shard_batch
assert jax.device_count() == 8
def mse(o, y): return jnp.mean((o - y) ** 2)
def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
g = torch.Generator().manual_seed(1)
data = torch.utils.data.TensorDataset(torch.randn(36, 4, generator=g), torch.randn(36, 3, generator=g))
"""


def _eight(body: str) -> str:
    code = _EIGHT + textwrap.dedent(body)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@case("training/eight/uneven_last_batch_refused_naming_drop_last")
def _uneven():
    out = _eight("""
        loader = torch.utils.data.DataLoader(data, batch_size=16, drop_last=False)   # 16, 16, 4 rows
        init, step = make_train_step(model(), mse, optax.sgd(0.1))
        state = init()
        try:
            for x, y in DeviceLoader(loader):
                state, loss = step(state, x, y)
        except ValueError as e:
            print("REFUSED", e)
        same = DeviceLoader(torch.utils.data.DataLoader(data, batch_size=16, drop_last=True))
        print("BATCHES", len([b for b in same]))
    """)
    assert "REFUSED" in out and "drop_last" in out, out
    assert "BATCHES 2" in out, out


@case("training/eight/data_parallel_accumulate_equals_one_device")
def _dp_accumulate():
    out = _eight("""
        batches = [(x, y) for x, y in torch.utils.data.DataLoader(data, batch_size=16, drop_last=True)]
        def run(mesh, accumulate):
            init, step = make_train_step(model(), mse, optax.adam(1e-2), accumulate=accumulate)
            state, losses = init(), []
            for x, y in batches:
                if mesh is not None:
                    x, y = shard_batch((x, y), mesh)
                state, loss = step(state, x, y)
                losses.append(float(loss))
            return state, losses
        ref, ref_losses = run(None, 1)
        state, losses = run(Mesh(np.array(jax.devices()), ("data",)), 2)
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        for k in ref.params:
            np.testing.assert_allclose(state.params[k], ref.params[k], atol=1e-5, rtol=1e-5)
        print("SAME")
    """)
    assert "SAME" in out, out


# ---- more models: modes, buffers, layouts, Hugging Face -------------------------------------------------
@case("training/model/batchnorm_batch_of_one_raises_torchs_error")
def _bn_one_row():
    model = _bn_net()
    init, step = make_train_step(model, _mse, optax.sgd(0.1))
    state = init()
    try:
        model(torch.randn(1, 4))
    except ValueError as e:
        expected = str(e)
    try:
        step(state, torch.randn(1, 4), torch.randn(1, 3))
    except ValueError as e:
        assert str(e) == expected, (str(e), expected)
    else:
        raise AssertionError("BatchNorm trained on one row (torch raises)")


@case("training/model/batchnorm_momentum_none_cumulative_average")
def _bn_cumulative():
    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 5, bias=False), nn.BatchNorm1d(5, momentum=None), nn.Linear(5, 3))

    _versus_torch(lambda m: torch.optim.SGD(m.parameters(), lr=0.1), optax.sgd(0.1), model_fn=build)


@case("training/model/train_true_on_an_eval_mode_module")
def _train_true():
    model = _bn_net().eval()
    ref = copy.deepcopy(model).train()
    state, losses = _jax_run(model, optax.sgd(0.1), _batches(), train=True)
    _matches(state, losses, ref, _torch_run(ref, torch.optim.SGD(ref.parameters(), lr=0.1), _batches()))


class _NonPersistent(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = _mlp()
        self.register_buffer("weights", torch.linspace(0.5, 1.5, 3), persistent=False)

    def forward(self, x):
        return self.net(x) * self.weights


@case("training/model/non_persistent_buffer")
def _non_persistent():
    model = _NonPersistent()
    ref = copy.deepcopy(model)
    state, losses = _jax_run(model, optax.sgd(0.1), _batches())
    torch_losses = _torch_run(ref, torch.optim.SGD(ref.parameters(), lr=0.1), _batches())
    close(np.array(losses), np.array(torch_losses), rtol=1e-5, atol=1e-6)
    load_into(model, state)
    for a, b in zip(model.state_dict().values(), ref.state_dict().values()):
        close(a, b, rtol=1e-5, atol=1e-5)
    equal(model.weights, ref.weights)


class _Unused(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = _mlp()
        self.spare = nn.Linear(2, 2)  # in no forward: torch leaves its .grad None, and its optimizer skips it

    def forward(self, x):
        return self.net(x)


@case("training/opt/unused_parameter_is_skipped_like_torch")
def _unused():
    _versus_torch(
        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1),
        optax.adamw(1e-2, weight_decay=0.1),
        model_fn=_Unused,
    )


@case("training/model/module_on_the_jax_device")
def _on_jax():
    model = _mlp()
    ref = copy.deepcopy(model)
    batches = _batches()
    with jaxtorch.default_env():
        model.to("jax")
        state, losses = _jax_run(model, optax.sgd(0.1), [(x.to("jax"), y.to("jax")) for x, y in batches])
    _matches(state, losses, ref, _torch_run(ref, torch.optim.SGD(ref.parameters(), lr=0.1), batches))


@case("training/model/flax_conv_layout_trains_like_torch")
def _flax_layout():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(100, 3))
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 3, 5, 5, generator=g), torch.randn(4, 3, generator=g)) for _ in range(3)]
    state, losses = _jax_run(model, optax.sgd(0.1), batches, conv_layout="flax")
    assert "0.kernel" in state.params, sorted(state.params)
    torch_losses = _torch_run(ref, torch.optim.SGD(ref.parameters(), lr=0.1), batches)
    close(np.array(losses), np.array(torch_losses), rtol=1e-5, atol=1e-6)
    load_into(model, state)
    for a, b in zip(model.state_dict().values(), ref.state_dict().values()):
        close(a.double(), b.double(), rtol=1e-5, atol=1e-5)


@case("training/accumulate/with_remat_equals_plain")
def _remat_accumulate():
    batches = _batches(n=2, rows=8)
    plain, plain_losses = _jax_run(_mlp(), optax.adam(1e-2), batches)
    both, both_losses = _jax_run(_mlp(), optax.adam(1e-2), batches, remat=True, accumulate=2)
    close(np.array(both_losses), np.array(plain_losses), rtol=1e-5, atol=1e-6)
    for k in plain.params:
        close(both.params[k], plain.params[k], rtol=1e-5, atol=1e-5)


@case("training/loss/empty_batch_mean_is_nan_like_torch")
def _empty_mean():
    model = _mlp()
    ref = copy.deepcopy(model)
    batches = [(torch.zeros(0, 4), torch.zeros(0, 3))]
    state, losses = _jax_run(model, optax.sgd(0.1), batches)
    torch_losses = _torch_run(ref, torch.optim.SGD(ref.parameters(), lr=0.1), batches)
    assert math.isnan(losses[0]) and math.isnan(torch_losses[0]), (losses, torch_losses)
    _matches(state, losses, ref, torch_losses)  # nan weights on both sides


@case("training/accumulate/hugging_face_llama_loss_in_the_model")
def _hf_llama():
    from tests._hf_models import tiny_llama

    torch.manual_seed(0)
    model = tiny_llama(max_position_embeddings=32, use_cache=False).train()
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(7))
    init, step = make_train_step(model, lambda out, _: out.loss, optax.sgd(0.1), accumulate=2)
    state, loss = step(init(), {"input_ids": ids, "labels": ids, "use_cache": False}, None)
    opt, total = torch.optim.SGD(ref.parameters(), lr=0.1), 0.0
    for part in ids.chunk(2):
        micro = ref(input_ids=part, labels=part, use_cache=False).loss / 2
        micro.backward()
        total += micro.item()
    opt.step()
    _matches(state, [float(loss)], ref, [total])


@case("training/loader/batch_encoding_is_placed_and_reaches_the_model_as_keywords")
def _batch_encoding():
    from transformers import BatchEncoding

    class Keywords(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 3)

        def forward(self, input_ids, attention_mask):
            return (self.emb(input_ids) * attention_mask[..., None]).sum(1)

    torch.manual_seed(0)
    model = Keywords()
    ref = copy.deepcopy(model)
    ids, mask = torch.randint(0, 10, (4, 5)), (torch.rand(4, 5) > 0.3).float()
    batch = next(iter(DeviceLoader([BatchEncoding({"input_ids": ids, "attention_mask": mask})])))
    assert all(isinstance(v, jax.Array) for v in batch.values()), {k: type(v) for k, v in batch.items()}
    y = torch.randn(4, 3)
    init, step = make_train_step(model, _mse, optax.sgd(0.1), donate=False)
    state, loss = step(init(), batch, y)
    direct, direct_loss = step(init(), BatchEncoding({"input_ids": ids, "attention_mask": mask}), y)  # as collated
    equal(np.asarray(direct_loss), np.asarray(loss))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    expected = F.mse_loss(ref(input_ids=ids, attention_mask=mask), y)
    expected.backward()
    opt.step()
    _matches(state, [float(loss)], ref, [expected.item()])


# ---- optax's own patterns, and the loaders' edges ---------------------------------------------------------
@case("training/opt/adamw_no_decay_on_biases_like_torch_groups")
def _no_decay_mask():
    def is_weight(params):
        return {k: k.endswith("weight") for k in params}

    def groups(m):
        decay = [p for n, p in m.named_parameters() if n.endswith("weight")]
        rest = [p for n, p in m.named_parameters() if not n.endswith("weight")]
        return torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=1e-2, weight_decay=0.1)

    _versus_torch(groups, optax.adamw(1e-2, weight_decay=0.1, mask=is_weight))


@case("training/accumulate/equals_optax_multisteps")
def _multisteps():
    x, y = _batches(1, rows=8)[0]
    acc, _ = _jax_run(_mlp(), optax.sgd(0.1, momentum=0.9), [(x, y)], accumulate=2)
    multi, _ = _jax_run(_mlp(), optax.MultiSteps(optax.sgd(0.1, momentum=0.9), 2), [(x[:4], y[:4]), (x[4:], y[4:])])
    for k in acc.params:
        close(multi.params[k], acc.params[k], rtol=1e-5, atol=1e-6)
    assert int(acc.step) == 1, acc.step  # one optimizer update per step, whatever `accumulate`


@case("training/loss/dict_targets_multi_task")
def _dict_targets():
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.a, self.b = _mlp(d_out=5), nn.Linear(5, 2), nn.Linear(5, 3)

        def forward(self, x):
            h = torch.tanh(self.body(x))
            return self.a(h), self.b(h)

    model = TwoHeads()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(8)
    x, ya, yb = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g), torch.randint(0, 3, (8,), generator=g)
    init, step = make_train_step(model, lambda o, t: _mse(o[0], t["a"]) + _xent(o[1], t["b"]), optax.sgd(0.1))
    state, loss = step(init(), x, {"a": ya, "b": yb})
    out = ref(x)
    expected = F.mse_loss(out[0], ya) + F.cross_entropy(out[1], yb)
    expected.backward()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    _matches(state, [float(loss)], ref, [expected.item()])


@case("training/state/two_inits_are_independent_under_donation")
def _two_inits():
    init, step = make_train_step(_mlp(), _mse, optax.sgd(0.1))
    a, b = init(), init()
    x, y = _batches(1)[0]
    a2, la = step(a, x, y)
    b2, lb = step(b, x, y)  # b was not donated by a's step
    equal(np.asarray(la), np.asarray(lb))
    for k in a2.params:
        equal(np.asarray(a2.params[k]), np.asarray(b2.params[k]))


@case("training/model/uint8_images_normalised_in_forward")
def _uint8():
    class Pixels(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = _mlp(d_in=6)

        def forward(self, x):
            return self.fc(x.float() / 255.0)

    model = Pixels()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(9)
    batches = [(torch.randint(0, 256, (8, 6), generator=g, dtype=torch.uint8), torch.randn(8, 3, generator=g))]
    state, losses = _jax_run(model, optax.sgd(0.1), batches)
    _matches(state, losses, ref, _torch_run(ref, torch.optim.SGD(ref.parameters(), lr=0.1), batches))


@case("training/model/mixed_precision_keeps_buffer_dtypes")
def _mp_buffers():
    model = _bn_net()
    init, step = make_train_step(model, _mse, optax.sgd(0.1), mixed_precision="bf16")
    state = init()
    for x, y in _batches():
        state, _ = step(state, x, y)
    for name, t in model.state_dict().items():
        values = {**state.params, **state.model_state}
        assert str(values[name].dtype) == str(t.dtype).replace("torch.", "").replace("int64", "int32"), (
            name,
            values[name].dtype,
            t.dtype,
        )
    assert int(state.model_state["1.num_batches_tracked"]) == 3


@case("training/loader/len_of_a_generator_is_a_clear_error")
def _len_generator():
    placed = DeviceLoader(x for x in [torch.ones(2)])
    refuses_or(lambda: len(placed), "len")
    equal(np.asarray(next(iter(placed))), np.ones(2, np.float32))


@case("training/loader/xla_loader_refuses_bad_arguments")
def _xla_bad():
    loader = [torch.ones(4)]
    for build, words in [
        (lambda: xm.MpDeviceLoader(loader, "cpu"), ("jax",)),
        (lambda: xm.MpDeviceLoader(loader, xm.xla_device(lazy=False), batchdim=1), ("batchdim",)),
        (lambda: xm.ParallelLoader(loader, batches_per_execution=0), ("batches_per_execution",)),
        (lambda: xm.MpDeviceLoader(loader, xm.xla_device(lazy=False), prefetch_size=2), ("prefetch_size",)),
    ]:
        refuses(lambda: build(), f"accepted: {words}", *words, error=(ValueError, TypeError, NotImplementedError))


@case("training/loader/mp_device_loader_batches_per_execution_marks_steps")
def _bpe():
    from jaxtorch.bridge.core import _lazy

    syncs = []
    real = _lazy.sync
    _lazy.sync = lambda: syncs.append(1)  # type: ignore[assignment]
    was = _lazy.is_enabled()
    try:
        _lazy.set_enabled(True)
        with jaxtorch.default_env():
            n = len(list(xm.MpDeviceLoader([torch.ones(2)] * 5, xm.xla_device(), batches_per_execution=2)))
    finally:
        _lazy.sync = real  # type: ignore[assignment]
        _lazy.set_enabled(was)
    assert n == 5 and len(syncs) == 3, (n, syncs)  # after batches 2, 4 and the last (5)


# ---- the step's inputs: what a loop hands it -------------------------------------------------------------
@case("training/inputs/as_torch_device_loader_batches")
def _as_torch_batches():
    model = _mlp()
    ref = copy.deepcopy(model)
    batches = _batches()
    init, step = make_train_step(model, _mse, optax.sgd(0.1))
    state, losses = init(), []
    for x, y in DeviceLoader(batches, as_torch=True):  # JaxTensors
        state, loss = step(state, x, y)
        losses.append(float(loss))
    _matches(state, losses, ref, _torch_run(ref, torch.optim.SGD(ref.parameters(), lr=0.1), batches))


@case("training/inputs/numpy_batches")
def _numpy_batches():
    model = _mlp()
    ref = copy.deepcopy(model)
    batches = _batches()
    state, losses = _jax_run(model, optax.sgd(0.1), [(x.numpy(), y.numpy()) for x, y in batches])
    _matches(state, losses, ref, _torch_run(ref, torch.optim.SGD(ref.parameters(), lr=0.1), batches))


@case("training/inputs/python_scalar_target")
def _scalar_target():
    model = _mlp()
    ref = copy.deepcopy(model)
    x, _ = _batches(1)[0]
    init, step = make_train_step(model, _mse, optax.sgd(0.1))
    state, loss = step(init(), x, 0.5)
    expected = F.mse_loss(ref(x), torch.full((8, 3), 0.5))
    expected.backward()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    _matches(state, [float(loss)], ref, [expected.item()])


@case("training/state/init_from_extract_equals_init")
def _init_from_extract():
    model = _mlp()
    params, fn = jaxtorch.extract(model, mutable=True)
    init, step = make_train_step(model, _mse, optax.adam(1e-2))
    a, b = init(), init(params=dict(params), model_state=dict(fn.state))
    x, y = _batches(1)[0]
    (a2, la), (b2, lb) = step(a, x, y), step(b, x, y)
    equal(np.asarray(la), np.asarray(lb))
    for k in a2.params:
        equal(np.asarray(a2.params[k]), np.asarray(b2.params[k]))


@case("training/state/aot_lower_compile_runs_the_same_step")
def _aot():
    model = _mlp()
    init, step = make_train_step(model, _mse, optax.sgd(0.1), donate=False)
    x, y = _batches(1)[0]
    state = init()
    compiled = step.lower(state, x, y).compile()
    (s1, l1), (s2, l2) = compiled(state, jaxtorch.to_jax(x), jaxtorch.to_jax(y), None), step(state, x, y)
    equal(np.asarray(l1), np.asarray(l2))
    for k in s1.params:
        equal(np.asarray(s1.params[k]), np.asarray(s2.params[k]))


@case("training/inputs/static_bool_with_jit_false_and_accumulate")
def _jit_false_static():
    class Flagged(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = _mlp()

        def forward(self, x, flag):
            assert flag is True, flag
            return self.net(x)

    model = Flagged()
    ref = copy.deepcopy(model)
    x, y = _batches(1)[0]
    init, step = make_train_step(model, _mse, optax.sgd(0.1), jit=False, accumulate=2)
    state, loss = step(init(), (x, True), y)
    opt, total = torch.optim.SGD(ref.parameters(), lr=0.1), 0.0
    for xs, ys in zip(x.chunk(2), y.chunk(2)):
        part = F.mse_loss(ref(xs, True), ys) / 2
        part.backward()
        total += part.item()
    opt.step()
    _matches(state, [float(loss)], ref, [total])
