"""`jaxtorch.compile` of a whole train step written in torch (issue 5, item 4).

The reference is the same loop run eagerly by PyTorch on the CPU.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import jaxtorch


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 16), torch.nn.GELU(), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 3)
    )


def _batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(n)]


def _assert_same_state(ref, model, rtol=1e-4, atol=1e-5):
    for (name, a), b in zip(ref.state_dict().items(), model.state_dict().values()):
        np.testing.assert_allclose(a.numpy(), b.cpu().numpy(), rtol=rtol, atol=atol, err_msg=name)


def _torch_step(model, opt, x, y):
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss


# On the jax device (as on CUDA) torch.optim takes its foreach path by default; the CPU
# reference is told to take it too, since SGD's nesterov step then also writes `p.grad`.
@pytest.mark.parametrize(
    "make_opt",
    [
        lambda p, **kw: torch.optim.Adam(p, lr=1e-2, **kw),
        lambda p, **kw: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, **kw),
        lambda p, **kw: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, **kw),
    ],
    ids=["adam", "adamw", "sgd-momentum"],
)
def test_train_step_with_modules_as_arguments_matches_eager_torch(make_opt):
    ref, model = _model(), _model().to("jax")
    ropt, opt = make_opt(ref.parameters(), foreach=True), make_opt(model.parameters())
    step = jaxtorch.jit(_torch_step)
    for x, y in _batches(6):
        expected = _torch_step(ref, ropt, x, y)
        got = step(model, opt, x, y)
        np.testing.assert_allclose(float(got.cpu()), float(expected), rtol=1e-5)
    _assert_same_state(ref, model)  # parameters and BatchNorm running statistics
    for p, q in zip(ref.parameters(), model.parameters()):  # grads land on the parameters
        np.testing.assert_allclose(p.grad.numpy(), q.grad.cpu().numpy(), rtol=1e-4, atol=1e-6)
    # the first step creates the optimizer state (a new signature); after that, no retrace
    assert step.compilations == 2


def _scheduled_side_by_side(make_opt, make_sched, compile_fn):
    """Six steps of `_torch_step` with a scheduler after each, eagerly on CPU torch and compiled on
    the jax device: (ref model, jax model, ref optimizer, jax optimizer, compiled step)."""
    ref, model = _model(), _model().to("jax")
    ropt, opt = make_opt(ref.parameters()), make_opt(model.parameters())
    rsched, sched = make_sched(ropt), make_sched(opt)
    step = compile_fn(_torch_step)
    for x, y in _batches(6):
        _torch_step(ref, ropt, x, y)
        rsched.step()
        step(model, opt, x, y)
        sched.step()
    _assert_same_state(ref, model)
    return ref, model, ropt, opt, step


def test_lr_scheduler_between_steps_does_not_recompile_adam():
    ref, model, ropt, opt, step = _scheduled_side_by_side(
        lambda p: torch.optim.Adam(p, lr=1e-2),
        lambda o: torch.optim.lr_scheduler.StepLR(o, 2, gamma=0.5),
        jaxtorch.compile,
    )
    assert step.compilations == 2
    assert opt.param_groups[0]["lr"] == ropt.param_groups[0]["lr"] == 1e-2 / 8
    # the optimizer keeps working eagerly afterwards, from the compiled state
    x, y = _batches(1, seed=7)[0]
    _torch_step(ref, ropt, x, y)
    _torch_step(model, opt, x.to("jax"), y.to("jax"))
    _assert_same_state(ref, model)


def test_closed_over_state_and_gradient_accumulation():
    ref, model = _model(), _model().to("jax")
    ropt, opt = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)

    def accumulate(m, x, y):  # no zero_grad: .grad adds up across calls, as in torch
        (F.cross_entropy(m(x), y) / 2).backward()

    acc = jaxtorch.compile(lambda x, y: accumulate(model, x, y), state=(model,))
    batches = _batches(4)
    for i in range(0, 4, 2):
        for x, y in batches[i : i + 2]:
            accumulate(ref, x, y)
            acc(x, y)
        for p, q in zip(ref.parameters(), model.parameters()):
            np.testing.assert_allclose(p.grad.numpy(), q.grad.cpu().numpy(), rtol=1e-4, atol=1e-6)
        ropt.step(), opt.step()
        ropt.zero_grad(), opt.zero_grad()
    _assert_same_state(ref, model)
    assert acc.compilations == 2  # grads absent, then present


def test_frozen_parameters_stay_bit_identical():
    model = _model().to("jax")
    model[0].requires_grad_(False)
    frozen = model[0].weight.cpu().clone()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    step = jaxtorch.jit(_torch_step)
    for x, y in _batches(3):
        step(model, opt, x, y)
    assert torch.equal(model[0].weight.cpu(), frozen)
    assert model[0].weight.grad is None
    assert model[3].weight.grad is not None


def test_dropout_in_a_compiled_step_follows_torch_manual_seed():
    def run(seed):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.Dropout(0.5), torch.nn.Linear(32, 3)).to("jax")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        step = jaxtorch.jit(_torch_step)
        torch.manual_seed(seed)
        return [float(step(model, opt, x, y).cpu()) for x, y in _batches(3)]

    a, b, c = run(1), run(1), run(2)
    assert a == b  # reproducible from the seed
    assert a != c  # and the masks really are random


def test_no_tracer_leaks_when_the_step_fails():
    model = _model().to("jax")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    before = [p.cpu().clone() for p in model.parameters()]

    @jaxtorch.jit
    def bad_step(model, opt, x):
        model(x).sum().backward()
        opt.step()
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        bad_step(model, opt, torch.randn(8, 4))
    for p, b in zip(model.parameters(), before):  # the objects hold their concrete values again
        assert torch.equal(p.cpu(), b)
        assert p.grad is None
    assert len(opt.state) == 0
    _torch_step(model, opt, torch.randn(8, 4).to("jax"), torch.zeros(8, dtype=torch.long).to("jax"))


def test_cpu_module_in_a_train_step_gets_a_clear_error():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = jaxtorch.jit(lambda m, o, x: m(x).sum().backward())
    with pytest.raises(TypeError, match=r"model.to\('jax'\)"):
        step(model, opt, torch.ones(1, 2))


@pytest.mark.parametrize(
    ("make_opt", "make_sched"),
    [
        (lambda p: torch.optim.SGD(p, lr=0.1), lambda o: torch.optim.lr_scheduler.StepLR(o, 2, gamma=0.5)),
        (
            lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01),
            lambda o: torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.7),
        ),
        (lambda p: torch.optim.RMSprop(p, lr=1e-2), lambda o: torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5)),
        (
            lambda p: torch.optim.RMSprop(p, lr=1e-2, momentum=0.9, centered=True),
            lambda o: torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.8),
        ),
    ],
    ids=["sgd-steplr", "sgd-momentum-exponential", "rmsprop-steplr", "rmsprop-centered-exponential"],
)
def test_lr_scheduler_between_steps_does_not_recompile_sgd_rmsprop(make_opt, make_sched):
    """Issue 30 item 20: the learning rate is a program input (6 steps compiled 6 times before)."""
    _, _, ropt, opt, step = _scheduled_side_by_side(make_opt, make_sched, jaxtorch.jit)
    assert opt.param_groups[0]["lr"] == ropt.param_groups[0]["lr"]
    assert step.compilations == 2  # the first step creates the optimizer state; then one program
