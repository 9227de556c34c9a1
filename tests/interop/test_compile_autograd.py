"""Autograd through `jaxtorch.compile` / `jaxtorch.jit` (issue 23, item 6).

A compiled call's results are differentiable with respect to module parameters and tensor
arguments: backward runs one compiled VJP program, so `compiled(x).backward(); opt.step()`
trains exactly as eager torch. The reference is the same loop run eagerly on the CPU.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import jaxtorch


def _net(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3))


def _batches(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(6, 4, generator=g), torch.randint(0, 3, (6,), generator=g)) for _ in range(n)]


def _same(ref: torch.nn.Module, model: torch.nn.Module) -> None:
    for (name, a), b in zip(ref.state_dict().items(), model.state_dict().values()):
        np.testing.assert_allclose(a.numpy(), b.cpu().numpy(), rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("device", ["cpu", "jax"])
@pytest.mark.parametrize("make_opt", [lambda p: torch.optim.SGD(p, lr=0.1), lambda p: torch.optim.Adam(p, lr=1e-2)])
def test_compiled_module_trains_as_eager(device, make_opt):
    ref, model = _net(), _net().to(device)
    ropt, opt = make_opt(ref.parameters()), make_opt(model.parameters())
    fast = jaxtorch.compile(model)
    for x, y in _batches(4):
        ropt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        ropt.step()
        opt.zero_grad()
        loss = F.cross_entropy(fast(x.to(device)), y.to("jax"))  # results are jax tensors
        loss.backward()
        for p in model.parameters():
            assert p.grad is not None and p.grad.device == p.device
        opt.step()
    _same(ref, model)  # parameters and the BatchNorm statistics the forward wrote
    assert fast.compilations == 1


def test_gradient_of_arguments_and_parameters_matches_eager():
    ref, model = _net().eval(), _net().eval()
    x = torch.randn(5, 4, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    s = torch.randn(5, 3)
    (ref(xr) * s).sum().backward()
    out = jaxtorch.compile(model)(x)
    assert out.requires_grad
    (out * s.to("jax")).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), xr.grad.numpy(), rtol=1e-5, atol=1e-6)
    for p, q in zip(ref.parameters(), model.parameters()):
        np.testing.assert_allclose(q.grad.numpy(), p.grad.numpy(), rtol=1e-5, atol=1e-6)


def test_jit_function_with_two_tensor_arguments():
    @jaxtorch.jit
    def f(a, b):
        return (a * b).sin().sum(), (a - b).exp()

    a, b = torch.randn(3, requires_grad=True), torch.randn(3, device="jax", requires_grad=True)
    ar, br = a.detach().clone().requires_grad_(), b.detach().cpu().requires_grad_()
    s, e = f(a, b)
    (s + e.sum()).backward()
    sr, er = (ar * br).sin().sum(), (ar - br).exp()
    (sr + er.sum()).backward()
    assert b.grad.device.type == "jax" and a.grad.device.type == "cpu"
    np.testing.assert_allclose(a.grad.numpy(), ar.grad.numpy(), rtol=1e-6)
    np.testing.assert_allclose(b.grad.cpu().numpy(), br.grad.numpy(), rtol=1e-6)


def test_tensor_arguments_keep_requires_grad_inside():
    @jaxtorch.jit
    def grad_of_cube(x):
        (g,) = torch.autograd.grad((x**3).sum(), x)
        return g, x.requires_grad

    x = torch.randn(4, requires_grad=True)
    g, flag = grad_of_cube(x)
    np.testing.assert_allclose(g.cpu().numpy(), (3 * x.detach() ** 2).numpy(), rtol=1e-6)
    assert bool(flag) and not g.requires_grad  # as eager: grad without create_graph is a constant


def test_no_grad_costs_no_vjp():
    model = _net().eval()
    fast = jaxtorch.compile(model)
    with torch.no_grad():
        out = fast(torch.randn(2, 4))
    assert not out.requires_grad and out.grad_fn is None
    x = torch.randn(2, 4)
    model.requires_grad_(False)
    out = fast(x)
    assert not out.requires_grad  # nothing requires grad: the plain program
    model.requires_grad_(True)
    assert fast(x).requires_grad


def test_backward_is_one_compiled_program_and_second_backward_is_refused():
    model = _net().eval()
    fast = jaxtorch.compile(model)
    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match="once differentiable"):
        torch.autograd.grad(fast(x).sum(), x, create_graph=True)
    (g,) = torch.autograd.grad(fast(x).sum(), x)  # first order: fine
    assert g.shape == x.shape


def test_outputs_not_depending_on_grads_do_not_require_grad():
    @jaxtorch.jit
    def f(x, y):
        return x * 2, y + 1, x.argmax()

    a, b, i = f(torch.randn(3, requires_grad=True), torch.randn(3))
    assert a.requires_grad and not b.requires_grad and not i.requires_grad


def test_tiny_hf_model_trains_with_compiled_loss():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=32, n_positions=16)
    torch.manual_seed(0)
    ref = transformers.GPT2LMHeadModel(cfg)
    ref.config.attn_pdrop = ref.config.resid_pdrop = ref.config.embd_pdrop = 0.0
    ref.eval()  # no dropout: the two runs draw no random numbers
    model = copy.deepcopy(ref).to("jax")
    # SGD: the key bias has an exactly-zero gradient, which Adam would turn into rounding noise
    ropt, opt = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
    fast = jaxtorch.compile(model)
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(3))
    for _ in range(3):
        ropt.zero_grad()
        ref(ids, labels=ids).loss.backward()
        ropt.step()
        opt.zero_grad()
        out = fast(ids.to("jax"), labels=ids.to("jax"))
        out.loss.backward()
        opt.step()
    for (name, a), b in zip(ref.state_dict().items(), model.state_dict().values()):
        np.testing.assert_allclose(a.numpy(), b.cpu().numpy(), rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("device", ["cpu", "jax"])
def test_call_jax_double_backward_matches_torch(device):
    import jax.numpy as jnp

    w = torch.randn(3, device=device, requires_grad=True)
    y = jaxtorch.call_jax(lambda a: jnp.sum(jnp.sin(a) ** 3), w)
    (g,) = torch.autograd.grad(y, w, create_graph=True)
    (g * g).sum().backward()
    wr = w.detach().cpu().requires_grad_()
    (gr,) = torch.autograd.grad((wr.sin() ** 3).sum(), wr, create_graph=True)
    (gr * gr).sum().backward()
    np.testing.assert_allclose(g.detach().cpu().numpy(), gr.detach().numpy(), rtol=1e-5)
    np.testing.assert_allclose(w.grad.cpu().numpy(), wr.grad.numpy(), rtol=1e-5)
    assert w.grad.device == w.device


def test_jit_function_taking_a_module_is_differentiable():
    ref = _net().eval()
    model = copy.deepcopy(ref).to("jax")

    @jaxtorch.jit
    def forward(m, x):
        return m(x)

    x = torch.randn(5, 4)
    forward(model, x.to("jax")).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    for p, q in zip(ref.parameters(), model.parameters()):
        np.testing.assert_allclose(q.grad.cpu().numpy(), p.grad.numpy(), rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        assert not forward(model, x.to("jax")).requires_grad
