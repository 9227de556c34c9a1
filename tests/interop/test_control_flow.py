"""torch.cond / while_loop / scan / map on the jax device: one lax op under a JAX trace, eager and
lazy runs, values and gradients against eager CPU torch, and the refusals (`ControlFlowError`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch._higher_order_ops.map import map as torch_map
from torch._higher_order_ops.scan import scan as torch_scan
from torch._higher_order_ops.scan import scan_op
from torch._higher_order_ops.while_loop import while_loop

import jaxtorch
from jaxtorch.bridge.core._errors import ControlFlowError, DataDependentError


class Branchy(torch.nn.Module):
    """A forward with a data-dependent branch reading parameters from both branches."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda x: self.a(x).tanh(), lambda x: self.b(x) * 2.0, (x,))

    def reference(self, x):  # torch.cond on CPU, as a Python `if`: in torch 2.13 a CPU torch.cond fails once
        # any torch.cond ran under a TorchDispatchMode in the process (dynamo caches the skipped frame)
        return self.a(x).tanh() if x.sum() > 0 else self.b(x) * 2.0


def _np(t):
    return np.asarray(t.detach().cpu() if isinstance(t, torch.Tensor) else t)


def _cpu_grads(m, x):
    m.zero_grad()
    out = m.reference(x)
    out.sum().backward()
    return out.detach(), {n: torch.zeros_like(p) if p.grad is None else p.grad.clone() for n, p in m.named_parameters()}


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_cond_extract_jit_and_grad_match_torch(sign):
    m = Branchy()
    x = torch.randn(3, 4).abs() * sign
    ref, ref_g = _cpu_grads(m, x)
    params, fn = jaxtorch.extract(m)
    xj = jnp.asarray(x.numpy())
    out = jax.jit(fn)(params, xj)
    np.testing.assert_allclose(np.asarray(out), _np(ref), rtol=1e-5, atol=1e-6)
    g = jax.jit(jax.grad(lambda p: fn(p, xj).sum()))(params)
    for n, v in ref_g.items():
        np.testing.assert_allclose(np.asarray(g[n]), _np(v), rtol=1e-5, atol=1e-6)


def test_cond_is_one_lax_cond_in_the_program():
    params, fn = jaxtorch.extract(Branchy())
    text = str(jax.make_jaxpr(fn)(params, jnp.ones((3, 4))))
    assert text.count("cond[") == 1


def test_cond_eager_with_torch_autograd():
    m = Branchy()
    x = -torch.rand(3, 4)
    ref, ref_g = _cpu_grads(m, x)
    mj = Branchy().to("jax")
    with jaxtorch.default_env():
        out = mj(x.to("jax"))
        out.sum().backward()
    np.testing.assert_allclose(_np(out), _np(ref), rtol=1e-5, atol=1e-6)
    for n, p in mj.named_parameters():
        np.testing.assert_allclose(_np(p.grad), _np(ref_g[n]), rtol=1e-5, atol=1e-6)


def test_cond_lazy():
    m = Branchy()
    x = torch.rand(3, 4)
    ref = m.reference(x)
    mj = Branchy().to("jax")
    with jaxtorch.default_env(), jaxtorch.lazy():
        out = mj(x.to("jax") * 1.0)
        got = _np(out)
    np.testing.assert_allclose(got, _np(ref), rtol=1e-5, atol=1e-6)


