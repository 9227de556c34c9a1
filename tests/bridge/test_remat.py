"""Remat (torch's activation checkpointing) on the jax device: `torch.utils.checkpoint` (both modes) and
Hugging Face's `activation_checkpointing_enable()`, eagerly, lazily and under `jaxtorch.jit`.

Gradients equal the unchecked run's (dropout included: the recomputation replays the
forward's random numbers). Under a trace each region is one `jax.checkpoint`: the program
keeps only the regions' inputs for the backward (measured as the in-order peak of live bytes,
`benchmarks/_liveness.py`, which does not depend on a backend's scheduler), and a
recomputation driven by torch's backward sits behind an `optimization_barrier`.
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
from benchmarks._liveness import peak_live_bytes, programs_recorded
from tests._hf_models import tiny_llama_config

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


def _jit(net, x, record=None):
    @jaxtorch.jit
    def step(net, x):
        loss = net(x)
        loss.backward()
        return loss

    with programs_recorded(record if record is not None else []):
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


# ---- Hugging Face: activation_checkpointing_enable() -------------------------------------------
@pytest.fixture(scope="module")
def llama_cpu():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(
        tiny_llama_config(max_position_embeddings=32, attn_implementation="sdpa")
    ).train()


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
def test_hf_remat_matches_cpu(llama_cpu, llama_reference, globally, reentrant, where, monkeypatch):
    from jaxtorch.bridge.dispatch import _remat_jax

    traced: list = []  # under jit: why each region went to torch's checkpoint (None: it is a jax.checkpoint)
    original = _remat_jax._trace
    monkeypatch.setattr(
        _remat_jax, "_trace", lambda *a, **k: traced.append(original(*a, **k).torchs_way) or original(*a, **k)
    )
    loss0, g0 = llama_reference
    model = copy.deepcopy(llama_cpu).to("jax")
    model.activation_checkpointing_enable({"use_reentrant": reentrant})
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
        assert traced == [None] * llama_cpu.config.num_hidden_layers
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


# ---- remat under a trace: each region is one jax.checkpoint -------------------------------------
def _count(jaxpr, primitive: str = "remat2") -> int:
    """How many equations of `primitive` `jaxpr` holds, nested ones included (by default
    `jax.checkpoint` regions, whose primitive is `remat2`)."""
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name == primitive
        for p in eqn.params.values():
            for q in p if isinstance(p, (tuple, list)) else (p,):
                inner = getattr(q, "jaxpr", q)
                if hasattr(inner, "eqns"):
                    n += _count(inner, primitive)
    return n


class Wide(torch.nn.Module):
    """Residual MLP blocks wide enough that activations dominate the program's memory."""

    def __init__(self, ckpt: bool | None, blocks: int = 4, dim: int = 64):
        super().__init__()
        self.ckpt = ckpt
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))
            for _ in range(blocks)
        )

    def forward(self, x):
        for b in self.blocks:
            x = x + (b(x) if self.ckpt is None else checkpoint(b, x, use_reentrant=self.ckpt))
        return x.square().mean()


@pytest.fixture(scope="module")
def wide_weights():
    torch.manual_seed(0)
    return Wide(None).state_dict()


def _wide(wide_weights, ckpt) -> Wide:
    m = Wide(ckpt)
    m.load_state_dict(wide_weights)
    return m


