"""Errors and conversions at the torch/JAX boundary point the right way (issue 22, item 6).

`jax.jit(fn)(params, torch_tensor)` works (JAX takes torch tensors as it takes NumPy arrays,
converted as `jaxtorch.to_jax` converts them: snapshots); tensors with no dense data and JAX
PRNG keys raise errors naming the problem and the conversion to make.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxtorch


@pytest.fixture(scope="module")
def linear():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    params, fn = jaxtorch.extract(model)
    return model, params, fn


def test_jit_of_extract_fn_takes_a_torch_tensor(linear):
    model, params, fn = linear
    x = torch.randn(5, 4)
    want = model(x).detach().numpy()
    np.testing.assert_allclose(np.asarray(jax.jit(fn)(params, x)), want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(fn(params, x)), want, rtol=1e-6, atol=1e-6)  # the same without jit
    np.testing.assert_allclose(np.asarray(jax.jit(fn)(params, torch.nn.Parameter(x))), want, rtol=1e-6, atol=1e-6)


def test_grad_and_vmap_take_torch_tensors(linear):
    model, params, fn = linear
    x = torch.randn(5, 4)
    g = jax.grad(lambda p, x: fn(p, x).sum())(params, x)
    model.zero_grad()
    model(x).sum().backward()
    np.testing.assert_allclose(np.asarray(g["weight"]), model.weight.grad.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(jax.vmap(lambda r: r * 2)(x)), x.numpy() * 2)
    np.testing.assert_allclose(np.asarray(jnp.sin(x)), np.sin(x.numpy()), rtol=1e-6)


def test_jit_torch_argument_is_a_snapshot():
    double = jax.jit(lambda a: a * 2)
    for i in range(20):
        for shape in ((4,), (128, 256)):
            t = torch.full(shape, float(i))
            out = double(t)
            t.fill_(float("nan"))
            np.testing.assert_array_equal(np.asarray(out), np.full(shape, 2.0 * i, np.float32))


def test_jit_takes_a_jax_tensor():
    with jaxtorch.default_env():
        t = torch.arange(3.0, device="jax")
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda a: a + 1)(t)), [1.0, 2.0, 3.0])


def test_to_torch_of_a_prng_key_names_it():
    with pytest.raises(TypeError, match=r"PRNG key.*key_data"):
        jaxtorch.to_torch(jax.random.key(0))
    with pytest.raises(TypeError, match="PRNG key"):
        jaxtorch.to_torch({"rng": jax.random.split(jax.random.key(0), 3)})


_NOT_DENSE = {
    "sparse_coo": (lambda: torch.eye(3).to_sparse(), r"sparse_coo layout.*to_dense\(\)"),
    "sparse_csr": (lambda: torch.eye(3).to_sparse_csr(), r"sparse_csr layout.*to_dense\(\)"),
    "sparse_csc": (lambda: torch.eye(3).to_sparse_csc(), r"sparse_csc layout.*to_dense\(\)"),
    "quantized": (lambda: torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8), r"quantized.*dequantize\(\)"),
    "nested": (
        lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
        r"nested.*to_padded_tensor",
    ),
    "meta": (lambda: torch.ones(3, device="meta"), r"meta device.*no data"),
    "mkldnn": (lambda: torch.ones(3).to_mkldnn(), r"_mkldnn layout.*to_dense\(\)"),
}


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("kind", list(_NOT_DENSE))
def test_to_jax_of_a_tensor_without_dense_data_names_the_layout(kind):
    make, pattern = _NOT_DENSE[kind]
    error = ValueError if kind == "meta" else TypeError  # (meta: the message says where weights come from)
    with pytest.raises(error, match=pattern):
        jaxtorch.to_jax(make())
    with pytest.raises(error, match=pattern):
        jaxtorch.to_jax({"x": [make()]})