def test_cond_in_jaxtorch_jit_train_step():
    torch.manual_seed(1)
    m_cpu, m = Branchy(), Branchy().to("jax")
    opt_cpu = torch.optim.SGD(m_cpu.parameters(), lr=0.1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x = torch.randn(3, 4)

    @jaxtorch.jit
    def step(model, opt, x):
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        return loss

    for _ in range(3):
        opt_cpu.zero_grad()
        loss_cpu = m_cpu.reference(x).pow(2).mean()
        loss_cpu.backward()
        opt_cpu.step()
        loss = step(m, opt, x.to("jax"))
        np.testing.assert_allclose(_np(loss), _np(loss_cpu), rtol=1e-5, atol=1e-6)
    for (n, p), q in zip(m.named_parameters(), m_cpu.parameters()):
        np.testing.assert_allclose(_np(p), _np(q), rtol=1e-5, atol=1e-6, err_msg=n)


class Looped(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.w = torch.nn.Parameter(torch.randn(4, 4) * 0.3)

    def forward(self, x):
        i0 = torch.zeros((), dtype=torch.int64, device=x.device)
        _, y = while_loop(lambda i, h: i < 3, lambda i, h: (i + 1, torch.tanh(h @ self.w) + h), (i0, x))
        return y

    def python_loop(self, x):
        for _ in range(3):
            x = torch.tanh(x @ self.w) + x
        return x


def test_while_loop_values_and_grads_match_a_python_loop():
    m = Looped()
    x = torch.randn(2, 4)
    xr = x.clone().requires_grad_(True)
    ref = m.python_loop(xr)
    ref.sum().backward()
    params, fn = jaxtorch.extract(m)
    xj = jnp.asarray(x.numpy())
    np.testing.assert_allclose(np.asarray(jax.jit(fn)(params, xj)), _np(ref), rtol=1e-5, atol=1e-5)
    gp, gx = jax.jit(jax.grad(lambda p, a: fn(p, a).sum(), argnums=(0, 1)))(params, xj)
    np.testing.assert_allclose(np.asarray(gp["w"]), _np(m.w.grad), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(gx), _np(xr.grad), rtol=1e-4, atol=1e-5)
    text = str(jax.make_jaxpr(fn)(params, xj))
    assert text.count("while[") == 1


def test_while_loop_eager_torch_autograd():
    m = Looped()
    x = torch.randn(2, 4)
    ref = m.python_loop(x)
    ref.sum().backward()
    mj = Looped().to("jax")
    with jaxtorch.default_env():
        out = mj(x.to("jax"))
        out.sum().backward()
    np.testing.assert_allclose(_np(out), _np(ref), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(_np(mj.w.grad), _np(m.w.grad), rtol=1e-4, atol=1e-5)


class Scanned(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.w = torch.nn.Parameter(torch.randn(4, 4) * 0.3)

    def forward(self, h, xs):
        def step(c, x):
            n = torch.tanh(c @ self.w + x)
            return n, n * 2.0

        return torch_scan(step, h, xs)

    def reference(self, h, xs):  # (torch's scan on CPU, as a Python loop: see `Branchy.reference`)
        ys = []
        for x in xs:
            h = torch.tanh(h @ self.w + x)
            ys.append(h * 2.0)
        return h, torch.stack(ys)


def test_scan_values_and_grads_match_torch():
    m = Scanned()
    h, xs = torch.randn(2, 4), torch.randn(5, 2, 4)
    c_ref, ys_ref = m.reference(h, xs)
    (c_ref.sum() + ys_ref.sum()).backward()
    params, fn = jaxtorch.extract(m)
    hj, xj = jnp.asarray(h.numpy()), jnp.asarray(xs.numpy())
    c, ys = jax.jit(fn)(params, hj, xj)
    np.testing.assert_allclose(np.asarray(c), _np(c_ref), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(ys), _np(ys_ref), rtol=1e-5, atol=1e-6)
    g = jax.grad(lambda p: sum(o.sum() for o in fn(p, hj, xj)))(params)
    np.testing.assert_allclose(np.asarray(g["w"]), _np(m.w.grad), rtol=1e-4, atol=1e-5)
    assert str(jax.make_jaxpr(fn)(params, hj, xj)).count("scan[") == 1


def test_map_matches_torch():
    xs, w = torch.randn(3, 2), torch.randn(2)
    ref = torch.stack([(x * w).sin() for x in xs])  # (torch's map on CPU, as a Python loop)
    out = jaxtorch.call_torch(
        lambda a, b: torch_map(lambda x, w: (x * w).sin(), a, b), *map(jnp.asarray, (xs.numpy(), w.numpy()))
    )
    np.testing.assert_allclose(np.asarray(out), _np(ref), rtol=1e-6)


def _call(f, *arrays):
    return jaxtorch.call_torch(f, *[jnp.asarray(a) for a in arrays])


def test_python_if_on_traced_value_names_torch_cond():
    def f(x):
        return x.sin() if x.sum() > 0 else x.cos()

    with pytest.raises(DataDependentError, match="torch.cond"):
        jax.jit(lambda a: _call(f, a))(np.ones(3, np.float32))


@pytest.mark.parametrize(
    "fn, words",
    [
        (lambda x: torch.cond(x.sum() > 0, lambda x: x, lambda x: x + 1, (x,)), "one of its inputs"),
        (lambda x: torch.cond(x.sum() > 0, lambda x: x.add_(1), lambda x: x + 1, (x,)), "writes in place"),
        (lambda x: torch.cond(x.sum() > 0, lambda x: x[:2].sin(), lambda x: x.cos(), (x,)), "different things"),
        (lambda x: torch.cond(x.sum() > 0, lambda x: x.int(), lambda x: x.cos(), (x,)), "different things"),
        (
            lambda x: while_loop(lambda x: x.sum() < 10, lambda x: (torch.cat([x, x]),), (x,)),
            "changes the carry",
        ),
        (lambda x: while_loop(lambda x: x.sum() < 10, lambda x: (x.half(),), (x,)), "changes the carry"),
        (lambda x: scan_op(lambda c, y: (c + y, c), [x[0]], [x[:0]], ()), "at least one"),
    ],
)
def test_refusals(fn, words):
    x = np.ones((3,), np.float32) * 0.5
    with pytest.raises(ControlFlowError, match=words):
        jax.jit(lambda a: _call(fn, a))(x)


def test_write_to_outside_tensor_is_refused():
    outside = torch.zeros(3, device="jax")

    def f(x):
        def t(x):
            outside.add_(1)
            return x.sin()

        return torch.cond(x.sum() > 0, t, lambda x: x.cos(), (x,))

    with pytest.raises(ControlFlowError, match="from outside the body"):
        jax.jit(lambda a: _call(f, a))(np.ones(3, np.float32))
    np.testing.assert_array_equal(_np(outside), np.zeros(3))


def test_torch_refuses_an_empty_scan_before_jaxtorch_sees_it():
    with pytest.raises(RuntimeError, match="scan dimension > 0"):
        _call(lambda x: torch_scan(lambda c, y: (c + y, c), x[0], x[:0]), np.ones((3, 2), np.float32))


@pytest.mark.parametrize("inference", [False, True])
def test_cond_under_the_dispatch_mode_eagerly(inference):
    x = torch.tensor([0.5, -1.0, 2.0])
    ctx = torch.inference_mode() if inference else torch.no_grad()
    with jaxtorch.default_env(), ctx:  # (inference mode: the kernel at the Python key, below autograd)
        out = torch.cond(x.to("jax").sum() < 0, lambda x: x.sin(), lambda x: x.cos() * 3, (x.to("jax"),))
    np.testing.assert_allclose(_np(out), _np(x.cos() * 3), rtol=1e-6)


class ClosesOverActivation(torch.nn.Module):
    """A branch reading a tensor computed before the call (not a leaf): its gradient reaches `lin`."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(4)
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x):
        h = self.lin(x)
        return torch.cond(x.sum() > 0, lambda x: x * h, lambda x: x.cos(), (x,))

    def reference(self, x):
        h = self.lin(x)
        return x * h if x.sum() > 0 else x.cos()


@pytest.mark.parametrize("path", ["extract", "jaxtorch.jit", "eager"])
def test_closure_with_autograd_history_gets_its_gradient(path):
    m = ClosesOverActivation()
    x = torch.rand(2, 3)
    m.reference(x).sum().backward()
    mj = ClosesOverActivation().to("jax")
    if path == "extract":
        params, fn = jaxtorch.extract(ClosesOverActivation())
        got = jax.grad(lambda p: fn(p, jnp.asarray(x.numpy())).sum())(params)["lin.weight"]
    elif path == "jaxtorch.jit":

        @jaxtorch.jit
        def step(model, x):
            out = model(x)
            out.sum().backward()
            return out

        step(mj, x.to("jax"))
        got = mj.lin.weight.grad
    else:
        with jaxtorch.default_env():
            mj(x.to("jax")).sum().backward()
        got = mj.lin.weight.grad
    np.testing.assert_allclose(_np(got), _np(m.lin.weight.grad), rtol=1e-5, atol=1e-6)


def test_cond_in_make_train_step():
    import optax

    from jaxtorch.train import make_train_step

    m, mc = Branchy(), Branchy()
    init, step = make_train_step(m, lambda out, y: ((out - y) ** 2).mean(), optax.sgd(0.1))
    state = init()
    x, y = torch.rand(3, 4), torch.zeros(3, 4)
    opt = torch.optim.SGD(mc.parameters(), lr=0.1)
    for _ in range(2):
        state, loss = step(state, jnp.asarray(x.numpy()), jnp.asarray(y.numpy()))
        opt.zero_grad()
        ref = ((mc.reference(x) - y) ** 2).mean()
        ref.backward()
        opt.step()
        np.testing.assert_allclose(float(loss), float(ref), rtol=1e-5)


def test_scan_reverse_along_dim_1_matches_a_python_loop():
    h, xs = torch.zeros(2), torch.randn(2, 4)
    c, ys = h.clone(), [None] * 4
    for i in reversed(range(4)):
        ys[i] = c * 1.0
        c = c + xs[:, i]

    def f(h, xs):
        return torch_scan(lambda c, x: (c + x, c * 1.0), h, xs, reverse=True, dim=1)

    carry, out = jax.jit(lambda a, b: _call(f, a, b))(h.numpy(), xs.numpy())
    np.testing.assert_allclose(np.asarray(carry), _np(c), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(out), _np(torch.stack(ys, 1)), rtol=1e-6)


def test_scan_lazy():
    m = Scanned()
    h, xs = torch.randn(2, 4), torch.randn(5, 2, 4)
    c_ref, ys_ref = m.reference(h, xs)
    mj = Scanned().to("jax")
    with jaxtorch.default_env(), jaxtorch.lazy():
        c, ys = mj(h.to("jax") * 1.0, xs.to("jax") * 1.0)
        got = _np(ys), _np(c)
    np.testing.assert_allclose(got[0], _np(ys_ref), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[1], _np(c_ref), rtol=1e-5, atol=1e-6)


def test_python_number_carry_is_refused():
    def f(x):
        return while_loop(lambda i, x: i < 3, lambda i, x: (i + 1, x * 2), (0, x))

    with pytest.raises(ControlFlowError, match="0-d tensor"):
        _call(f, np.ones(3, np.float32))


def test_torch_cond_and_while_loop_take_jax_tensors_with_no_mode_on():
    x = torch.tensor([0.5, -1.0, 2.0])
    xj = x.to("jax")
    out = torch.cond(xj.sum() > 0, lambda x: x.sin(), lambda x: x.cos(), (xj,))
    np.testing.assert_allclose(_np(out), _np(x.sin()), rtol=1e-6)
    i, y = torch.while_loop(lambda i, y: i < 3, lambda i, y: (i + 1, y * 2), (torch.tensor(0, device="jax"), xj))
    assert int(i) == 3
    np.testing.assert_allclose(_np(y), _np(x * 8), rtol=1e-6)


def test_while_loop_lazy():
    m = Looped()
    x = torch.randn(2, 4)
    ref = m.python_loop(x)
    mj = Looped().to("jax")
    with jaxtorch.default_env(), jaxtorch.lazy():
        got = _np(mj(x.to("jax") * 1.0))
    np.testing.assert_allclose(got, _np(ref), rtol=1e-5, atol=1e-5)


def test_nested_cond_and_vmap():
    def f(x):
        inner = lambda x: torch.cond(x.mean() > 1, lambda y: y * 3, lambda y: y.sin(), (x,))
        return torch.cond(x.sum() > 0, inner, lambda x: x.cos(), (x,))

    xs = np.array([[2.0, 2.0], [0.5, 0.5], [-1.0, -2.0]], np.float32)
    out = jax.vmap(lambda a: _call(f, a))(xs)
    want = [x * 3 if x.mean() > 1 else (np.sin(x) if x.sum() > 0 else np.cos(x)) for x in xs]
    np.testing.assert_allclose(np.asarray(out), np.stack(want), rtol=1e-6)


@pytest.mark.parametrize("traced", [True, False])
def test_random_op_in_a_body_is_refused(traced):
    def f(x):
        return torch.cond(x.sum() > 0, lambda x: torch.nn.functional.dropout(x, 0.5), lambda x: x.cos(), (x,))

    x = np.ones(8, np.float32)
    with pytest.raises(ControlFlowError, match="draws random numbers"):
        if traced:
            jax.jit(lambda a, k: jaxtorch.call_torch(f, a, rng=k))(x, jax.random.key(0))
        else:
            with jaxtorch.default_env():
                f(torch.ones(8, device="jax"))


@pytest.mark.parametrize("start", [0, 5])  # three iterations; none
def test_while_loop_gradient_with_respect_to_the_carry(start):
    def f(x):
        i0 = torch.full((), start, dtype=torch.int64, device=x.device)
        return while_loop(lambda i, x: i < 3, lambda i, x: (i + 1, x * x + 1.0), (i0, x))[1].sum()

    def python(x):
        for _ in range(max(0, 3 - start)):
            x = x * x + 1.0
        return x.sum()

    x = torch.tensor([0.5, -0.25], requires_grad=True)
    python(x).backward()
    g = jax.grad(lambda a: jaxtorch.call_torch(f, a))(jnp.asarray(x.detach().numpy()))
    np.testing.assert_allclose(np.asarray(g), _np(x.grad), rtol=1e-5)
