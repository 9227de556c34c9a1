"""Conversions: jax_view/torch_view (no copy) and to_jax/to_torch (DLPack) over nested structures."""

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxtorch
from jaxtorch import JaxTensor
from jaxtorch.bridge.tensor._convert import tree_map
from tests._dtypes import enable_x64

Point = collections.namedtuple("Point", ["x", "y"])


@dataclasses.dataclass
class Pair:
    a: object
    b: object


# int32 is left out: without JAX's x64 mode it reads back as int64 (see the dedicated test).
DTYPES = [
    torch.float32,
    torch.int64,
    torch.bool,
    torch.bfloat16,
    torch.float16,
    torch.uint8,
    torch.int8,
    torch.complex64,
]


def _tensor(draw, dtype):
    shape = draw(st.lists(st.integers(0, 4), min_size=0, max_size=3))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype in (torch.int64, torch.int32, torch.uint8, torch.int8):
        return torch.randint(0, 100, shape, generator=g).to(dtype)
    if dtype == torch.complex64:
        return torch.randn(shape, generator=g, dtype=torch.complex64)
    return torch.randn(shape, generator=g).to(dtype)


@st.composite
def nested(draw, depth=0):
    if depth > 2 or draw(st.booleans()):
        kind = draw(st.sampled_from(["tensor", "tensor", "int", "float", "none", "str"]))
        if kind == "tensor":
            return _tensor(draw, draw(st.sampled_from(DTYPES)))
        return {"int": 3, "float": 2.5, "none": None, "str": "s"}[kind]
    kind = draw(st.sampled_from(["list", "tuple", "dict", "namedtuple", "dataclass"]))
    a, b = draw(nested(depth + 1)), draw(nested(depth + 1))
    return {
        "list": [a, b],
        "tuple": (a, b),
        "dict": {"a": a, "b": b},
        "namedtuple": Point(a, b),
        "dataclass": Pair(a, b),
    }[kind]


def _assert_same(x, y):
    assert type(x) is type(y), (type(x), type(y))
    if isinstance(x, torch.Tensor):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x, y)
    elif isinstance(x, (list, tuple)):
        assert len(x) == len(y)
        for a, b in zip(x, y):
            _assert_same(a, b)
    elif isinstance(x, dict):
        assert x.keys() == y.keys()
        for k in x:
            _assert_same(x[k], y[k])
    elif dataclasses.is_dataclass(x):
        _assert_same(x.a, y.a)
        _assert_same(x.b, y.b)
    else:
        assert x == y


@settings(max_examples=60, deadline=None)
@given(nested())
def test_to_jax_to_torch_round_trip(tree):
    # a bare jax.Array carries JAX's dtype: int64 comes back as the int32 that holds it without x64
    # (a JaxTensor carries its torch dtype: see test_dtype_identity.py)
    back = jaxtorch.to_torch(jaxtorch.to_jax(tree))
    _assert_same(_as_held(tree), back)


def _as_held(tree):
    from jaxtorch.bridge.core._dtypes import to_jax_dtype, to_torch_dtype

    return tree_map(lambda x: x.to(to_torch_dtype(to_jax_dtype(x.dtype))) if isinstance(x, torch.Tensor) else x, tree)


def _arrays(tree, kind=jax.Array):
    found = []
    tree_map(lambda x: found.append(x) if isinstance(x, (kind, torch.Tensor)) else None, tree)
    return found


@settings(max_examples=60, deadline=None)
@given(nested())
def test_torch_view_jax_view_round_trip_is_identity(tree):
    arrays = jaxtorch.to_jax(tree)
    viewed = jaxtorch.torch_view(arrays)
    leaves, tleaves = _arrays(arrays), _arrays(jaxtorch.jax_view(viewed))
    assert all(isinstance(t, JaxTensor) for t in _arrays(viewed, JaxTensor))
    assert len(leaves) == len(tleaves)
    for a, b in zip(leaves, tleaves):
        assert a is b  # no copy either way


def test_to_jax_shares_memory_of_contiguous_tensor():
    """A large tensor is not copied: its memory is made copy-on-write (issue 22: snapshots)."""
    t = torch.arange(1 << 16, dtype=torch.float32)
    a = jaxtorch.to_jax(t)
    assert a.unsafe_buffer_pointer() == t.const_data_ptr()


