"""dtype identity on the jax device (issue 23 item 1) and int64 beyond 32 bits with x64 off (issue 22 item 5)."""

from __future__ import annotations

import jax.numpy as jnp
import torch

import jaxtorch
from tests._dtypes import ARITH

from .harness import case, equal, refuses_or

DTYPES = {str(d).removeprefix("torch."): d for d in (*ARITH, torch.float64, torch.complex64)}
WIDE = ("float64", "int64", "complex128")  # may be refused with x64 off, never changed


def _values(dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor([0, 1, 1, 0, 1]).to(dtype) if dtype == torch.bool else torch.arange(5).to(dtype)


for _name, _dtype in DTYPES.items():

    @case(f"dtype/factory/{_name}")
    def _factory(dtype=_dtype):
        def check():
            with jaxtorch.default_env():
                t = torch.zeros(3, dtype=dtype, device="jax")
                assert t.dtype == dtype, t.dtype
                assert t.cpu().dtype == dtype, t.cpu().dtype

        refuses_or(check, "x64", "float64")

    @case(f"dtype/to_and_back/{_name}")
    def _round_trip(dtype=_dtype):
        def check():
            x = _values(dtype)
            with jaxtorch.default_env():
                j = x.to("jax")
                assert j.dtype == dtype, j.dtype
                back = j.cpu()
            equal(back, x)

        refuses_or(check, "x64", "float64")

    @case(f"dtype/to_torch_of_to_jax/{_name}")
    def _convert(dtype=_dtype):
        def check():
            x = _values(dtype)
            equal(jaxtorch.to_torch(jaxtorch.to_jax(x)), x)

        refuses_or(check, "x64", "float64")

    @case(f"dtype/module_buffer/{_name}")
    def _buffer(dtype=_dtype):
        def check():
            m = torch.nn.Module()
            m.register_buffer("b", _values(dtype))
            with jaxtorch.default_env():
                m.to("jax")
                assert m.b.dtype == dtype, m.b.dtype
                m.to("cpu")
            equal(m.b, _values(dtype))

        refuses_or(check, "x64", "float64")


@case("dtype/to_torch_of_jnp_int32")
def _jnp_int32():
    assert jaxtorch.to_torch(jnp.arange(3, dtype=jnp.int32)).dtype == torch.int32


@case("dtype/to_torch_of_jnp_uint32")
def _jnp_uint32():
    t = jaxtorch.to_torch(jnp.arange(3, dtype=jnp.uint32))
    assert t.dtype == torch.uint32, t.dtype


PROMOTIONS = {
    "int32+int64": (torch.int32, torch.int64, lambda a, b: a + b),
    "int32*int16": (torch.int32, torch.int16, lambda a, b: a * b),
    "uint8+int8": (torch.uint8, torch.int8, lambda a, b: a + b),
    "bool+int32": (torch.bool, torch.int32, lambda a, b: a + b),
    "int32+1.5": (torch.int32, None, lambda a, b: a + 1.5),
    "int32+7": (torch.int32, None, lambda a, b: a + 7),
    "int16/int16": (torch.int16, torch.int16, lambda a, b: a / (b + 1)),
    "float16+float32": (torch.float16, torch.float32, lambda a, b: a + b),
    "bfloat16+float16": (torch.bfloat16, torch.float16, lambda a, b: a + b),
    "int32.sum": (torch.int32, None, lambda a, b: a.sum()),
    "int8.cumsum": (torch.int8, None, lambda a, b: a.cumsum(0)),
    "uint8.argmax": (torch.uint8, None, lambda a, b: a.argmax()),
}

for _name, (_da, _db, _op) in PROMOTIONS.items():

    @case(f"dtype/promotion/{_name}")
    def _promotion(da=_da, db=_db, op=_op):
        a = _values(da)
        b = _values(db) if db is not None else None
        expected = op(a, b)
        with jaxtorch.default_env():
            got = op(a.to("jax"), b.to("jax") if b is not None else None)
            assert got.dtype == expected.dtype, (got.dtype, expected.dtype)
            got = got.cpu()
        equal(got, expected)


# ---- int64 with x64 off: exact or refused, never wrapped ---------------------------------------
BIG = 2**40


@case("int64/to_jax_big")
def _to_jax_big():
    def check():
        a = jaxtorch.to_jax(torch.tensor([BIG, 5]))
        assert [int(v) for v in a] == [BIG, 5], a

    refuses_or(check, "x64")


@case("int64/call_torch_sum_overflow")
def _sum_overflow():
    def check():
        out = jaxtorch.call_torch(lambda a: a.long().sum(), jnp.full((3,), 2**30, dtype=jnp.int32))
        assert int(out) == 3 * 2**30, out

    refuses_or(check, "x64")


@case("int64/factory_full")
def _factory_full():
    def check():
        with jaxtorch.default_env():
            t = torch.full((2,), BIG, device="jax")
            assert t.cpu().tolist() == [BIG, BIG], t.cpu()

    refuses_or(check, "x64")


@case("int64/factory_tensor")
def _factory_tensor():
    def check():
        with jaxtorch.default_env():
            t = torch.tensor([BIG, -BIG], device="jax")
            assert t.cpu().tolist() == [BIG, -BIG]

    refuses_or(check, "x64")


@case("int64/to_device_big")
def _to_device_big():
    def check():
        with jaxtorch.default_env():
            t = torch.tensor([BIG, 1]).to("jax")
            assert t.cpu().tolist() == [BIG, 1]

    refuses_or(check, "x64")


@case("int64/extract_buffer_big")
def _extract_big():
    def check():
        m = torch.nn.Module()
        m.register_buffer("big", torch.tensor([BIG]))
        m.forward = lambda x: x
        params, fn = jaxtorch.extract(m)
        leaves = {**params, **fn.state}
        assert int(leaves["big"][0]) == BIG

    refuses_or(check, "x64")


@case("int64/small_values_still_work")
def _small_ok():
    with jaxtorch.default_env():
        t = torch.tensor([2**31 - 1, -(2**31)]).to("jax")
        assert t.dtype == torch.int64
        assert t.cpu().tolist() == [2**31 - 1, -(2**31)]
