"""Resampling lowerings (`jaxtorch/ops/resampling.py`) against eager CPU torch.

Covers what the OpInfo samples leave out: antialiased bilinear / bicubic resizing (down and up,
align_corners, explicit scales, one axis unchanged), 3-d grid sampling in every mode and padding
with grids reaching outside the volume, gradients with respect to input and grid via `jax.grad`
against `torch.autograd`, and torch autograd on the `jax` device running the backward ops
(`grid_sampler_3d_backward`, `_upsample_bilinear2d_aa_backward`, ...).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxtorch
from tests.ops._compare import check, to_jax

F = torch.nn.functional


def _grad_check(fn, *tensors, tol=1e-4):
    """jax.grad of sum(fn(...) * cotangent) w.r.t. every input equals torch.autograd's."""
    cot = torch.randn(fn(*tensors).shape, generator=torch.Generator().manual_seed(0))
    leaves = [t.clone().requires_grad_() for t in tensors]
    (fn(*leaves) * cot).sum().backward()

    def loss(*arrays):
        return jnp.sum(jaxtorch.call_torch(fn, *arrays) * to_jax(cot))

    grads = jax.jit(jax.grad(loss, argnums=tuple(range(len(tensors)))))(*[to_jax(t) for t in tensors])
    for g, leaf in zip(grads, leaves):
        np.testing.assert_allclose(np.asarray(g), leaf.grad.numpy(), rtol=tol, atol=tol)


def _device_backward_check(fn, *tensors, tol=1e-4):
    """torch autograd with the inputs on the `jax` device (the *_backward ops run through jaxtorch)."""
    ref = [t.clone().requires_grad_() for t in tensors]
    fn(*ref).square().sum().backward()
    with jaxtorch.default_env():
        dev = [t.to("jax").requires_grad_() for t in tensors]
        fn(*dev).square().sum().backward()
        grads = [t.grad.cpu() for t in dev]
    for g, r in zip(grads, ref):
        np.testing.assert_allclose(g.numpy(), r.grad.numpy(), rtol=tol, atol=tol)


# ---- antialiased resize -----------------------------------------------------------------------
_AA_CASES = [
    dict(size=(3, 5)),
    dict(size=(7, 4)),
    dict(size=(13, 31)),
    dict(size=(10, 6)),
    dict(scale_factor=(0.37, 0.61)),
    dict(scale_factor=(1.7, 0.9)),
    dict(size=(1, 1)),
]


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
@pytest.mark.parametrize("align", [False, True])
@pytest.mark.parametrize("kw", _AA_CASES, ids=str)
def test_antialiased_interpolate(mode, align, kw):
    x = torch.randn(2, 3, 10, 20)
    fn = lambda x: F.interpolate(x, mode=mode, align_corners=align, antialias=True, **kw)
    check(fn, x, tol=1e-5)


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
def test_antialiased_interpolate_grad_and_device_backward(mode):
    x = torch.randn(2, 3, 10, 20)
    fn = lambda x: F.interpolate(x, size=(4, 27), mode=mode, antialias=True)
    _grad_check(fn, x)
    _device_backward_check(fn, x)


def test_antialiased_weights_match_torch_on_a_basis():
    """Resizing the identity (one basis image per batch entry) reads torch's weight matrix off whole."""
    for n_in, n_out in [(29, 3), (17, 16), (5, 12), (40, 7)]:
        eye = torch.eye(n_in).reshape(n_in, 1, n_in, 1).expand(n_in, 1, n_in, 2).contiguous()
        fn = lambda x: torch.ops.aten._upsample_bilinear2d_aa(x, [n_out, 2], False, None, None)
        check(fn, eye, tol=1e-6)


