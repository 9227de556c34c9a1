"""Every torch dtype keeps its identity on the jax device, whatever JAX stores (issue 23, item 1).

With JAX's 64-bit mode off, `torch.int64` is held as int32 and must still read `torch.int64`;
`torch.int32` must read `torch.int32`. Each check is against CPU torch.
"""

import jax
import jax.numpy as jnp
import pytest
import torch

import jaxtorch
from jaxtorch.bridge.core._dtypes import to_jax_dtype
from tests._dtypes import ARITH, DTYPES, WIDE  # env and x64: tests/bridge/conftest.py


def _sample(dtype, n=4) -> torch.Tensor:
    return torch.arange(n).to(dtype) if dtype != torch.bool else torch.tensor([True, False] * (n // 2))


def _assert_same(j: torch.Tensor, c: torch.Tensor) -> None:
    assert j.device.type == "jax"
    assert j.dtype == c.dtype, (j.dtype, c.dtype)
    back = j.cpu()
    assert back.dtype == c.dtype
    assert torch.equal(back, c)


# ---- factories, moves and round trips ----------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_factories_keep_dtype(env, dtype):
    for make in (torch.zeros, torch.ones, torch.empty):
        assert make(3, dtype=dtype, device="jax").dtype == dtype
    _assert_same(torch.zeros(3, dtype=dtype, device="jax"), torch.zeros(3, dtype=dtype))
    _assert_same(torch.full((2,), 1, dtype=dtype, device="jax"), torch.full((2,), 1, dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_to_jax_and_cpu_round_trip_keeps_dtype(env, dtype):
    c = _sample(dtype)
    j = c.to("jax")
    _assert_same(j, c)
    assert j.jax().dtype == to_jax_dtype(dtype)  # what JAX holds (int64: int32 without x64)
    assert jaxtorch.to_torch(j).dtype == dtype  # a JaxTensor carries its dtype
    _assert_same(torch.tensor(c.tolist(), dtype=dtype, device="jax"), c)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_views_copies_and_writes_keep_dtype(env, dtype):
    c = _sample(dtype, 6)
    j = c.to("jax")
    _assert_same(j[1:], c[1:])
    _assert_same(j.view(2, 3).t(), c.view(2, 3).t())
    _assert_same(j.clone(), c.clone())
    _assert_same(j.detach(), c.detach())
    j2, c2 = j.clone(), c.clone()
    j2[0] = c[1].item()
    c2[0] = c[1].item()
    _assert_same(j2, c2)


def test_dtype_casts(env):
    c = torch.arange(4, dtype=torch.int32)
    j = c.to("jax")
    _assert_same(j.long(), c.long())
    _assert_same(j.long().int(), c.long().int())
    _assert_same(j.to(torch.int64).to(torch.int32), c.to(torch.int64).to(torch.int32))
    _assert_same(j.to("cpu", torch.int64).to("jax"), c.long())
    _assert_same(torch.zeros(2, dtype=torch.int32).to("jax", torch.int64), torch.zeros(2, dtype=torch.int64))


def test_to_torch_of_a_jax_array_is_its_own_dtype():
    assert jaxtorch.to_torch(jnp.zeros(2, jnp.int32)).dtype == torch.int32
    assert jaxtorch.to_torch(jnp.zeros(2, jnp.uint32)).dtype == torch.uint32
    # torch_view (call_torch's inputs): JAX's default integer is torch's default integer
    assert jaxtorch.torch_view(jnp.zeros(2, jnp.int32)).dtype == torch.int64
    assert jaxtorch.to_torch(jnp.int32) == torch.int32


@pytest.mark.parametrize("dtype", WIDE + [torch.int64, torch.uint64], ids=str)
def test_wide_dtypes_with_x64(env, x64, dtype):
    c = _sample(dtype)
    _assert_same(c.to("jax"), c)
    _assert_same(torch.zeros(2, dtype=dtype, device="jax"), torch.zeros(2, dtype=dtype))
    assert jaxtorch.to_torch(jnp.zeros(2, to_jax_dtype(dtype))).dtype == dtype


# ---- module buffers ----------------------------------------------------------------------------
class _Buffers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        for d in DTYPES:
            self.register_buffer("b_" + str(d).split(".")[1], _sample(d))
        self.seen: dict = {}  # (a dict mutated in place: `extract`'s fn restores replaced attributes)

    def forward(self, x):
        self.seen.update({name: b.dtype for name, b in self.named_buffers()})
        return self.lin(x)


def test_module_to_jax_keeps_buffer_dtypes(env):
    m = _Buffers()
    want = {name: b.dtype for name, b in m.named_buffers()}
    m.to("jax")
    assert {name: b.dtype for name, b in m.named_buffers()} == want
    m(torch.ones(1, 2, device="jax"))
    assert m.seen == want
    m.cpu()
    assert {name: b.dtype for name, b in m.named_buffers()} == want


def test_extract_fn_binds_buffers_with_their_dtypes():
    m = _Buffers()
    want = {name: b.dtype for name, b in m.named_buffers()}
    params, fn = jaxtorch.extract(m)
    fn(params, jnp.ones((1, 2)))
    assert m.seen == want  # inside the forward, int64 buffers are int64, int32 are int32
    m.seen.clear()
    jax.jit(fn)(params, jnp.ones((1, 2)))
    assert m.seen == want


def test_batchnorm_counter_stays_int64_through_a_mutable_fn():
    m = torch.nn.BatchNorm1d(3)
    params, fn = jaxtorch.extract(m, mutable=True)
    seen = []
    m.register_forward_hook(lambda mod, i, o: seen.append(mod.num_batches_tracked.dtype))
    _, new = fn(params, jnp.ones((4, 3)))
    assert seen == [torch.int64]
    assert int(new["num_batches_tracked"]) == 1


def test_call_torch_sees_torch_dtypes():
    def f(a):
        i32, i64 = a.int(), a.long()
        assert (i32.dtype, i64.dtype, (i32 + i64).dtype, (i32 + 1).dtype) == (
            torch.int32,
            torch.int64,
            torch.int64,
            torch.int32,
        )
        return (i32 * 2).float()

    out = jaxtorch.call_torch(f, jnp.arange(3.0))
    assert out.tolist() == [0.0, 2.0, 4.0]
    jax.jit(lambda a: jaxtorch.call_torch(f, a))(jnp.arange(3.0))


# ---- op results: torch's promotion, op by op ------------------------------------------------------
def _pairs():
    return [(a, b) for a in ARITH for b in ARITH]


@pytest.mark.parametrize(("a", "b"), _pairs(), ids=lambda d: str(d).split(".")[1])
def test_add_result_dtype_matches_cpu(env, a, b):
    x, y = _sample(a), _sample(b)
    if a == b == torch.bool:
        _assert_same(x.to("jax") | y.to("jax"), x | y)
    else:
        _assert_same(x.to("jax") + y.to("jax"), x + y)


@pytest.mark.parametrize("dtype", ARITH, ids=str)
@pytest.mark.parametrize("scalar", [1, 1.5, True], ids=["int", "float", "bool"])
def test_scalar_promotion_matches_cpu(env, dtype, scalar):
    x = _sample(dtype)
    if dtype == torch.bool and scalar is True:
        _assert_same(x.to("jax") | scalar, x | scalar)
        return
    _assert_same(x.to("jax") * scalar, x * scalar)
    _assert_same(x.to("jax") > scalar, x > scalar)


_INT_OPS = {
    "sum": lambda x: x.sum(),
    "sum_dim": lambda x: x.sum(0),
    "prod": lambda x: x.prod(),
    "cumsum": lambda x: x.cumsum(0),
    "argmax": lambda x: x.argmax(),
    "max_indices": lambda x: x.max(0).indices,
    "sort_values": lambda x: x.sort().values,
    "sort_indices": lambda x: x.sort().indices,
    "topk_indices": lambda x: x.topk(2).indices,
    "nonzero": lambda x: x.nonzero(),
    "abs": lambda x: x.abs(),
    "neg": lambda x: -x,
    "floor_divide": lambda x: x // 2,
    "true_divide": lambda x: x / 2,
    "remainder": lambda x: x % 3,
    "where": lambda x: torch.where(x > 1, x, torch.zeros_like(x)),
    "clamp": lambda x: x.clamp(1, 2),
    "cat_long": lambda x: torch.cat([x, x.long()]),
    "stack": lambda x: torch.stack([x, x]),
    "index_select": lambda x: x.index_select(0, torch.tensor([0, 2], dtype=torch.int32, device=x.device)),
    "gather": lambda x: x.gather(0, torch.tensor([1, 0], device=x.device)),
    "bitwise_and": lambda x: x & 3,
    "shift": lambda x: x << 1,
    "mean_float": lambda x: x.float().mean(),
    "arange_like": lambda x: torch.arange(3, device=x.device),
    "arange_int32": lambda x: torch.arange(3, dtype=torch.int32, device=x.device),
    "randint": lambda x: torch.randint(0, 5, (3,), device=x.device).zero_(),
    "randint_int32": lambda x: torch.randint(0, 5, (3,), dtype=torch.int32, device=x.device).zero_(),
    "full_like": lambda x: torch.full_like(x, 2),
    "new_zeros": lambda x: x.new_zeros(2),
    "one_hot": lambda x: torch.nn.functional.one_hot(x.long(), 5),
    "bincount": lambda x: torch.bincount(x.long()),
    "unique_inverse": lambda x: torch.unique(x, return_inverse=True)[1],
    "searchsorted": lambda x: torch.searchsorted(x, x),
    "searchsorted_int32": lambda x: torch.searchsorted(x, x, out_int32=True),
}


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.int16], ids=str)
@pytest.mark.parametrize("op", list(_INT_OPS), ids=str)
def test_integer_op_results_match_cpu(env, dtype, op):
    c = torch.tensor([3, 1, 2, 0]).to(dtype)
    fn = _INT_OPS[op]
    try:
        want = fn(c)
    except (RuntimeError, NotImplementedError):
        pytest.skip(f"CPU torch has no {op} for {dtype}")
    _assert_same(fn(c.to("jax")), want)


@pytest.mark.parametrize("op", ["sum", "argmax", "cumsum", "sort_indices", "where", "cat_long", "nonzero"])
def test_integer_op_results_in_lazy_mode(env, op):
    c = torch.tensor([3, 1, 2, 0], dtype=torch.int32)
    with jaxtorch.lazy():
        j = _INT_OPS[op](c.to("jax"))
        assert j.dtype == _INT_OPS[op](c).dtype
    _assert_same(j, _INT_OPS[op](c))


def test_inplace_ops_keep_the_tensors_dtype(env):
    c = torch.arange(4, dtype=torch.int32)
    j = c.to("jax")
    j.add_(torch.ones(4, dtype=torch.int64, device="jax"))
    c.add_(torch.ones(4, dtype=torch.int64))
    _assert_same(j, c)
    out = torch.empty(4, dtype=torch.int64, device="jax")
    torch.add(j, 1, out=out)
    _assert_same(out, torch.add(c, 1, out=torch.empty(4, dtype=torch.int64)))


def test_compiled_function_keeps_int_dtypes(env):
    @jaxtorch.jit
    def f(a, b):
        assert a.dtype == torch.int32 and b.dtype == torch.int64
        return a + 1, a + b

    r1, r2 = f(torch.arange(3, dtype=torch.int32), torch.arange(3))
    assert (r1.dtype, r2.dtype) == (torch.int32, torch.int64)
    assert r2.tolist() == [0, 2, 4]