def _wide_x():
    return torch.randn(256, 64, generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("ckpt", [None, *MODES], ids=["unchecked", *MODE_IDS])
def test_jax_first_grad_is_remat(wide_weights, ckpt):
    """extract + jax.grad (the make_train_step path): the regions are jax.checkpoint, the
    gradients equal CPU torch's and the in-order peak of live bytes drops."""
    params, fn = jaxtorch.extract(_wide(wide_weights, ckpt))
    x = jaxtorch.to_jax(_wide_x())
    grad = jax.grad(lambda p: fn(p, x))
    jaxpr = jax.make_jaxpr(grad)(params).jaxpr
    ref = _wide(wide_weights, None)
    ref(_wide_x()).backward()
    g = grad(params)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(jaxtorch.to_torch(g[n]), p.grad, rtol=1e-5, atol=1e-6, msg=n)
    assert _count(jaxpr) == (0 if ckpt is None else 4)
    unchecked = jax.make_jaxpr(jax.grad(lambda p: jaxtorch.extract(_wide(wide_weights, None))[1](p, x)))(params)
    if ckpt is not None:  # 4 blocks of 256 x 256 activations: only the blocks' inputs are kept
        assert peak_live_bytes(jaxpr) < 0.6 * peak_live_bytes(unchecked.jaxpr)


@pytest.mark.parametrize("reentrant", MODES, ids=MODE_IDS)
def test_jit_backward_inside_keeps_only_region_inputs(wide_weights, reentrant):
    """`loss.backward()` inside jaxtorch.jit: torch's autograd drives the backward through one
    node per region; the program's in-order peak drops and the gradients equal CPU torch's."""
    peaks, grads = [], []
    for ckpt in (None, reentrant):
        net = _wide(wide_weights, ckpt).to("jax")
        x = _wide_x().to("jax").requires_grad_(reentrant)  # (reentrant: an input must require grad)
        record: list = []
        with programs_recorded(record):

            @jaxtorch.jit
            def step(net, x):
                loss = net(x)
                loss.backward()
                return loss.detach()

            step(net, x)
        jitted, args = record[-1]
        jaxpr = jitted.trace(*args).jaxpr.jaxpr
        # torch's backward recomputes each region behind a barrier (the forward runs inline)
        assert _count(jaxpr, "optimization_barrier") == (0 if ckpt is None else 4)
        peaks.append(peak_live_bytes(jaxpr))
        grads.append({n: p.grad.cpu() for n, p in net.named_parameters()})
    ref = _wide(wide_weights, None)
    ref(_wide_x()).backward()
    for n, p in ref.named_parameters():
        for g in grads:
            torch.testing.assert_close(g[n], p.grad, rtol=1e-5, atol=1e-6, msg=n)
    assert peaks[1] < 0.75 * peaks[0]


class BNBlock(torch.nn.Module):
    def __init__(self, reentrant: bool):
        super().__init__()
        self.reentrant = reentrant
        self.lin = torch.nn.Linear(6, 6)
        self.bn = torch.nn.BatchNorm1d(6)

    def forward(self, x):
        return checkpoint(lambda h: self.bn(self.lin(h)), x, use_reentrant=self.reentrant).square().mean()


@pytest.mark.parametrize("reentrant", MODES, ids=MODE_IDS)
def test_state_written_in_a_region_under_jit_matches_torch(reentrant):
    """torch's recomputation writes the region's state again (BatchNorm's statistics are
    updated twice: pytorch/pytorch#96136); torch's backward inside jaxtorch.jit does the same."""
    torch.manual_seed(0)
    cpu = BNBlock(reentrant).train()
    net = copy.deepcopy(cpu).to("jax")
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(4))
    cpu(x.clone().requires_grad_()).backward()

    @jaxtorch.jit
    def step(net, x):
        loss = net(x)
        loss.backward()
        return loss.detach()

    step(net, x.to("jax").requires_grad_())
    assert int(net.bn.num_batches_tracked.cpu()) == int(cpu.bn.num_batches_tracked) == 2
    for name in ("running_mean", "running_var"):
        torch.testing.assert_close(getattr(net.bn, name).cpu(), getattr(cpu.bn, name), msg=name)
    for n, p in cpu.named_parameters():
        torch.testing.assert_close(dict(net.named_parameters())[n].grad.cpu(), p.grad, msg=n)


def test_state_written_in_a_region_under_jax_grad_lands_once():
    """extract(mutable=True) + jax.grad: JAX's recomputation writes nothing, so the new state is
    the forward's (one BatchNorm update, as the unchecked model's forward gives)."""
    torch.manual_seed(0)
    m = BNBlock(False).train()
    unchecked = copy.deepcopy(m)
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(4))
    params, fn = jaxtorch.extract(m, mutable=True)
    _, new_state = jax.grad(lambda p: fn(p, jaxtorch.to_jax(x)), has_aux=True)(params)
    unchecked.bn(unchecked.lin(x))
    assert int(new_state["bn.num_batches_tracked"]) == 1
    torch.testing.assert_close(jaxtorch.to_torch(new_state["bn.running_mean"]), unchecked.bn.running_mean)


def test_dropout_in_a_region_replayed_under_jax_grad():
    """The region draws from the call's key (an input of the region): the recomputation replays
    the forward's masks, so the gradients equal the unchecked function's with the same key."""

    class Drop(torch.nn.Module):
        def __init__(self, ckpt):
            super().__init__()
            self.ckpt, self.lin = ckpt, torch.nn.Linear(16, 16)

        def forward(self, x):
            f = lambda h: torch.nn.functional.dropout(self.lin(h), 0.5, training=True)
            return (checkpoint(f, x, use_reentrant=False) if self.ckpt else f(x)).square().sum()

    torch.manual_seed(0)
    a = Drop(False)
    b = Drop(True)
    b.load_state_dict(a.state_dict())
    x = jax.numpy.ones((8, 16))
    grads = []
    for m in (a, b):
        params, fn = jaxtorch.extract(m)
        grads.append(jax.jit(jax.grad(lambda p, fn=fn: fn(p, x, rng=jax.random.key(3))))(params))
    for n in grads[0]:
        assert jax.numpy.array_equal(grads[0][n], grads[1][n]), n
    assert float(jax.numpy.abs(grads[1]["lin.weight"]).sum()) > 0


