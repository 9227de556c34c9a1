"""Activation checkpointing on the jax device: `torch.utils.checkpoint` (both modes) and
Hugging Face's `gradient_checkpointing_enable()`, eagerly, lazily and under `jaxtorch.jit`.

Gradients equal the unchecked run's (dropout included: the recomputation replays the
forward's random numbers), and under a trace the recomputation sits behind an
`optimization_barrier` (XLA cannot merge it back into the forward).
"""

from __future__ import annotations

import contextlib
import copy

import jax
import pytest
import torch
import transformers
from torch.utils.checkpoint import checkpoint

import jaxtorch

MODES = [True, False]
MODE_IDS = ["reentrant", "non_reentrant"]


class Net(torch.nn.Module):
    """An input layer, then residual MLP blocks (with dropout), each optionally checkpointed."""

    def __init__(self, ckpt: bool | None = None, **kw):
        super().__init__()
        self.ckpt, self.kw = ckpt, kw
        self.inp = torch.nn.Linear(8, 16)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(
                torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 16)
            )
            for _ in range(3)
        )

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = x + (b(x) if self.ckpt is None else checkpoint(b, x, use_reentrant=self.ckpt, **self.kw))
        return x.square().mean()


@pytest.fixture(scope="module")
def weights():
    torch.manual_seed(0)
    return Net().state_dict()


def _net(weights, ckpt, **kw) -> Net:
    net = Net(ckpt, **kw).train()
    net.load_state_dict(weights)
    return net.to("jax")


def _grads(net) -> dict:
    return {n: p.grad.cpu() for n, p in net.named_parameters()}


def _eager(net, x, ctx=contextlib.nullcontext):
    torch.manual_seed(5)
    with ctx():
        loss = net(x)
        loss.backward()
    return float(loss.detach().cpu()), _grads(net)


@pytest.fixture(scope="module")
def x():
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(1)).to("jax")


@pytest.mark.parametrize("reentrant", MODES, ids=MODE_IDS)
def test_eager_gradients_equal_unchecked(weights, x, reentrant):
    loss0, g0 = _eager(_net(weights, None), x)
    loss1, g1 = _eager(_net(weights, reentrant), x)
    assert loss1 == loss0
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=0, atol=0, msg=n)


@pytest.mark.parametrize("reentrant", MODES, ids=MODE_IDS)
def test_lazy_gradients_equal_unchecked(weights, x, reentrant):
    loss0, g0 = _eager(_net(weights, None), x, jaxtorch.lazy)
    loss1, g1 = _eager(_net(weights, reentrant), x, jaxtorch.lazy)
    assert loss1 == pytest.approx(loss0, rel=1e-6)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], msg=n)


@contextlib.contextmanager
def _programs(record: list):
    """Record the programs `jaxtorch.jit` compiles, with their arguments."""
    original = jax.jit

    def spy(fn, **kw):
        jitted = original(fn, **kw)
        if not any(s in getattr(fn, "__qualname__", "") for s in ("traced", "_with_vjp")):  # the step program
            return jitted

        def call(*args):
            record.append((jitted, args))
            return jitted(*args)

        return call

    jax.jit = spy
    try:
        yield
    finally:
        jax.jit = original


def _jit(net, x, record=None):
    @jaxtorch.jit
    def step(net, x):
        loss = net(x)
        loss.backward()
        return loss

    with _programs(record if record is not None else []):
        loss = step(net, x, rng=jax.random.key(7))  # the same key: the same dropout masks
    return float(loss.cpu()), _grads(net)


@pytest.mark.parametrize("reentrant", MODES, ids=MODE_IDS)
def test_jit_gradients_equal_unchecked_and_recompute_is_behind_a_barrier(weights, x, reentrant):
    plain, ckpt = [], []
    loss0, g0 = _jit(_net(weights, None), x, plain)
    loss1, g1 = _jit(_net(weights, reentrant), x, ckpt)
    assert loss1 == pytest.approx(loss0, rel=1e-6)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], msg=n)
    count = [rec[-1][0].lower(*rec[-1][1]).as_text().count("optimization_barrier") for rec in (plain, ckpt)]
    assert count == [0, 3]  # one barrier per checkpointed block's recomputation


