"""Autograd through compiled code, closures, views and aliasing across `jaxtorch.jit` (issue 23 items 6-8)."""

from __future__ import annotations

import contextlib
import threading

import jax.numpy as jnp
import torch
from torch import nn

import jaxtorch

from .harness import case, close, equal, refuses_or


@case("compiled/module_params_get_grads")
def _module_grads():
    torch.manual_seed(0)
    lin = nn.Linear(3, 2)
    ref = nn.Linear(3, 2)
    ref.load_state_dict(lin.state_dict())
    x, s = torch.randn(4, 3), torch.randn(4, 2)
    s_jax = jaxtorch.torch_view(jaxtorch.to_jax(s))  # compiled results live on the jax device
    (jaxtorch.compile(lin)(x) * s_jax).sum().backward()
    (ref(x) * s).sum().backward()
    assert lin.weight.grad is not None, "compiled forward left the module's grads None"
    close(lin.weight.grad, ref.weight.grad)
    close(lin.bias.grad, ref.bias.grad)


@case("compiled/input_grad")
def _input_grad():
    lin = nn.Linear(3, 2)
    x = torch.randn(4, 3, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    jaxtorch.compile(lin)(x).pow(2).sum().backward()
    lin(x2).pow(2).sum().backward()
    close(x.grad, x2.grad)


@case("compiled/sgd_steps_equal_eager")
def _sgd():
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))
    b = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))
    b.load_state_dict(a.state_dict())
    fa = jaxtorch.compile(a)
    oa, ob = torch.optim.SGD(a.parameters(), 0.1), torch.optim.SGD(b.parameters(), 0.1)
    x, y = torch.randn(16, 3), torch.randn(16, 1)
    y_jax = jaxtorch.torch_view(jaxtorch.to_jax(y))  # compiled results live on the jax device
    for _ in range(3):
        for f, o, target in ((fa, oa, y_jax), (b, ob, y)):
            o.zero_grad()
            ((f(x) - target) ** 2).mean().backward()
            o.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        close(pa.detach(), pb.detach(), rtol=1e-5, atol=1e-6)


@case("compiled/jit_arg_keeps_requires_grad")
def _keeps_requires_grad():
    @jaxtorch.jit
    def f(x):
        assert x.requires_grad
        return (x * x).sum()

    x = torch.randn(3, requires_grad=True)
    f(x).backward()
    close(x.grad, 2 * x.detach())


@case("compiled/no_grad_needed_still_works")
def _no_grad():
    lin = nn.Linear(3, 2)
    with torch.no_grad():
        close(jaxtorch.compile(lin)(torch.ones(1, 3)), lin(torch.ones(1, 3)))


@case("compiled/call_jax_double_backward")
def _double_backward():
    def check():
        f = jaxtorch.jax_function_to_torch(lambda a: jnp.sin(a).sum())
        x = torch.tensor([0.3, 0.7], requires_grad=True)
        (g,) = torch.autograd.grad(f(x), x, create_graph=True)
        (gg,) = torch.autograd.grad(g.sum(), x)
        close(gg, -torch.sin(x.detach()))

    refuses_or(check, "once", "double", "create_graph", "higher-order")


# ---- closures are read at every call --------------------------------------------------------------
@case("closure/module_weight_updated_in_place")
def _closure_module():
    lin = nn.Linear(2, 1)

    @jaxtorch.jit
    def predict(x):
        return lin(x)

    x = torch.ones(1, 2)
    predict(x)
    with torch.no_grad():
        lin.weight.add_(1.0)
        expected = lin(x)
    close(predict(x), expected)


@case("closure/tensor_add_")
def _closure_tensor():
    c = torch.ones(3)

    @jaxtorch.jit
    def f(x):
        return x + c

    f(torch.zeros(3))
    c.add_(10)
    equal(f(torch.zeros(3)).cpu(), torch.full((3,), 11.0))


_GLOBAL_SCALE = torch.ones(2)


@case("closure/global_tensor")
def _global():
    @jaxtorch.jit
    def f(x):
        return x * _GLOBAL_SCALE

    f(torch.ones(2))
    _GLOBAL_SCALE.mul_(3)
    try:
        equal(f(torch.ones(2)).cpu(), torch.full((2,), 3.0))
    finally:
        _GLOBAL_SCALE.fill_(1.0)


@case("closure/module_swapped_parameter")
def _swapped():
    lin = nn.Linear(2, 1, bias=False)

    @jaxtorch.jit
    def f(x):
        return lin(x)

    f(torch.ones(1, 2))
    lin.weight = nn.Parameter(torch.full((1, 2), 2.0))
    close(f(torch.ones(1, 2)), torch.full((1, 1), 4.0))


# ---- views and aliasing across the boundary -------------------------------------------------------
@case("alias/overlapping_views_as_args")
def _overlap():
    def f(a, b):
        a.add_(1)
        return b * 1

    base = torch.zeros(4)
    expected = f(base, base[1:])
    base2 = torch.zeros(4)
    got = jaxtorch.jit(f)(base2, base2[1:])
    equal(got.cpu(), expected)
    equal(base2, base)


@case("alias/return_input_aliases")
def _return_input():
    x = torch.zeros(3)
    out = jaxtorch.jit(lambda a: a)(x)
    refuses_or(lambda: (out.add_(1), equal(x, torch.ones(3))), "alias", "view")


@case("alias/inplace_on_arg_visible")
def _inplace_arg():
    x = torch.zeros(3)
    jaxtorch.jit(lambda a: a.add_(2))(x)
    equal(x, torch.full((3,), 2.0))


@case("alias/view_arg_inplace_writes_base")
def _view_arg():
    base = torch.zeros(2, 3)
    jaxtorch.jit(lambda a: a.mul_(0).add_(5))(base[0])
    equal(base, torch.tensor([[5.0, 5.0, 5.0], [0.0, 0.0, 0.0]]))


# ---- threads ----------------------------------------------------------------------------------------
def _add_from_threads(n_threads: int, n_adds: int, *, lazy: bool) -> None:
    """`n_threads` threads each add 1 `n_adds` times to one shared jax scalar (in lazy mode or
    not): no update may be lost."""
    with jaxtorch.default_env():
        t = torch.zeros((), device="jax")

    def work():
        with jaxtorch.default_env(), jaxtorch.lazy() if lazy else contextlib.nullcontext():
            for _ in range(n_adds):
                t.add_(1)

    threads = [threading.Thread(target=work) for _ in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    with jaxtorch.default_env():
        assert float(t.cpu()) == n_threads * n_adds, float(t.cpu())


@case("threads/inplace_shared_tensor_no_lost_update")
def _threads_inplace():
    _add_from_threads(4, 50, lazy=False)


@case("threads/lazy_inplace_shared_tensor")
def _threads_lazy():
    _add_from_threads(3, 30, lazy=True)