def test_region_outputs_keep_structure_dtypes_and_statics():
    """Non-tensor and None results come back as they were; an int32 result stays int32."""
    lin = torch.nn.Linear(4, 4)
    params, fn_ = jaxtorch.extract(lin)

    def region(h):
        y = h * 2
        return {"y": y, "idx": y.argmax(-1).to(torch.int32), "tag": "ok", "none": None}

    def f(x):
        out = checkpoint(region, x, use_reentrant=False)
        assert out["tag"] == "ok" and out["none"] is None and out["idx"].dtype == torch.int32
        return out["y"].sum() + out["idx"].float().sum()

    got = jax.jit(lambda x: jaxtorch.call_torch(f, x))(jax.numpy.arange(8.0).reshape(2, 4))
    assert float(got) == float(f(torch.arange(8.0).reshape(2, 4)))


def test_region_closing_over_a_tensor_with_history_runs_torchs_checkpoint(weights):
    """A region that reads a non-leaf tensor requiring grad from outside (not an argument) is
    not a jax.checkpoint (the gradient must flow into that tensor's own graph): torch's
    checkpoint runs it, and the gradients still equal eager CPU torch's."""

    def run(lin, x, dev):
        a = lin(x)  # a non-leaf requiring grad, read by the region through its closure
        out = checkpoint(lambda h: (h * a).sin(), x, use_reentrant=False)
        return out.sum()

    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(3, 4)
    run(lin, x, "cpu").backward()
    ref = lin.weight.grad.clone()
    lin.weight.grad = None
    net = copy.deepcopy(lin).to("jax")

    @jaxtorch.jit
    def step(net, x):
        loss = run(net, x, "jax")
        loss.backward()
        return loss.detach()

    step(net, x.to("jax"))
    torch.testing.assert_close(net.weight.grad.cpu(), ref)


# ---- hostile inputs to the remat path -----------------------------------------------------------
def test_region_returning_its_argument_or_a_view_aliases_it_as_torch_does():
    """torch's non-reentrant checkpoint returns what the function returns: the argument itself,
    or a view a later in-place write goes through. Such a region is handed to torch's
    checkpoint under a trace too, so the aliasing holds."""

    def f(x):
        same = checkpoint(lambda h: h, x, use_reentrant=False)
        view = checkpoint(lambda h: h[0], x, use_reentrant=False)
        view.add_(10)
        return same is x, x.clone()

    ref_same, ref = f(torch.arange(6.0).reshape(2, 3))

    @jaxtorch.jit
    def g(x):
        same, out = f(x)
        assert same == ref_same
        return out

    torch.testing.assert_close(g(torch.arange(6.0).reshape(2, 3).to("jax")).cpu(), ref)


