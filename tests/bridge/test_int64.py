"""int64/uint64 values beyond 32 bits with JAX's 64-bit mode off are refused, never wrapped
(issue 22, item 5): every concrete conversion and factory raises `Int64Error`; with 64-bit
mode on the values are exact."""

import jax
import jax.numpy as jnp
import pytest
import torch

import jaxtorch
from jaxtorch import Int64Error, JaxtorchError

BIG = 2**40


class _Counter(torch.nn.Module):
    def __init__(self, value):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.register_buffer("count", torch.tensor([value, 5]))

    def forward(self, x):
        return self.lin(x) + self.count.float().sum()


CASES = {
    "to_jax": lambda: jaxtorch.to_jax(torch.tensor([BIG, 5])),
    "to_jax_negative": lambda: jaxtorch.to_jax(torch.tensor([-BIG, 5])),
    "to_jax_scalar": lambda: jaxtorch.to_jax(torch.tensor(BIG)),
    "to_jax_uint64": lambda: jaxtorch.to_jax(torch.tensor([2**33], dtype=torch.uint64)),
    ".to(jax)": lambda: torch.tensor([BIG, 5]).to("jax"),
    "tensor(device=jax)": lambda: torch.tensor([BIG], device="jax"),
    "copy_": lambda: torch.zeros(2, dtype=torch.int64, device="jax").copy_(torch.tensor([BIG, 1])),
    "full": lambda: torch.full((2,), BIG, device="jax"),
    "full_int64": lambda: torch.full((2,), -BIG, dtype=torch.int64, device="jax"),
    "full_like": lambda: torch.full_like(torch.zeros(2, dtype=torch.int64, device="jax"), BIG),
    "new_full": lambda: torch.zeros(2, dtype=torch.int64, device="jax").new_full((2,), BIG),
    "fill_": lambda: torch.zeros(2, dtype=torch.int64, device="jax").fill_(BIG),
    "arange_start": lambda: torch.arange(BIG, BIG + 3, device="jax"),
    "arange_end": lambda: torch.arange(0, 2**33, 2**31, device="jax"),
    "module.to": lambda: _Counter(BIG).to("jax"),
    "extract": lambda: jaxtorch.extract(_Counter(BIG)),
    "call_torch_constant": lambda: jaxtorch.call_torch(lambda a: a + torch.tensor([BIG]), jnp.ones(1, jnp.int32)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_values_beyond_32_bits_raise(env, name):
    with pytest.raises(Int64Error, match="jax_enable_x64"):
        CASES[name]()


def test_error_kinds():
    assert issubclass(Int64Error, JaxtorchError) and issubclass(Int64Error, OverflowError)


@pytest.mark.parametrize("value", [2**31 - 1, -(2**31)])
def test_values_at_the_int32_bounds_are_exact(env, value):
    t = torch.tensor([value, 0])
    assert t.to("jax").cpu().tolist() == [value, 0]
    assert jaxtorch.to_jax(t).tolist() == [value, 0]
    assert torch.full((1,), value, device="jax").cpu().tolist() == [value]
    _, fn = jaxtorch.extract(_Counter(value))
    assert fn.state["count"].tolist() == [value, 5]  # a buffer: state, not params


def test_lazy_mode_factories_raise(env):
    with jaxtorch.lazy(), pytest.raises(Int64Error):
        torch.full((2,), BIG, device="jax")


def test_float_values_are_not_checked(env):
    assert torch.tensor([float(BIG)]).to("jax").cpu().tolist() == [float(BIG)]
    assert (torch.ones(1, device="jax") * BIG).cpu().tolist() == [float(BIG)]


@pytest.mark.parametrize("name", [n for n in CASES if n not in ("extract", "module.to", "call_torch_constant")])
def test_exact_with_x64(env, x64, name):
    out = CASES[name]()
    values = out.cpu() if isinstance(out, torch.Tensor) else torch.from_numpy(jax.device_get(out).copy())
    assert max(abs(v) for v in values.flatten().tolist()) >= 2**31  # kept, not wrapped


def test_extract_exact_with_x64(x64):
    params, fn = jaxtorch.extract(_Counter(BIG))
    assert fn.state["count"].dtype == jnp.int64 and fn.state["count"].tolist() == [BIG, 5]
    out = fn(params, jnp.zeros((1, 2), jnp.float32))
    assert out.shape == (1, 2)


_MASKED = {
    "amax": lambda x, m: torch.masked.amax(x, 1, mask=m),
    "amin": lambda x, m: torch.masked.amin(x, 1, mask=m),
    "argmax": lambda x, m: torch.masked.argmax(x, 1, mask=m),
    "argmin": lambda x, m: torch.masked.argmin(x, 1, mask=m),
}


@pytest.mark.parametrize("name", list(_MASKED))
def test_int64_sentinels_of_masked_reductions_raise_naming_the_way_out(name):
    # issue 30 item 7: torch fills masked-out int64 elements with iinfo(int64).min/max; an int32 stand-in
    # would be inexact (a fully masked row: torch reports -9223372036854775808), so the error says why
    # and names `x.int()`, which is exact
    fn = _MASKED[name]
    x = torch.tensor([[3, 1, 7], [2, 9, -(2**31)]])
    m = torch.tensor([[True, False, True], [False, False, False]])
    if not jax.config.jax_enable_x64:
        with pytest.raises(Int64Error, match=r"torch.iinfo\(torch.int64\).m..: the identity .*`x.int\(\)`"):
            fn(x.to("jax"), m.to("jax"))
    want = fn(x.int(), m)
    got = fn(x.int().to("jax"), m.to("jax")).cpu()
    assert got.dtype == want.dtype and torch.equal(got, want)  # fully masked row included


def test_int64_sentinel_fill_values_raise_naming_the_sentinel():
    lo = torch.iinfo(torch.int64).min
    with pytest.raises(Int64Error, match=r"iinfo\(torch.int64\).min"):
        torch.full((2,), lo, device="jax")
    with pytest.raises(Int64Error, match="masked_fill"):  # was a raw OverflowError from JAX
        torch.tensor([1, 2], device="jax").masked_fill(torch.tensor([True, False], device="jax"), lo)
    with pytest.raises(Int64Error) as err:  # user data beyond int32: no sentinel note
        torch.full((2,), 2**40, device="jax")
    assert "iinfo" not in str(err.value)
