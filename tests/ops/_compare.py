"""Shared by the op-family tests: run a torch function through jaxtorch and compare with eager torch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

import jaxtorch


def to_jax(t: torch.Tensor):
    return jnp.asarray(t.numpy())


def run(fn, *tensors, jit=False):
    """`fn` through `jaxtorch.call_torch` on the tensors as JAX arrays, optionally under `jax.jit`."""
    call = lambda *arrays: jaxtorch.call_torch(fn, *arrays)
    return (jax.jit(call) if jit else call)(*[to_jax(t) for t in tensors])


def compare(ref, got, tol):
    """Torch result(s) `ref` == JAX result(s) `got`: shapes, dtype kinds, values (NaN == NaN)."""
    if isinstance(ref, (tuple, list)):
        assert isinstance(got, (tuple, list)) and len(ref) == len(got)
        for r, g in zip(ref, got):
            compare(r, g, tol)
        return
    g = np.asarray(got)
    r = ref.resolve_conj().numpy()
    assert g.shape == r.shape, (g.shape, r.shape)
    if r.dtype == np.bool_:
        assert g.dtype == np.bool_
        np.testing.assert_array_equal(g, r)
    elif np.issubdtype(r.dtype, np.integer):
        assert g.dtype.kind == r.dtype.kind, (g.dtype, r.dtype)
        np.testing.assert_array_equal(g, r)
    else:
        assert g.dtype == r.dtype, (g.dtype, r.dtype)
        np.testing.assert_allclose(g, r, rtol=tol, atol=tol, equal_nan=True)


def check(fn, *tensors, jit=True, tol):
    """`fn` on CPU torch == `fn` through jaxtorch, eagerly and (unless jit=False) under jax.jit."""
    ref = fn(*tensors)
    compare(ref, run(fn, *tensors), tol)
    if jit:
        compare(ref, run(fn, *tensors, jit=True), tol)