def test_a_region_that_raises_leaves_state_as_it_was():
    """An error inside the region propagates; the writes it made before are undone (no traced
    value stays in a module tensor), and the module works afterwards."""

    class Raising(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bn, self.fail = torch.nn.BatchNorm1d(3), True

        def region(self, h):
            h = self.bn(h)
            if self.fail:
                raise ValueError("boom")
            return h

        def forward(self, x):
            return checkpoint(self.region, x, use_reentrant=False).sum()

    m = Raising().train()
    params, fn = jaxtorch.extract(m, mutable=True)
    x = jax.numpy.arange(12.0).reshape(4, 3)
    with pytest.raises(ValueError, match="boom"):
        jax.jit(fn)(params, x)
    assert int(m.bn.num_batches_tracked) == 0
    torch.testing.assert_close(m.bn.running_mean, torch.zeros(3))
    m.fail = False
    _, state = jax.jit(fn)(params, x)
    assert int(state["bn.num_batches_tracked"]) == 1


def test_nested_regions_and_vmap_under_jax_grad():
    """A checkpoint inside a checkpoint, under jax.vmap and jax.grad: both are regions and the
    per-example gradients equal the unchecked function's."""

    class Nest(torch.nn.Module):
        def __init__(self, ckpt):
            super().__init__()
            self.ckpt, self.a, self.b = ckpt, torch.nn.Linear(5, 5), torch.nn.Linear(5, 5)

        def forward(self, x):
            inner = lambda h: self.b(h).tanh()
            outer = lambda h: checkpoint(inner, self.a(h), use_reentrant=False) if self.ckpt else inner(self.a(h))
            return (checkpoint(outer, x, use_reentrant=False) if self.ckpt else outer(x)).square().sum()

    torch.manual_seed(0)
    plain, nested = Nest(False), Nest(True)
    nested.load_state_dict(plain.state_dict())
    xs = jax.random.normal(jax.random.key(0), (3, 5))
    grads, counts = [], []
    for m in (plain, nested):
        params, fn = jaxtorch.extract(m)
        g = jax.vmap(jax.grad(lambda p, x, fn=fn: fn(p, x)), in_axes=(None, 0))
        counts.append(_count(jax.make_jaxpr(g)(params, xs).jaxpr))
        grads.append(g(params, xs))
    assert counts[0] == 0 and counts[1] >= 2  # (JAX's AD may copy a nested region into forward and backward)
    for n in grads[0]:
        assert jax.numpy.allclose(grads[0][n], grads[1][n], rtol=1e-6, atol=1e-6), n


@pytest.mark.parametrize("reentrant", MODES, ids=MODE_IDS)
def test_hf_remat_in_make_train_step_is_one_region_per_layer(llama_cpu, reentrant):
    """make_train_step of a Llama after activation_checkpointing_enable(): each decoder layer is a
    jax.checkpoint region in the step, and two SGD steps give the unchecked model's losses and
    weights."""
    import optax

    def loss_fn(out, _):
        return out.loss

    ids = jaxtorch.to_jax(_ids())
    results = []
    for ckpt in (False, True):
        model = copy.deepcopy(llama_cpu)
        if ckpt:
            model.activation_checkpointing_enable({"use_reentrant": reentrant})
        init, step = jaxtorch.train.make_train_step(model, loss_fn, optax.sgd(0.1), jit=False)
        state = init()
        regions = _count(jax.make_jaxpr(lambda s: step(s, {"input_ids": ids, "labels": ids}, None))(state).jaxpr)
        losses = []
        for _ in range(2):
            state, loss = jax.jit(step)(state, {"input_ids": ids, "labels": ids}, None)
            losses.append(float(loss))
        results.append((regions, losses, state.params))
    assert results[0][0] == 0 and results[1][0] == llama_cpu.config.num_hidden_layers
    assert results[1][1] == pytest.approx(results[0][1], rel=1e-5)
    for n in results[0][2]:
        assert jax.numpy.allclose(results[0][2][n], results[1][2][n], rtol=1e-5, atol=1e-6), n


@pytest.mark.parametrize("reentrant", MODES, ids=MODE_IDS)
def test_hf_remat_through_compiled_module_backward(llama_cpu, llama_reference, globally, reentrant):
    """`jaxtorch.compile(model)(...).loss.backward()`: the compiled call's VJP differentiates the
    regions (jax.checkpoint under jax.vjp); the gradients equal eager CPU torch's."""
    loss0, g0 = llama_reference
    model = copy.deepcopy(llama_cpu).to("jax")
    model.activation_checkpointing_enable({"use_reentrant": reentrant})
    ids = _ids().to("jax")
    loss = jaxtorch.compile(model)(input_ids=ids, labels=ids).loss
    loss.backward()
    assert float(loss.detach().cpu()) == pytest.approx(loss0, rel=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad.cpu(), g0[n], rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("where", ["eager", "jit"])
def test_selective_checkpoint_contexts_and_checkpoint_sequential(where):
    """torch's selective activation checkpointing (`context_fn` with a policy) and
    `checkpoint_sequential` give CPU torch's gradients; the random-state replay makes no torch
    tensor inside the recomputation (a selective policy would see an op the forward did not run)."""
    import functools

    from torch.utils.checkpoint import CheckpointPolicy, checkpoint_sequential, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

    context_fn = functools.partial(create_selective_checkpoint_contexts, policy)

    def run(m, x):
        a = checkpoint(m, x, use_reentrant=False, context_fn=context_fn).sum()
        return a + checkpoint_sequential(m, 2, x, use_reentrant=False).sum()

    torch.manual_seed(0)
    cpu = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 4))
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    run(cpu, x).backward()
    m = copy.deepcopy(cpu).to("jax")
    for p in m.parameters():
        p.grad = None
    if where == "eager":
        run(m, x.to("jax")).backward()
    else:

        @jaxtorch.jit
        def step(m, x):
            loss = run(m, x)
            loss.backward()
            return loss.detach()

        step(m, x.to("jax"))
    for (n, p), q in zip(cpu.named_parameters(), m.parameters()):
        torch.testing.assert_close(q.grad.cpu(), p.grad, msg=n)


