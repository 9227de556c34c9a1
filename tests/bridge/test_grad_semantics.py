"""torch's autograd meaning under JAX transformations (issue 29 items 1-3): stop-gradients,
custom `autograd.Function`s and backward hooks, checked against CPU torch autograd on the same
inputs, through `call_torch`, `extract`, `torch_module_to_jax`, `jax.jit`, `vmap`, `jvp`,
`hessian`."""

from __future__ import annotations

import contextlib
import copy
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch.autograd.function import once_differentiable

import jaxtorch
from jaxtorch import HookUnderTraceError, OnceDifferentiableError


def _torch_grad(f, *xs):
    ts = [torch.tensor(np.asarray(x), requires_grad=True) for x in xs]
    grads = torch.autograd.grad(f(*ts), ts, allow_unused=True)
    return [np.zeros(np.shape(x), np.float32) if g is None else g.numpy() for g, x in zip(grads, xs)]


def _jax_grad(f, *xs, jit=False):
    g = jax.grad(lambda *a: jaxtorch.call_torch(f, *a), argnums=tuple(range(len(xs))))
    return [np.asarray(v) for v in (jax.jit(g) if jit else g)(*xs)]


def _same(got, want):
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


X = jnp.array([0.3, 1.7, -2.2, 0.0])


# ---- stop-gradients -------------------------------------------------------------------------
def straight_through(t):
    return (t + (torch.round(t) - t).detach()).pow(2).sum()


def data_read(t):
    return (t.data * t).sum()


def under_no_grad(t):
    with torch.no_grad():
        u = t * 3
    return (u * t).sum()


def under_set_grad_enabled(t):
    with torch.set_grad_enabled(False):
        u = t.exp()
    return (u * t).sum()


def under_inference_mode(t):
    with torch.inference_mode():
        u = t.sin()
    return (u.clone() * t).sum()  # (torch refuses to save an inference tensor for backward)


def no_grad_view(t):
    with torch.no_grad():
        v = t[1:]
    return (v * t[:-1]).sum()


def inplace_under_no_grad(t):
    u = t * 1
    with torch.no_grad():
        u.clamp_(-1.0, 1.0)  # values change, derivative kept (torch does not record the write)
    return (u * u).sum()


def write_through_data(t):
    u = t * 2
    u.data.mul_(0.5)
    return (u * 3 + u * u).sum()


def write_through_detached_slice(t):
    u = t * 2
    u.detach()[0] = 7.0
    return (u * u).sum()


def requires_grad_false_factory(t):
    c = torch.tensor(2.0, requires_grad=False)
    return (t * c).sum() + t.new_tensor(t.detach()).sum()


def detach_in_place(t):
    y = t * 2
    y.detach_()
    return (y * t).sum()


def data_assignment(t):
    y = t * 2
    y.data = y.data.clamp(-1, 1)  # new values, y keeps its derivative
    return (y * y).sum()


def nested_grad_modes(t):
    with torch.no_grad():
        with torch.enable_grad():
            a = t * 3
        b = t * 5
    return (a * b).sum()


def no_grad_decorator(t):
    @torch.no_grad()
    def g(u):
        return u.exp()

    return (g(t) * t).sum()


SEMANTICS = [
    detach_in_place,
    data_assignment,
    nested_grad_modes,
    no_grad_decorator,
    straight_through,
    data_read,
    under_no_grad,
    under_set_grad_enabled,
    under_inference_mode,
    no_grad_view,
    inplace_under_no_grad,
    write_through_data,
    write_through_detached_slice,
    requires_grad_false_factory,
]


@pytest.mark.parametrize("jit", [False, True], ids=["grad", "jit-grad"])
@pytest.mark.parametrize("f", SEMANTICS, ids=lambda f: f.__name__)
def test_stop_gradients_follow_torch(f, jit):
    _same(_jax_grad(f, X, jit=jit), _torch_grad(f, X))


def test_stop_gradient_forward_mode_and_second_order():
    # jvp: the no_grad factor is a constant; hessian of (3t * t) with 3t stopped is diag(3)
    out, tangent = jax.jvp(lambda a: jaxtorch.call_torch(under_no_grad, a), (X,), (jnp.ones(4),))
    np.testing.assert_allclose(tangent, float((3 * X).sum()), rtol=1e-6)
    h = jax.hessian(lambda a: jaxtorch.call_torch(under_no_grad, a))(X)
    np.testing.assert_allclose(h, np.zeros((4, 4)), atol=0)
    h = jax.hessian(lambda a: jaxtorch.call_torch(data_read, a))(X)
    np.testing.assert_allclose(h, np.zeros((4, 4)), atol=0)


def test_stop_gradient_under_vmap():
    xs = jnp.stack([X, X * 2])
    got = jax.vmap(jax.grad(lambda a: jaxtorch.call_torch(straight_through, a)))(xs)
    for row, x in zip(got, xs):
        _same([np.asarray(row)], _torch_grad(straight_through, x))