def test_dropout_masks_replayed_even_when_checkpoint_draws_differ(weights, x):
    """preserve_rng_state=True (default) makes the recomputation draw the forward's masks;
    the gradients then equal the unchecked run's (checked above). With it off, torch too
    recomputes with fresh draws: the gradients differ from the unchecked run's."""
    _, g0 = _eager(_net(weights, None), x)
    _, g1 = _eager(_net(weights, False, preserve_rng_state=False), x)
    assert any(not torch.equal(g0[n], g1[n]) for n in g0)


def test_kwargs_and_non_tensor_arguments(weights):
    lin = torch.nn.Linear(4, 4).to("jax")
    x = torch.randn(2, 4, device="jax", requires_grad=True)

    def f(a, scale, *, shift):
        return lin(a) * scale + shift

    out = checkpoint(f, x, 2.0, shift=torch.ones(4, device="jax"), use_reentrant=False)
    out.sum().backward()
    gx, gw = x.grad.cpu().clone(), lin.weight.grad.cpu().clone()
    x.grad, lin.weight.grad = None, None
    (lin(x) * 2.0 + 1).sum().backward()
    torch.testing.assert_close(gx, x.grad.cpu(), rtol=0, atol=0)
    torch.testing.assert_close(gw, lin.weight.grad.cpu(), rtol=0, atol=0)


def test_checkpoint_on_cpu_is_untouched():
    lin = torch.nn.Linear(3, 3)
    x = torch.randn(2, 3, requires_grad=True)
    checkpoint(lin, x, use_reentrant=False).sum().backward()
    assert x.grad is not None and lin.weight.grad is not None


# ---- Hugging Face: gradient_checkpointing_enable() -------------------------------------------
@pytest.fixture(scope="module")
def llama_cpu():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=64,
        max_position_embeddings=32,
        attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(cfg).train()


@pytest.fixture(scope="module")
def llama_reference(llama_cpu):
    """Loss and gradients of the unchecked CPU model (torch eager)."""
    model = copy.deepcopy(llama_cpu)
    ids = _ids()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return float(loss), {n: p.grad.clone() for n, p in model.named_parameters()}


def _ids():
    return torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))


@pytest.fixture
def globally():
    jaxtorch.enable_globally()  # (HF's factories with device="jax" need the modes)
    yield
    jaxtorch.disable_globally()


@pytest.mark.parametrize("where", ["eager", "lazy", "jit"])
@pytest.mark.parametrize("reentrant", MODES, ids=MODE_IDS)
def test_hf_gradient_checkpointing_matches_cpu(llama_cpu, llama_reference, globally, reentrant, where):
    loss0, g0 = llama_reference
    model = copy.deepcopy(llama_cpu).to("jax")
    model.gradient_checkpointing_enable({"use_reentrant": reentrant})
    assert model.is_gradient_checkpointing
    ids = _ids().to("jax")
    if where != "jit":
        with jaxtorch.lazy() if where == "lazy" else contextlib.nullcontext():
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
    else:

        @jaxtorch.jit
        def step(model, ids):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            return loss

        loss = step(model, ids)
    assert float(loss.cpu()) == pytest.approx(loss0, rel=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad.cpu(), g0[n], rtol=1e-4, atol=1e-6, msg=n)


def test_non_reentrant_backward_twice_with_retain_graph(weights, x):
    net = _net(weights, False)
    torch.manual_seed(5)
    loss = net(x)
    loss.backward(retain_graph=True)
    once = _grads(net)
    loss.backward()
    for n, g in _grads(net).items():
        torch.testing.assert_close(g, 2 * once[n], msg=n)