def _jit_backward(fn, *args):
    """Run `fn(*args)` (a scalar loss) and its backward inside one jaxtorch.jit program."""

    @jaxtorch.jit
    def step(*args):
        loss = fn(*args)
        loss.backward()
        return loss.detach()

    return step(*args)


def _arg_in_place(lin, x, seen):
    h = lin(x)
    out = checkpoint(lambda h: h.mul_(3) + 1, h, use_reentrant=False)
    return h.sum() + out.square().sum()  # (h was tripled by the region)


def _shared_results(lin, x, seen):
    a, b = checkpoint(lambda h: (lambda y: (y, y))(lin(h)), x, use_reentrant=False)
    a.mul_(2)  # (b is a: it sees the write)
    return b.square().sum()


def _tensor_hook(lin, x, seen):
    def region(h):
        y = lin(h)
        y.register_hook(lambda g: seen.append(g.sum()))
        return y.tanh()

    return checkpoint(region, x, use_reentrant=False).square().sum()


def _module_hook(lin, x, seen):
    handle = lin.register_full_backward_hook(lambda m, gi, go: seen.append(go[0].sum()))
    try:
        return checkpoint(lambda h: lin(h).tanh(), x, use_reentrant=False).square().sum()
    finally:
        handle.remove()


@pytest.mark.parametrize("case", [_arg_in_place, _shared_results, _tensor_hook, _module_hook])
def test_regions_torch_must_run_keep_eager_semantics(case):
    """Regions a jax.checkpoint cannot express with eager torch's meaning go to torch's
    checkpoint under a trace too: an argument written in place (the caller sees the write),
    results sharing data (a write through one shows in the other), a hook registered on a
    tensor inside or a module's backward hook (they fire). (`retain_grad()` inside a region also
    goes to torch's checkpoint, which leaves `.grad` None for any tensor subclass, on the CPU too.)"""
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 3)
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(5))
    seen_cpu: list = []
    loss = case(lin, x, seen_cpu)
    loss.backward()
    net = copy.deepcopy(lin).to("jax")
    seen: list = []

    @jaxtorch.jit
    def step(net, x):
        loss = case(net, x, seen)
        loss.backward()
        return loss.detach(), [t.detach() for t in seen]

    got, observed = step(net, x.to("jax"))
    assert float(got.cpu()) == pytest.approx(float(loss.detach()), rel=1e-6)
    for n, p in lin.named_parameters():
        torch.testing.assert_close(dict(net.named_parameters())[n].grad.cpu(), p.grad, msg=n)
    expected = seen_cpu
    assert len(observed) == len(expected) == (0 if case in (_arg_in_place, _shared_results) else 1)
    for o, e in zip(observed, expected):
        torch.testing.assert_close(o.cpu(), e)


def test_regions_traced_in_two_threads_keep_their_own_state_writes():
    """Each thread's region records only its own thread's writes: two threads tracing
    extract(mutable=True) + jax.grad of their own checkpointed BatchNorm block at once each get
    the unchecked forward's statistics (one update) and the same gradients.

    (Two threads each running `loss.backward()` inside jaxtorch.jit at once fail with JAX's
    UnexpectedTracerError with or without remat: torch runs both backwards on one
    autograd thread, which adopts the trace last published. Not covered here.)"""
    import threading

    torch.manual_seed(0)
    m = BNBlock(False).train()
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(4))
    unchecked = copy.deepcopy(m)
    unchecked.bn(unchecked.lin(x))
    results: list = []

    def train(module):
        try:
            params, fn = jaxtorch.extract(module, mutable=True)
            results.append(jax.jit(jax.grad(lambda p: fn(p, jaxtorch.to_jax(x)), has_aux=True))(params))
        except BaseException as e:  # (reported below)
            results.append(e)

    threads = [threading.Thread(target=train, args=(copy.deepcopy(m),)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not [r for r in results if isinstance(r, BaseException)], results
    (g0, s0), (g1, s1) = results
    for s in (s0, s1):
        assert int(s["bn.num_batches_tracked"]) == 1
        torch.testing.assert_close(jaxtorch.to_torch(s["bn.running_mean"]), unchecked.bn.running_mean)
    for n in g0:
        assert jax.numpy.array_equal(g0[n], g1[n]), n
