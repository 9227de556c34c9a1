"""Gradients under JAX transformations (issue 29): what a hostile user does with torch's autograd
controls inside a JAX-first function. Each case matches CPU torch autograd or raises a clear error."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxtorch

from .harness import case, clear_error, close


def _grads(f, *xs):
    """(jax.grad through call_torch, torch.autograd) of the scalar `f` for each argument."""
    got = jax.grad(lambda *a: jaxtorch.call_torch(f, *a), argnums=tuple(range(len(xs))))(*xs)
    ts = [torch.tensor(np.asarray(x), requires_grad=True) for x in xs]
    want = torch.autograd.grad(f(*ts), ts, allow_unused=True)
    return [np.asarray(g) for g in got], [
        np.zeros(t.shape, np.float32) if w is None else w.numpy() for w, t in zip(want, ts)
    ]


def _same(f, *xs) -> None:
    got, want = _grads(f, *xs)
    for g, w in zip(got, want):
        close(g, w, atol=1e-6)


X = jnp.array([0.5, -1.5, 2.0, 0.0])


class _Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, k):
        ctx.k = k
        return x * 1

    @staticmethod
    def backward(ctx, g):
        return g * ctx.k, None


@case("grads/detach_then_clone_is_still_detached")
def _detach_clone():
    _same(lambda t: (t.detach().clone() * t).sum(), X)


@case("grads/detach_of_view_then_reshape")
def _detach_view():
    _same(lambda t: (t[1:].detach().reshape(3, 1) * t[:3].reshape(3, 1)).sum(), X)


@case("grads/no_grad_result_written_with_grad_back_on")
def _no_grad_then_write():
    def f(t):
        with torch.no_grad():
            buf = t * 2
        buf.add_(t)  # grad mode on again: this write is recorded (only t's share is differentiated)
        return (buf * buf).sum()

    _same(f, X)


@case("grads/inplace_under_no_grad_on_view_keeps_derivative")
def _inplace_view():
    def f(t):
        u = t * 1
        with torch.no_grad():
            u[1:3].mul_(10)
        return (u * u).sum()

    _same(f, X)


@case("grads/data_copy_keeps_leaf_identity")
def _data_copy():
    def f(t):
        u = t * 3
        u.data.copy_(torch.zeros_like(u))
        return (u + u * t).sum()

    _same(f, X)


@case("grads/set_grad_enabled_true_inside_no_grad")
def _reenable():
    def f(t):
        with torch.no_grad(), torch.set_grad_enabled(True):
            a = t.exp()
        return (a * t).sum()

    _same(f, X)


@case("grads/function_reused_with_two_shapes_under_jit")
def _fn_shapes():
    f = lambda t: _Scale.apply(t, 3.0).sum()
    g = jax.jit(jax.grad(lambda a: jaxtorch.call_torch(f, a)))
    close(np.asarray(g(X)), np.full(4, 3.0))
    close(np.asarray(g(jnp.ones((2, 3)))), np.full((2, 3), 3.0))


@case("grads/function_in_two_threads")
def _fn_threads():
    results: dict = {}

    def run(k: float) -> None:
        f = lambda t: _Scale.apply(t, k).sum()
        results[k] = np.asarray(jax.grad(lambda a: jaxtorch.call_torch(f, a))(X))

    threads = [threading.Thread(target=run, args=(k,)) for k in (2.0, 5.0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    close(results[2.0], np.full(4, 2.0))
    close(results[5.0], np.full(4, 5.0))


@case("grads/function_backward_wrong_shape_is_torchs_error")
def _fn_bad_shape():
    class Bad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1

        @staticmethod
        def backward(ctx, g):
            return torch.ones(7, device=g.device)

    with pytest.raises(RuntimeError) as e:
        jax.grad(lambda a: jaxtorch.call_torch(lambda t: Bad.apply(t).sum(), a))(X)
    clear_error(e.value, "invalid gradient", "shape")


@case("grads/function_backward_too_few_gradients")
def _fn_few():
    class Few(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, y):
            return x * y

        @staticmethod
        def backward(ctx, g):
            return g

    with pytest.raises(RuntimeError) as e:
        jax.grad(lambda a: jaxtorch.call_torch(lambda t: Few.apply(t, t).sum(), a))(X)
    clear_error(e.value, "incorrect number of gradients")


@case("grads/function_broadcast_gradient_is_summed")
def _fn_broadcast():
    class Bc(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1

        @staticmethod
        def backward(ctx, g):
            return g.expand(3, *g.shape)  # torch sums a broadcastable gradient to the input's shape

    _same(lambda t: Bc.apply(t).sum(), X)


@case("grads/function_returning_an_input_unchanged")
def _fn_identity():
    class Same(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x

        @staticmethod
        def backward(ctx, g):
            return g * 4

    _same(lambda t: (Same.apply(t * 1) * t).sum(), X)


@case("grads/function_non_tensor_outputs_and_kwargs_like_defaults")
def _fn_nontensor():
    class Pair(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, scale=2.0):
            ctx.scale = scale
            return x * scale, "label", None

        @staticmethod
        def backward(ctx, g, _label, _none):
            return g * ctx.scale * 10, None

    def f(t):
        y, label, none = Pair.apply(t)
        assert label == "label" and none is None
        return y.sum()

    _same(f, X)


@case("grads/function_vmap_of_grad")
def _fn_vmap():
    xs = jnp.stack([X, X + 1, X * 2])
    got = jax.vmap(jax.grad(lambda a: jaxtorch.call_torch(lambda t: (_Scale.apply(t, 2.0) * t).sum(), a)))(xs)
    close(np.asarray(got), np.asarray(3 * xs), atol=1e-6)


@case("grads/hook_returning_wrong_shape")
def _hook_shape():
    def f(t):
        y = t * 2
        y.register_hook(lambda g: torch.ones(2, device=g.device))
        return y.sum()

    with pytest.raises(RuntimeError) as e:
        jax.grad(lambda a: jaxtorch.call_torch(f, a))(X)
    clear_error(e.value, "shape")


@case("grads/two_hooks_in_order")
def _two_hooks():
    def f(t):
        y = t * 2
        y.register_hook(lambda g: g + 1)
        y.register_hook(lambda g: g * 3)
        return y.sum()

    _same(f, X)


@case("grads/hook_on_leaf_input_under_call_torch")
def _hook_leaf():
    def f(t):
        t.register_hook(lambda g: g * -1)  # registered first: every use is seen
        return (t * t).sum()

    _same(f, X)


@case("grads/module_hook_removed_before_backward")
def _module_hook_removed():
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 2)
    h = lin.register_full_backward_hook(lambda m, gi, go: (gi[0] * 100,))
    h.remove()
    params, fn = jaxtorch.extract(lin)
    x = torch.randn(3, 4)
    g = jax.grad(lambda p: fn(p, jnp.asarray(x.numpy())).sum())(params)
    lin(x).sum().backward()
    close(np.asarray(g["weight"]), lin.weight.grad.numpy(), atol=1e-6)


@case("grads/outer_no_grad_with_extract_and_jit")
def _outer_no_grad():
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 2)
    params, fn = jaxtorch.extract(lin)
    with torch.no_grad():
        g = jax.jit(jax.grad(lambda p: fn(p, jnp.ones((1, 4))).sum()))(params)
    close(np.asarray(g["weight"]), np.ones((2, 4)))


@case("grads/stop_gradient_values_unchanged_under_jit")
def _values_unchanged():
    def f(t):
        with torch.no_grad():
            u = t.sin()
        return u + t.detach() * 2 + t.data

    out = jax.jit(lambda a: jaxtorch.call_torch(f, a))(X)
    close(np.asarray(out), np.sin(np.asarray(X)) + 3 * np.asarray(X), atol=1e-6)


@case("grads/hessian_through_detach_mix")
def _hessian():
    def f(t):
        return (t**3).sum() + (t.detach() * t * t).sum()

    h = jax.hessian(lambda a: jaxtorch.call_torch(f, a))(X)
    x = np.asarray(X)
    close(np.asarray(h), np.diag(6 * x + 2 * x), atol=1e-5)


@case("grads/once_differentiable_first_order_fine")
def _once_first():
    class Once(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x.exp()

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return g * x.exp()

    _same(lambda t: Once.apply(t).sum(), X)
    with pytest.raises(jaxtorch.OnceDifferentiableError):
        jax.hessian(lambda a: jaxtorch.call_torch(lambda t: Once.apply(t).sum(), a))(X)


@case("grads/write_into_detached_alias_with_grad_on")
def _detached_alias_write():
    def f(t, u):
        x = t * 2
        d = x.detach()
        d.add_(u * 3)  # torch: x keeps its derivative, d now carries u's
        return (d * 5).sum() + (x * x).sum()

    _same(f, X, X + 1)