def test_to_torch_copies():
    """JAX arrays never change: `to_torch` gives torch its own memory to write (see test_safety)."""
    a = jnp.arange(1024, dtype=jnp.float32)
    t = jaxtorch.to_torch(a)
    assert t.data_ptr() != a.unsafe_buffer_pointer()
    np.testing.assert_array_equal(t.numpy(), np.asarray(a))


def test_non_contiguous_tensor_converted_correctly():
    t = torch.arange(12.0).reshape(3, 4).T
    assert not t.is_contiguous()
    np.testing.assert_array_equal(np.asarray(jaxtorch.to_jax(t)), t.numpy())
    s = torch.arange(20.0)[::3]
    np.testing.assert_array_equal(np.asarray(jaxtorch.to_jax(s)), s.numpy())


def test_dtypes_convert_both_ways():
    assert jaxtorch.to_jax(torch.float32) == jnp.float32
    assert jaxtorch.to_torch(jnp.dtype(jnp.bfloat16)) == torch.bfloat16
    assert jaxtorch.to_torch(jnp.float16) == torch.float16


def test_int64_is_stored_as_int32_and_keeps_its_dtype():
    t = torch.tensor([1, 2, 3])
    a = jaxtorch.to_jax(t)
    assert a.dtype == jnp.int32  # what JAX holds without x64
    assert JaxTensor(a).dtype == torch.int32  # a bare array is its own dtype
    assert jaxtorch.to_torch(a).dtype == torch.int32
    j = t.to("jax")  # a tensor keeps its torch dtype
    assert j.dtype == torch.int64 and j.jax().dtype == jnp.int32
    assert j.cpu().dtype == torch.int64 and j.cpu().tolist() == [1, 2, 3]
    assert jaxtorch.to_torch(j).dtype == torch.int64


def test_int32_reads_back_as_int32():
    back = jaxtorch.to_torch(jaxtorch.to_jax(torch.tensor([1, 2], dtype=torch.int32)))
    assert back.dtype == torch.int32
    assert back.tolist() == [1, 2]


def test_torch_dtype_of_a_bare_array_ignores_x64():
    """A bare array's torch dtype is its own whatever x64 says (int32 is torch.int32)."""
    a, f = jnp.arange(3, dtype=jnp.int32), jnp.ones(2, jnp.float32)
    assert (JaxTensor(a).dtype, JaxTensor(f).dtype) == (torch.int32, torch.float32)
    with enable_x64():
        assert (JaxTensor(jnp.arange(3, dtype=jnp.int32)).dtype, JaxTensor(f).dtype) == (torch.int32, torch.float32)
        assert JaxTensor(jnp.arange(3, dtype=jnp.int64)).dtype == torch.int64
    assert JaxTensor(a).dtype == torch.int32


def test_float64_without_x64_is_a_clear_error():
    with pytest.raises(jaxtorch.Float64Error, match="jax_enable_x64"):
        jaxtorch.to_jax(torch.zeros(2, dtype=torch.float64))


def test_return_types_and_model_output_are_jax_pytrees():
    out = jaxtorch.call_torch(lambda x: torch.sort(x), jnp.array([3.0, 1.0, 2.0]))
    assert type(out).__name__ == "sort"
    np.testing.assert_array_equal(np.asarray(out.values), [1.0, 2.0, 3.0])
    jitted = jax.jit(lambda x: jaxtorch.call_torch(torch.sort, x))(jnp.array([3.0, 1.0, 2.0]))
    assert type(jitted) is type(out)
    np.testing.assert_array_equal(np.asarray(jitted.indices), [1, 2, 0])


def test_model_output_through_jit():
    from transformers.modeling_outputs import BaseModelOutput

    def f(x):
        return BaseModelOutput(last_hidden_state=x * 2)

    out = jax.jit(lambda x: jaxtorch.call_torch(f, x))(jnp.ones(3))
    assert isinstance(out, BaseModelOutput)
    np.testing.assert_array_equal(np.asarray(out.last_hidden_state), [2.0, 2.0, 2.0])


def test_dataclass_result_through_jit():
    out = jax.jit(lambda x: jaxtorch.call_torch(lambda t: Pair(t * 2, None), x))(jnp.ones(2))
    assert isinstance(out, Pair)
    assert out.b is None
    np.testing.assert_array_equal(np.asarray(out.a), [2.0, 2.0])
