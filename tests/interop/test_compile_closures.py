"""Tensors and modules a `jaxtorch.jit` function reaches through closures and globals
(issue 23, item 7): read at every call as program inputs (a new value: no recompilation; a
new shape: one), and written back like arguments. The reference is eager torch.
"""

from __future__ import annotations

import numpy as np
import pytest
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


# ---- guards on Python values (issue 30, item 1): checked at every call, a change compiles again ----
RATE = 2.0  # a global Python number the functions below read
FLAGS = {"scale": 2.0, "shift": True}


def test_a_global_float_is_guarded_and_the_recompilation_is_counted():
    global RATE

    def f(x):
        return x * RATE

    fast = jaxtorch.jit(f)
    x = torch.randn(3)
    try:
        _close(fast(x), f(x))
        RATE = 3.0
        _close(fast(x), f(x))  # was x * 2.0: the value baked in at the first trace
        _close(fast(x), f(x))  # unchanged now: no new trace
        assert fast.compilations == 2 and fast.recompilations == 1
        assert fast.stats()["reasons"] == ["global `RATE` changed"]
        RATE = 2.0
        _close(fast(x), f(x))  # back to the first value: its program is reused
        assert fast.compilations == 2
    finally:
        RATE = 2.0


def test_a_closure_cell_and_a_dict_value_are_guarded():
    scale = 2.0

    def f(x):
        y = x * scale * FLAGS["scale"]
        return y + 1 if FLAGS["shift"] else y

    fast = jaxtorch.jit(f)
    x = torch.randn(3)
    try:
        _close(fast(x), f(x))
        scale = 5.0
        _close(fast(x), f(x))
        FLAGS["scale"] = -1.0
        _close(fast(x), f(x))
        FLAGS["shift"] = False
        _close(fast(x), f(x))
        assert fast.compilations == 4
        assert fast.stats()["reasons"][0] == "closure `scale` changed"
        assert fast.stats()["reasons"][1] == "global `FLAGS` changed"
    finally:
        FLAGS.update(scale=2.0, shift=True)


def test_tensors_in_a_closed_over_list_and_dict_are_inputs_read_at_every_call():
    held = [torch.ones(3)]
    named = {"bias": torch.zeros(3)}

    def f(x):
        return x * held[0] + named["bias"]

    fast = jaxtorch.jit(f)
    x = torch.randn(3)
    _close(fast(x), f(x))
    held[0] = torch.full((3,), 7.0)  # replaced: the stale tensor must not be used
    named["bias"] = torch.full((3,), -1.0)
    _close(fast(x), f(x))
    held[0].mul_(2)  # written in place
    _close(fast(x), f(x))
    assert fast.compilations == 1  # same shapes: inputs, not constants


def test_writes_to_tensors_in_a_closed_over_list_are_written_back():
    acc = [torch.zeros(2)]

    @jaxtorch.jit
    def f(x):
        acc[0].add_(x)
        return x.sum()

    for _ in range(3):
        f(torch.ones(2))
    assert acc[0].tolist() == [3.0, 3.0]


def test_a_forward_hook_added_after_the_first_call_runs():
    lin = torch.nn.Linear(3, 2)
    fast = jaxtorch.compile(lin)
    x = torch.randn(4, 3)
    _close(fast(x), lin(x))
    handle = lin.register_forward_hook(lambda m, args, out: out * 10)
    _close(fast(x), lin(x))  # was the hook-less program
    pre = lin.register_forward_pre_hook(lambda m, args: (args[0] + 1,))
    _close(fast(x), lin(x))
    handle.remove()
    pre.remove()
    _close(fast(x), lin(x))
    assert fast.compilations == 3  # the hook-less program is reused at the end
    assert "hooks" in fast.stats()["reasons"][0]


def test_a_hook_on_a_closed_over_submodule_and_a_global_module_hook_run():
    net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))

    @jaxtorch.jit
    def f(x):
        return net(x)

    x = torch.randn(4, 3)
    _close(f(x), net(x))
    handle = net[1].register_forward_hook(lambda m, args, out: out + 3)
    _close(f(x), net(x))
    handle.remove()
    glob = torch.nn.modules.module.register_module_forward_hook(lambda m, args, out: out * 2)
    try:
        _close(f(x), net(x))
    finally:
        glob.remove()
    _close(f(x), net(x))


def test_a_module_attribute_and_a_submodule_mode_are_guarded():
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 3)
            self.drop = torch.nn.Dropout(0.5)
            self.scale = 2.0

        def forward(self, x):
            return self.drop(self.lin(x)) * self.scale

    m = Scaled().eval()
    fast = jaxtorch.compile(m)
    x = torch.randn(4, 3)
    _close(fast(x), m(x))
    m.scale = -1.5
    _close(fast(x), m(x))
    m.drop.p = 0.0
    m.drop.train()  # a submodule's mode (the top module stays in eval)
    _close(fast(x), m(x))
    assert fast.compilations == 3


def test_an_attribute_of_a_closed_over_object_is_guarded():
    class Config:
        def __init__(self):
            self.alpha = 0.5
            self.offset = torch.zeros(3)

    cfg = Config()

    def f(x):
        return x * cfg.alpha + cfg.offset

    fast = jaxtorch.jit(f)
    x = torch.randn(3)
    _close(fast(x), f(x))
    cfg.alpha = 4.0
    _close(fast(x), f(x))
    cfg.offset = torch.ones(3)  # a new tensor: compiled again with it
    _close(fast(x), f(x))
    assert fast.compilations == 3


@pytest.mark.parametrize("device", ["cpu", "jax"])
def test_an_in_place_write_to_a_closed_over_objects_tensor_is_seen(device):
    class Config:
        offset = None

    cfg = Config()
    cfg.offset = torch.ones(3, device=device)

    def f(x):
        return x + cfg.offset

    fast = jaxtorch.jit(f)
    x = torch.zeros(3, device=device)
    _close(fast(x), f(x))
    cfg.offset.add_(1)
    _close(fast(x), f(x))
    with torch.no_grad():
        cfg.offset.mul_(3)
    _close(fast(x), f(x))
    if device == "jax":  # a write through .data bumps no torch version counter: jaxtorch's own count sees it
        cfg.offset.data.fill_(7)
        _close(fast(x), f(x))
    cfg.offset[0] = -1
    _close(fast(x), f(x))
    compiled = fast.compilations
    _close(fast(x), f(x))
    assert fast.compilations == compiled  # no write, no new program


def test_assigning_a_global_or_nonlocal_name_raises_naming_it():
    count = 0

    def bump(x):
        nonlocal count
        count += 1
        return x + 1

    with pytest.raises(jaxtorch.StateWriteError, match="`count`.*once per compilation"):
        jaxtorch.jit(bump)(torch.ones(2))
    assert count == 0

    def set_rate(x):
        global RATE
        RATE = 9.0
        return x

    with pytest.raises(jaxtorch.StateWriteError, match="`RATE`"):
        jaxtorch.jit(set_rate)(torch.ones(2))
    assert RATE == 2.0


def test_a_value_changing_at_every_call_warns_after_eight_recompilations():
    step = [0]

    @jaxtorch.jit
    def f(x):
        return x * step[0]

    x = torch.ones(2)
    with pytest.warns(UserWarning, match=r"compiled 9 times \(the last: closure `step` changed\)"):
        for i in range(10):
            step[0] = i
            _close(f(x), x * i)
    assert f.recompilations == 9
