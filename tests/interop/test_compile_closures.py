"""Tensors and modules a `jaxtorch.jit` function reaches through closures and globals
(issue 23, item 7): read at every call as program inputs (a new value: no recompilation; a
new shape: one), and written back like arguments. The reference is eager torch.
"""

from __future__ import annotations

import numpy as np
import torch

import jaxtorch

SCALE = torch.ones(3)  # a global tensor the functions below read


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    np.testing.assert_allclose(a.detach().cpu().numpy(), b.detach().cpu().numpy(), rtol=1e-6, atol=1e-6)


def test_closed_over_module_sees_in_place_weight_updates():
    lin = torch.nn.Linear(3, 2)

    @jaxtorch.jit
    def predict(x):
        return lin(x)

    x = torch.randn(4, 3)
    _close(predict(x), lin(x))
    with torch.no_grad():
        lin.weight.add_(1.0)
    _close(predict(x), lin(x))
    lin.bias = torch.nn.Parameter(torch.full((2,), 7.0))  # a new parameter object, same shape
    _close(predict(x), lin(x))
    assert predict.compilations == 1


def test_closed_over_tensor_sees_in_place_changes():
    c = torch.ones(3)
    d = torch.ones(3, device="jax")

    @jaxtorch.jit
    def f(x):
        return x * c + d

    x = torch.randn(3)
    _close(f(x), x * c + d.cpu())
    c.add_(10)
    d.mul_(3)
    _close(f(x), x * c + d.cpu())
    assert f.compilations == 1


def test_global_tensor_is_read_each_call_and_a_new_shape_recompiles():
    global SCALE

    @jaxtorch.jit
    def f(x):
        return x * SCALE

    x = torch.randn(3)
    try:
        _close(f(x), x)
        SCALE = torch.full((3,), 2.0)  # another tensor under the name: read, not recompiled
        _close(f(x), x * 2)
        assert f.compilations == 1
        SCALE = torch.full((1,), 5.0)  # another shape: one new program
        _close(f(x), x * 5)
        assert f.compilations == 2
    finally:
        SCALE = torch.ones(3)


def test_writes_to_closed_over_tensors_are_written_back():
    total = torch.zeros(2)
    hits = torch.zeros((), device="jax")

    @jaxtorch.jit
    def f(x):
        total.add_(x)
        hits.add_(1)
        return x.sum()

    for _ in range(3):
        f(torch.ones(2))
    assert total.tolist() == [3.0, 3.0] and float(hits.cpu()) == 3.0
    assert f.compilations == 1


def test_a_closed_over_tensor_also_passed_as_argument_is_one_tensor():
    c = torch.zeros(2)

    @jaxtorch.jit
    def f(x):
        x.add_(1)
        return c * 1  # eager: c is x, so it sees the write

    _close(f(c), torch.ones(2))
    assert c.tolist() == [1.0, 1.0]


def test_closed_over_batchnorm_writes_its_statistics():
    ref = torch.nn.BatchNorm1d(3)
    bn = torch.nn.BatchNorm1d(3)

    @jaxtorch.jit
    def f(x):
        return bn(x)

    for _ in range(2):
        x = torch.randn(5, 3)
        _close(f(x), ref(x))
    _close(bn.running_mean, ref.running_mean)
    _close(bn.running_var, ref.running_var)


def test_closed_over_module_gets_gradients():
    ref = torch.nn.Linear(3, 2)
    lin = torch.nn.Linear(3, 2)
    lin.load_state_dict(ref.state_dict())

    @jaxtorch.jit
    def loss(x):
        return lin(x).pow(2).sum()

    x = torch.randn(4, 3)
    loss(x).backward()
    ref(x).pow(2).sum().backward()
    _close(lin.weight.grad, ref.weight.grad)
    _close(lin.bias.grad, ref.bias.grad)


class _Scaler:
    def __init__(self):
        self.factor = torch.full((2,), 2.0)

    def apply(self, x):
        return x * self.factor


def test_bound_method_reads_its_objects_tensors_each_call():
    s = _Scaler()
    f = jaxtorch.jit(s.apply)
    x = torch.ones(2)
    _close(f(x), x * 2)
    s.factor.fill_(4.0)
    _close(f(x), x * 4)
    assert f.compilations == 1


def test_closure_read_in_a_comprehension():
    layers = torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(2)])
    first = layers[0]

    @jaxtorch.jit
    def f(xs):
        return [first(x) for x in xs]

    xs = [torch.randn(1, 2), torch.randn(1, 2)]
    with torch.no_grad():
        f(xs)
        first.weight.zero_()  # seen by the compiled function on its next call
        got = f(xs)
    for g, x in zip(got, xs):
        _close(g, first(x))


def test_closed_over_leaf_tensor_gets_its_gradient():
    w = torch.randn(3, requires_grad=True)
    wr = w.detach().clone().requires_grad_()

    @jaxtorch.jit
    def f(x):
        return (x * w).tanh().sum()

    x = torch.randn(3)
    f(x).backward()
    (x * wr).tanh().sum().backward()
    _close(w.grad, wr.grad)