# ---- 3-d grid sampling ------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["bilinear", "nearest"])
@pytest.mark.parametrize("padding_mode", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("align", [False, True])
def test_grid_sample_3d(mode, padding_mode, align):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 4, 5, 6, generator=gen)
    g = torch.rand(2, 3, 4, 5, 3, generator=gen) * 3 - 1.5  # reaches well outside [-1, 1]
    fn = lambda x, g: F.grid_sample(x, g, mode=mode, padding_mode=padding_mode, align_corners=align)
    check(fn, x, g, tol=1e-5)
    if mode == "bilinear":
        _grad_check(fn, x, g)
    else:  # nearest: torch's grid gradient is zero; check the input's
        _grad_check(lambda x: fn(x, g), x)


def test_grid_sample_3d_device_backward():
    gen = torch.Generator().manual_seed(2)
    x, g = torch.randn(1, 2, 3, 4, 5, generator=gen), torch.rand(1, 2, 3, 4, 3, generator=gen) * 2.2 - 1.1
    fn = lambda x, g: F.grid_sample(x, g, padding_mode="reflection", align_corners=False)
    _device_backward_check(fn, x, g)


def test_grid_sample_2d_device_backward():
    gen = torch.Generator().manual_seed(3)
    x, g = torch.randn(2, 2, 5, 6, generator=gen), torch.rand(2, 3, 4, 2, generator=gen) * 2.2 - 1.1
    fn = lambda x, g: F.grid_sample(x, g, mode="bicubic", padding_mode="border", align_corners=True)
    _device_backward_check(fn, x, g)


# ---- fractional max pooling (given torch's own random samples) --------------------------------
@pytest.mark.parametrize(
    "shape,kernel,out",
    [((2, 3, 11, 9), (3, 2), (5, 4)), ((3, 10, 10), 2, (5, 7)), ((1, 2, 7, 8), 1, (7, 8)), ((2, 1, 5, 6), (2, 3), 1)],
)
def test_fractional_max_pool2d(shape, kernel, out):
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(shape, generator=gen)
    x.view(-1)[5] = float("nan")  # torch's NaN rule: every NaN in a window replaces the running max
    r = torch.rand(shape[0] if len(shape) == 4 else 1, shape[-3], 2, generator=gen)
    fn = lambda x, r: F.fractional_max_pool2d(
        x,
        kernel,
        output_size=out,
        return_indices=True,
        _random_samples=r,
    )
    check(fn, x, r, tol=0)
    x = torch.randn(shape, generator=gen)
    _grad_check(lambda x: fn(x, r)[0], x)
    _device_backward_check(lambda x: fn(x, r.to(x.device))[0], x)


@pytest.mark.parametrize("shape,kernel,out", [((2, 3, 7, 9, 8), (2, 3, 2), (4, 5, 3)), ((3, 6, 6, 6), 2, (3, 4, 4))])
def test_fractional_max_pool3d(shape, kernel, out):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(shape, generator=gen)
    r = torch.rand(shape[0] if len(shape) == 5 else 1, shape[-4], 3, generator=gen)
    fn = lambda x, r: F.fractional_max_pool3d(
        x,
        kernel,
        output_size=out,
        return_indices=True,
        _random_samples=r,
    )
    check(fn, x, r, tol=0)
    _grad_check(lambda x: fn(x, r)[0], x)
    _device_backward_check(lambda x: fn(x, r.to(x.device))[0], x)


def test_fractional_max_pool3d_refuses_windows_past_the_end_like_torch():
    x, r = torch.randn(1, 1, 6, 6, 6), torch.full((1, 1, 3), 0.5)
    with pytest.raises(RuntimeError):
        torch.ops.aten.fractional_max_pool3d(x, [2, 2, 2], [5, 5, 5], r)
    with pytest.raises(RuntimeError, match="pool time 2 too large relative to input time 6"):  # torch's own error
        jaxtorch.call_torch(
            lambda x, r: torch.ops.aten.fractional_max_pool3d(x, [2, 2, 2], [5, 5, 5], r), to_jax(x), to_jax(r)
        )
