"""Float32 matmul precision follows torch's setting (bridge/core/_matmul_precision.py)."""

import jax
import jax.numpy as jnp
import torch

import jaxtorch


def _dot_precisions(fn, *args) -> str:
    return jax.jit(fn).lower(*args).as_text()


def _matmul(x):
    return jaxtorch.call_torch(lambda t: t @ t, x)


def test_traced_matmuls_use_torch_precision():
    # (a function traced once keeps its precision: JAX caches the trace, so each check
    # traces a fresh function)
    a = jnp.ones((4, 4))
    assert "precision = [HIGHEST, HIGHEST]" in _dot_precisions(lambda x: _matmul(x), a)  # torch's default
    old = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium")
        assert "precision = [DEFAULT, DEFAULT]" in _dot_precisions(lambda x: _matmul(x), a)
        torch.set_float32_matmul_precision("high")
        assert "precision = [HIGH, HIGH]" in _dot_precisions(lambda x: _matmul(x), a)
    finally:
        torch.set_float32_matmul_precision(old)


def test_conv_in_extract_uses_torch_precision():
    model = torch.nn.Conv2d(3, 4, 3)
    params, fn = jaxtorch.extract(model)
    assert "HIGHEST" in _dot_precisions(fn, params, jnp.ones((1, 3, 8, 8)))