def test_detach_is_plain_alias_outside_a_trace():
    t = torch.tensor([1.0, 2.0], device="jax")
    d = t.detach()
    d.add_(1)  # eager: writes through, as torch
    np.testing.assert_allclose(t.cpu().numpy(), [2.0, 3.0])


class EMA(torch.nn.Module):
    """A target network updated under no_grad in forward and used detached; a frozen layer; a buffer."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.online = torch.nn.Linear(4, 3)
        self.frozen = torch.nn.Linear(3, 3)
        self.frozen.requires_grad_(False)
        self.register_buffer("target_w", self.online.weight.detach().clone())
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, x):
        with torch.no_grad():
            self.target_w.mul_(0.9).add_(self.online.weight.detach(), alpha=0.1)
        online = self.frozen(self.online(x)) * self.scale
        target = x @ self.target_w.t()
        return ((online - target) ** 2).mean()


def _reference_grads(model, x):
    model = copy.deepcopy(model)
    model(torch.tensor(np.asarray(x))).backward()
    return {n: p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None}


def test_extract_buffers_and_frozen_params_are_not_differentiated():
    model = EMA()
    x = jnp.asarray(np.random.default_rng(0).normal(size=(5, 4)).astype(np.float32))
    want = _reference_grads(model, x)
    params, fn = jaxtorch.extract(model, mutable=True)
    assert sorted(params) == sorted(want)
    got = jax.grad(lambda p: fn(p, x, state=fn.state)[0])(params)
    for n in want:
        np.testing.assert_allclose(got[n], want[n], rtol=1e-5, atol=1e-6)
    # differentiating the state itself gives zeros (torch never differentiates buffers or frozen weights)
    gs = jax.grad(lambda s: fn(params, x, state=s)[0])(fn.state)
    assert all(float(jnp.abs(v).max()) == 0 for v in gs.values())


def test_torch_module_to_jax_filter_grad_follows_torch():
    model = EMA()
    x = jnp.asarray(np.random.default_rng(1).normal(size=(5, 4)).astype(np.float32))
    want = _reference_grads(model, x)
    m = jaxtorch.torch_module_to_jax(model)
    got = eqx.filter_grad(lambda m: m(x, state=m.state)[0])(m)  # (it writes a buffer: explicit state)
    for n in want:
        np.testing.assert_allclose(got.params[n], want[n], rtol=1e-5, atol=1e-6)


# ---- custom autograd.Function ---------------------------------------------------------------
class Reverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, lam):
        ctx.lam = lam
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return -g * ctx.lam, None


class Product(torch.autograd.Function):
    """Saved tensors, needs_input_grad, a non-differentiable second output, a None gradient."""

    @staticmethod
    def forward(ctx, x, y):
        ctx.save_for_backward(x, y)
        mask = x > 0
        ctx.mark_non_differentiable(mask)
        return x * y, mask

    @staticmethod
    def backward(ctx, g, _mask_grad):
        x, y = ctx.saved_tensors
        gx = 10 * g * y if ctx.needs_input_grad[0] else None
        gy = g * x if ctx.needs_input_grad[1] else None
        return gx, gy


class Cube(torch.autograd.Function):
    """`setup_context` style, differentiable backward (second order)."""

    @staticmethod
    def forward(x):
        return x**3

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * x**2 * g


class OnceCube(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * x**2 * g


class ScaleInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x.mul_(2)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g * 5


class NoMaterialize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.set_materialize_grads(False)
        return x * 1, x * 2

    @staticmethod
    def backward(ctx, g1, g2):
        assert g2 is None  # the second output is unused
        return g1 * 7


def reverse(t):
    return (Reverse.apply(t, 2.0) * t).sum()


def product_first(t, u):
    out, mask = Product.apply(t, u)
    return (out * mask).sum()


def cube(t):
    return Cube.apply(t).sum()


def once_cube(t):
    return OnceCube.apply(t).sum()


def scale_in_place(t):
    u = t * 1
    return ScaleInPlace.apply(u).sum() + u.sum()


def no_materialize(t):
    return NoMaterialize.apply(t)[0].sum()


@pytest.mark.parametrize("jit", [False, True], ids=["grad", "jit-grad"])
@pytest.mark.parametrize("f", [reverse, cube, once_cube, scale_in_place, no_materialize], ids=lambda f: f.__name__)
def test_custom_function_backward_runs(f, jit):
    _same(_jax_grad(f, X, jit=jit), _torch_grad(f, X))


def test_custom_function_needs_input_grad_and_none_gradients():
    _same(_jax_grad(product_first, X, X + 1), _torch_grad(product_first, X, X + 1))
    seen = []

    class Spy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, y):
            return x * y

        @staticmethod
        def backward(ctx, g):
            seen.append(ctx.needs_input_grad)
            return g, g

    jax.grad(lambda a, b: jaxtorch.call_torch(lambda t, u: Spy.apply(t, u).sum(), a, b), argnums=1)(X, X)
    assert seen == [(False, True)]


def test_custom_function_second_order_and_vmap():
    h = jax.hessian(lambda a: jaxtorch.call_torch(cube, a))(X)
    np.testing.assert_allclose(h, np.diag(6 * np.asarray(X)), rtol=1e-6, atol=1e-6)
    g = jax.vmap(jax.grad(lambda a: jaxtorch.call_torch(cube, a)))(jnp.stack([X, 2 * X]))
    np.testing.assert_allclose(g, 3 * np.stack([X, 2 * X]) ** 2, rtol=1e-6)
    with pytest.raises(OnceDifferentiableError, match="once_differentiable"):
        jax.hessian(lambda a: jaxtorch.call_torch(once_cube, a))(X)


def test_custom_function_in_extracted_model_and_torch_first_unchanged():
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 3)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = lin

        def forward(self, x):
            return (Reverse.apply(self.lin(x), 0.5) ** 2).sum()

    net = Net()
    x = np.random.default_rng(2).normal(size=(2, 4)).astype(np.float32)
    want = _reference_grads(net, x)
    params, fn = jaxtorch.extract(net)
    got = jax.jit(jax.grad(lambda p: fn(p, jnp.asarray(x))))(params)
    for n in want:
        np.testing.assert_allclose(got[n], want[n], rtol=1e-5, atol=1e-6)
    # torch-first on the jax device: torch's own Function machinery (its autograd records the node)
    net_j = copy.deepcopy(net).to("jax")
    net_j(torch.tensor(x).to("jax")).backward()
    for n, p in net_j.named_parameters():
        np.testing.assert_allclose(p.grad.cpu().numpy(), want[n], rtol=1e-5, atol=1e-6)


# ---- hooks ----------------------------------------------------------------------------------
def tensor_hook(t):
    y = t * 2
    y.register_hook(lambda g: g * 10)
    return (y * y).sum()


def tensor_hook_removed(t):
    y = t * 2
    h = y.register_hook(lambda g: g * 10)
    h.remove()
    return (y * y).sum()


@pytest.mark.parametrize("jit", [False, True], ids=["grad", "jit-grad"])
@pytest.mark.parametrize("f", [tensor_hook, tensor_hook_removed], ids=lambda f: f.__name__)
def test_tensor_hooks_follow_torch(f, jit):
    _same(_jax_grad(f, X, jit=jit), _torch_grad(f, X))


def _hooked_net(log):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))

    def full(m, grad_input, grad_output):
        log.append(("full", type(m).__name__, tuple(g is None for g in grad_input)))
        return tuple(None if g is None else g * 3 for g in grad_input)

    def pre(m, grad_output):
        log.append(("pre", type(m).__name__))
        return tuple(g * 2 for g in grad_output)

    net[1].register_full_backward_hook(full)
    net[2].register_full_backward_pre_hook(pre)
    net[0].register_full_backward_hook(full)  # its input is data: torch calls it with grad_input (None,)
    net[0].weight.register_hook(lambda g: g + 1)
    return net


def test_module_and_parameter_hooks_follow_torch():
    x = np.random.default_rng(3).normal(size=(5, 3)).astype(np.float32)
    ref_log, log = [], []
    ref = _hooked_net(ref_log)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (ref(torch.tensor(x)) ** 2).sum().backward()
        net = _hooked_net(log)
        params, fn = jaxtorch.extract(net)
        got = jax.grad(lambda p: (fn(p, jnp.asarray(x)) ** 2).sum())(params)
    assert log == ref_log
    for n, p in ref.named_parameters():
        np.testing.assert_allclose(got[n], p.grad.numpy(), rtol=1e-5, atol=1e-6)


def test_hooks_that_cannot_be_honoured_raise():
    lin = torch.nn.Linear(2, 2)
    lin.weight.register_post_accumulate_grad_hook(lambda p: None)
    params, fn = jaxtorch.extract(lin)
    with pytest.raises(HookUnderTraceError, match="post_accumulate_grad"):
        jax.grad(lambda p: fn(p, jnp.ones((1, 2))).sum())(params)

    def on_view(t):
        v = (t * 2)[1:]
        v.register_hook(lambda g: g)
        return v.sum()

    with pytest.raises(HookUnderTraceError, match="view"):
        jax.grad(lambda a: jaxtorch.call_torch(on_view, a))(X)


# ---- one model with all of it, every path ---------------------------------------------------
class Everything(torch.nn.Module):
    """A straight-through estimator, a no_grad statistic, a gradient reversal, a tensor hook and
    module hooks in one forward."""

    def __init__(self, log: list):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(4, 6)
        self.act = torch.nn.Tanh()
        self.b = torch.nn.Linear(6, 3)
        self.act.register_full_backward_hook(lambda m, gi, go: (log.append("full"), (gi[0] * 0.5,))[1])
        self.b.register_full_backward_pre_hook(lambda m, go: (log.append("pre"), None)[1])

    def forward(self, x):
        h = self.act(self.a(x))
        h = h + (torch.round(h * 4) / 4 - h).detach()
        with torch.no_grad():
            scale = h.abs().mean() + 1
        h = Reverse.apply(h, 0.5) * scale
        h.register_hook(lambda g: g * 2)
        return self.b(h)


def _everything_loss(out, y):
    return ((out - y) ** 2).mean()


def _everything_paths():
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(4))
    y = torch.randn(5, 3, generator=torch.Generator().manual_seed(5))
    return x, y


def _everything_reference():
    x, y = _everything_paths()
    log: list = []
    ref = Everything(log)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _everything_loss(ref(x), y).backward()
    return {n: p.grad.numpy() for n, p in ref.named_parameters()}, log


@pytest.mark.parametrize("path", ["eager-jax", "lazy", "jit-backward", "compile", "extract", "make_train_step"])
def test_every_path_gives_torchs_gradients(path):
    import optax

    from jaxtorch.train import make_train_step

    want, ref_log = _everything_reference()
    x, y = _everything_paths()
    log: list = []
    model = Everything(log)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if path in ("eager-jax", "compile", "lazy"):
            model = model.to("jax")
            run = jaxtorch.compile(model) if path == "compile" else model
            with jaxtorch.lazy() if path == "lazy" else contextlib.nullcontext():
                _everything_loss(run(x.to("jax")), y.to("jax")).backward()
            got = {n: p.grad.cpu().numpy() for n, p in model.named_parameters()}
        elif path == "jit-backward":
            model = model.to("jax")

            @jaxtorch.jit
            def step(m, a, b):
                loss = _everything_loss(m(a), b)
                loss.backward()
                return loss

            step(model, x.to("jax"), y.to("jax"))
            got = {n: p.grad.cpu().numpy() for n, p in model.named_parameters()}
        elif path == "extract":
            params, fn = jaxtorch.extract(model)
            got = jax.grad(lambda p: _everything_loss(fn(p, jnp.asarray(x.numpy())), jnp.asarray(y.numpy())))(params)
        else:
            init, step = make_train_step(model, _everything_loss, optax.sgd(1.0))
            state = init()
            before = {k: np.asarray(v) for k, v in state.params.items()}
            state, _ = step(state, x, y)
            got = {k: before[k] - np.asarray(state.params[k]) for k in before}
    assert log == ref_log
    for n in want:
        np.testing.assert_allclose(np.asarray(got[n]), want[n], rtol=1e-5, atol=1e-6, err_msg=n)


def test_outer_grad_mode_is_ignored_as_torch_func_grad_does():
    """torch.func.grad ignores an outer no_grad; so do the JAX-first entry points."""
    want = torch.func.grad(lambda t: (t * t).sum())(torch.tensor(np.asarray(X)))
    model = torch.nn.Linear(4, 1)
    params, fn = jaxtorch.extract(model)
    for mode in (torch.no_grad, lambda: torch.set_grad_enabled(False), torch.inference_mode):
        with mode():
            assert torch.func.grad(lambda t: (t * t).sum())(torch.tensor(np.asarray(X))).equal(want)
            got = jax.grad(lambda a: jaxtorch.call_torch(lambda t: (t * t).sum(), a))(X)
            np.testing.assert_allclose(got, want.numpy())
            g = jax.grad(lambda p: fn(p, jnp.ones((2, 4))).sum())(params)
            np.testing.assert_allclose(g["weight"], np.full((1, 4), 2.0))


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_remat_region_keeps_torchs_meaning(reentrant):
    from torch.utils.checkpoint import checkpoint

    def block(t):
        u = t + (torch.round(t) - t).detach()
        with torch.no_grad():
            s = t.abs().mean()
        v = Reverse.apply(u, 3.0) * s
        if torch.is_grad_enabled():  # (torch's reentrant forward runs under no_grad: hooks come with the recompute)
            v.register_hook(lambda g: g * 2)
        return v * v

    def f(t):
        return checkpoint(block, t * 1.5, use_reentrant=reentrant).sum()

    x = jnp.array([0.3, 1.7, -2.2])
    t = torch.tensor(np.asarray(x), requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        f(t).backward()  # (torch's reentrant checkpoint refuses torch.autograd.grad)
        _same(_jax_grad(f, x), [t.grad.numpy()])
        _same(_jax_grad(f, x, jit=True), [t.grad.numpy()])
