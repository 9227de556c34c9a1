"""Creation lowerings against eager PyTorch, and random lowerings: keys, ranges, distributions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxtorch
from jaxtorch import JaxTensor


def _np(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.float() if x.dtype == torch.bfloat16 else x
        return x.detach().cpu().numpy()
    x = np.asarray(x)
    return x.astype(np.float32) if x.dtype == jnp.bfloat16 else x


def _assert_same(ref: torch.Tensor, got) -> None:
    r, g = _np(ref), _np(got)
    assert r.shape == g.shape, (r.shape, g.shape)
    assert r.dtype.kind == g.dtype.kind, (r.dtype, g.dtype)
    np.testing.assert_allclose(g, r, rtol=1e-6, atol=1e-6)


# ---- creation ---------------------------------------------------------------------------------
# Each case takes the device; the reference runs on "cpu", jaxtorch on "jax".
CREATION = {
    "arange_end": lambda d: torch.arange(5, device=d),
    "arange_float_step": lambda d: torch.arange(0, 5, 0.5, device=d),
    "arange_float_start": lambda d: torch.arange(1, 2.5, device=d),
    "arange_int64_truncates": lambda d: torch.arange(0, 5.5, dtype=torch.int64, device=d),
    "arange_negative_step": lambda d: torch.arange(10, 0, -3, device=d),
    "arange_tenths": lambda d: torch.arange(0.0, 1.0, 0.1, device=d),
    "arange_bf16": lambda d: torch.arange(-1, 1, 0.3, dtype=torch.bfloat16, device=d),
    "arange_float_dtype": lambda d: torch.arange(5, dtype=torch.float32, device=d),
    "arange_neg_int64": lambda d: torch.arange(0, -5.5, -1, dtype=torch.int64, device=d),
    "arange_empty": lambda d: torch.arange(3, 3, device=d),
    "full_int": lambda d: torch.full((2,), 3, device=d),
    "full_bool": lambda d: torch.full((2,), True, device=d),
    "full_float": lambda d: torch.full((2, 2), 2.5, device=d),
    "full_complex": lambda d: torch.full((2,), 1 + 2j, device=d),
    "full_cast": lambda d: torch.full((2,), 2.7, dtype=torch.int32, device=d),
    "zeros_bool": lambda d: torch.zeros(2, 3, dtype=torch.bool, device=d),
    "ones_scalar": lambda d: torch.ones((), device=d),
    "empty_shape": lambda d: torch.zeros_like(torch.empty(2, 5, device=d)),
    "empty_strided": lambda d: torch.zeros_like(torch.empty_strided((2, 3), (1, 2), device=d)),
    "linspace_int": lambda d: torch.linspace(0, 10, 4, dtype=torch.int64, device=d),
    "linspace": lambda d: torch.linspace(-1, 1, 7, device=d),
    "linspace_one": lambda d: torch.linspace(0, 1, 1, device=d),
    "linspace_zero": lambda d: torch.linspace(0, 1, 0, device=d),
    "linspace_complex": lambda d: torch.linspace(0, 1 + 1j, 3, device=d),
    "linspace_tensor": lambda d: torch.linspace(torch.tensor(-2.0, device=d), torch.tensor(3.0, device=d), 6),
    "logspace": lambda d: torch.logspace(0, 3, 4, device=d),
    "logspace_int": lambda d: torch.logspace(0.5, 2.5, 3, dtype=torch.int64, device=d),
    "logspace_base2": lambda d: torch.logspace(0, 1, 5, base=2, device=d),
    "eye": lambda d: torch.eye(3, device=d),
    "eye_nm": lambda d: torch.eye(2, 4, dtype=torch.int64, device=d),
    "tril_indices": lambda d: torch.tril_indices(4, 3, -1, device=d),
    "triu_indices": lambda d: torch.triu_indices(3, 5, 1, device=d),
    "tril_indices_empty": lambda d: torch.tril_indices(0, 3, device=d),
    "scalar_tensor": lambda d: torch.scalar_tensor(3, device=d),
    "scalar_tensor_bool": lambda d: torch.scalar_tensor(True, dtype=torch.bool, device=d),
    "complex": lambda d: torch.complex(torch.ones(2, device=d), torch.arange(2.0, device=d)),
    "polar": lambda d: torch.polar(torch.ones(2, device=d), torch.tensor([0.0, 1.0], device=d)),
    "tensor_int": lambda d: torch.tensor([1, 2], device=d),
    "tensor_float": lambda d: torch.tensor([[1.0, 2.0]], device=d),
    "as_tensor": lambda d: torch.as_tensor([[1, 2]], device=d),
    "from_numpy": lambda d: torch.from_numpy(np.arange(3.0, dtype=np.float32)).to(d),
    "fill_scalar": lambda d: torch.zeros(3, device=d).fill_(2),
    "fill_int_trunc": lambda d: torch.zeros(3, dtype=torch.int64, device=d).fill_(2.7),
    "fill_tensor": lambda d: torch.zeros(3, device=d).fill_(torch.tensor(4.0, device=d)),
    "fill_view": lambda d: _fill_view(d),
    "zero_": lambda d: torch.ones(2, 2, device=d).zero_(),
    "new_full": lambda d: torch.ones(2, 2, device=d).new_full((3,), 7),
    "new_ones_int": lambda d: torch.ones(2, dtype=torch.int64, device=d).new_ones(2),
    "new_zeros": lambda d: torch.ones(2, dtype=torch.bool, device=d).new_zeros((2, 1)),
    "new_empty": lambda d: torch.zeros_like(torch.ones(2, device=d).new_empty((2,))),
    "zeros_like_bool": lambda d: torch.zeros_like(torch.ones(2, dtype=torch.bool, device=d)),
    "ones_like_dtype": lambda d: torch.ones_like(torch.ones(2, device=d), dtype=torch.int64),
    "full_like_cast": lambda d: torch.full_like(torch.ones(2, dtype=torch.int64, device=d), 3.9),
}


def _fill_view(d):
    x = torch.zeros(3, 4, device=d)
    x[:, 1].fill_(5.0)
    return x


@pytest.mark.parametrize("name", sorted(CREATION))
def test_creation_eager_matches_torch(name):
    ref = CREATION[name]("cpu")
    got = jaxtorch.call_torch(lambda: CREATION[name]("jax"))
    assert isinstance(got, jax.Array)
    _assert_same(ref, got)


@pytest.mark.parametrize("name", sorted(CREATION))
def test_creation_jit_matches_torch(name):
    ref = CREATION[name]("cpu")
    got = jax.jit(lambda: jaxtorch.call_torch(lambda: CREATION[name]("jax")))()
    _assert_same(ref, got)


def test_enable_globally_factories_are_jax_tensors():
    with jaxtorch.default_env():
        x = torch.arange(6, device="jax").reshape(2, 3)
        y = torch.full((2, 3), 0.5, device="jax")
        assert isinstance(x, JaxTensor) and x.dtype == torch.int64 and x.device.type == "jax"
        assert isinstance(y, JaxTensor) and y.dtype == torch.float32
        z = (x * y).cpu()
    torch.testing.assert_close(z, torch.arange(6).reshape(2, 3) * 0.5)


def test_linspace_traced_endpoints():
    f = jax.jit(lambda a, b: jaxtorch.call_torch(lambda s, e: torch.linspace(s, e, 5), a, b))
    got = f(jnp.asarray(1.0), jnp.asarray(3.0))
    np.testing.assert_allclose(np.asarray(got), torch.linspace(1.0, 3.0, 5).numpy(), rtol=1e-6)


def test_arange_bad_range_raises():
    with pytest.raises(RuntimeError, match="inconsistent with step sign"):
        jaxtorch.call_torch(lambda: torch.arange(5, 0, 1, device="jax"))


def test_factory_without_device_is_jax_inside_call_torch():
    seen = {}

    def f():
        z = torch.zeros(3)
        seen["type"] = type(z)
        return z

    jaxtorch.call_torch(f)
    assert seen["type"] is JaxTensor


# ---- random -----------------------------------------------------------------------------------
RANDOM = {
    "rand": lambda: torch.rand(2, 3, device="jax"),
    "rand_bf16": lambda: torch.rand(5, dtype=torch.bfloat16, device="jax"),
    "randn": lambda: torch.randn(2, 3, device="jax"),
    "randint": lambda: torch.randint(3, 10, (50,), device="jax"),
    "randint_high": lambda: torch.randint(4, (50,), device="jax"),
    "randperm": lambda: torch.randperm(20, device="jax"),
    "rand_like": lambda: torch.rand_like(torch.ones(8, device="jax")),
    "randn_like": lambda: torch.randn_like(torch.ones(8, device="jax")),
    "randint_like": lambda: torch.randint_like(torch.ones(8, device="jax"), 5),
    "randint_like_low": lambda: torch.randint_like(torch.ones(8, device="jax"), -3, 5),
    "normal_": lambda: torch.empty(16, device="jax").normal_(2.0, 3.0),
    "normal_tensor_float": lambda: torch.normal(torch.zeros(8, device="jax"), 2.0),
    "normal_float_tensor": lambda: torch.normal(1.0, torch.ones(8, device="jax")),
    "normal_tensor_tensor": lambda: torch.normal(torch.zeros(8, device="jax"), torch.ones(2, 1, device="jax")),
    "normal_sized": lambda: torch.normal(0.0, 1.0, (4, 4), device="jax"),
    "uniform_": lambda: torch.empty(16, device="jax").uniform_(-2.0, 5.0),
    "bernoulli": lambda: torch.bernoulli(torch.full((32,), 0.5, device="jax")),
    "bernoulli_p": lambda: torch.bernoulli(torch.zeros(32, device="jax"), 0.3),
    "bernoulli_": lambda: torch.zeros(32, device="jax").bernoulli_(0.3),
    "bernoulli_tensor_": lambda: torch.zeros(32, device="jax").bernoulli_(torch.full((32,), 0.5, device="jax")),
    "exponential_": lambda: torch.empty(16, device="jax").exponential_(2.0),
    "geometric_": lambda: torch.empty(16, device="jax").geometric_(0.3),
    "log_normal_": lambda: torch.empty(16, device="jax").log_normal_(),
    "cauchy_": lambda: torch.empty(16, device="jax").cauchy_(),
    "random_": lambda: torch.empty(16, device="jax").random_(),
    "random_to": lambda: torch.empty(16, dtype=torch.int64, device="jax").random_(10),
    "random_from_to": lambda: torch.empty(16, dtype=torch.int64, device="jax").random_(-3, 3),
    "random_int64": lambda: torch.empty(16, dtype=torch.int64, device="jax").random_(),
    "multinomial": lambda: torch.multinomial(torch.ones(2, 10, device="jax"), 4),
    "multinomial_replacement": lambda: torch.multinomial(torch.ones(10, device="jax"), 30, True),
    "poisson": lambda: torch.poisson(torch.full((16,), 3.0, device="jax")),
    "binomial": lambda: torch.binomial(torch.full((16,), 10.0, device="jax"), torch.full((16,), 0.5, device="jax")),
    "standard_gamma": lambda: torch._standard_gamma(torch.ones(16, device="jax")),
    "dirichlet": lambda: torch._sample_dirichlet(torch.ones(4, 3, device="jax")),
    "normal_into_view": lambda: _normal_into_view(),
}


def _normal_into_view():
    x = torch.zeros(4, 5, device="jax")
    x[1:3].normal_()
    return x


def _run(name, key):
    return np.asarray(jaxtorch.call_torch(RANDOM[name], rng=key))


@pytest.mark.parametrize("name", sorted(RANDOM))
def test_random_same_key_same_values_different_keys_differ(name):
    k0, k1 = jax.random.key(0), jax.random.key(1)
    a, b, c = _run(name, k0), _run(name, k0), _run(name, k1)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    jitted = jax.jit(lambda k: jaxtorch.call_torch(RANDOM[name], rng=k))
    ja, jb, jc = np.asarray(jitted(k0)), np.asarray(jitted(k0)), np.asarray(jitted(k1))
    np.testing.assert_array_equal(ja, jb)
    assert not np.array_equal(ja, jc)
    assert ja.shape == a.shape and ja.dtype == a.dtype
    np.testing.assert_allclose(_np(ja), _np(a), rtol=1e-5, atol=1e-5)  # jit may reorder float math


@pytest.mark.parametrize(
    "name,dtype,shape",
    [
        ("rand", torch.float32, (2, 3)),
        ("rand_bf16", torch.bfloat16, (5,)),
        ("randint", torch.int64, (50,)),
        ("randperm", torch.int64, (20,)),
        ("randint_like", torch.float32, (8,)),
        ("multinomial", torch.int64, (2, 4)),
        ("multinomial_replacement", torch.int64, (30,)),
        ("random_to", torch.int64, (16,)),
        ("bernoulli_", torch.float32, (32,)),
        ("normal_tensor_tensor", torch.float32, (2, 8)),
        ("poisson", torch.float32, (16,)),
        ("dirichlet", torch.float32, (4, 3)),
    ],
)
def test_random_dtypes_and_shapes(name, dtype, shape):
    with jaxtorch.default_env():
        t = RANDOM[name]()
    assert isinstance(t, JaxTensor) and t.dtype == dtype and tuple(t.shape) == shape


def _sample(fn, key=0):
    return np.asarray(jaxtorch.call_torch(fn, rng=jax.random.key(key))).astype(np.float64)


def test_ranges():
    u = _sample(lambda: torch.empty(20000, device="jax").uniform_(-2.0, 5.0))
    assert u.min() >= -2.0 and u.max() < 5.0 and abs(u.mean() - 1.5) < 0.05
    r = _sample(lambda: torch.rand(20000, device="jax"))
    assert r.min() >= 0.0 and r.max() < 1.0
    i = _sample(lambda: torch.randint(3, 10, (20000,), device="jax"))
    assert set(np.unique(i)) == set(range(3, 10))
    p = _sample(lambda: torch.randperm(50, device="jax"))
    assert sorted(p) == list(range(50))
    rt = _sample(lambda: torch.empty(20000, dtype=torch.int64, device="jax").random_(-3, 3))
    assert set(np.unique(rt)) == set(range(-3, 3))
    rf = _sample(lambda: torch.empty(20000, device="jax").random_())
    assert rf.min() >= 0 and rf.max() <= 2**24 and np.all(rf == np.round(rf)) and rf.max() > 2**23
    ru8 = _sample(lambda: torch.empty(20000, dtype=torch.uint8, device="jax").random_())
    assert ru8.min() == 0 and ru8.max() == 255
    ri = _sample(lambda: torch.empty(20000, dtype=torch.int64, device="jax").random_())
    assert ri.min() >= 0 and ri.max() > 2**30
    rb = _sample(lambda: torch.empty(1000, dtype=torch.bool, device="jax").random_())
    assert set(np.unique(rb)) == {0.0, 1.0}


def test_distribution_moments():
    n = 40000
    z = _sample(lambda: torch.empty(n, device="jax").normal_(2.0, 3.0))
    assert abs(z.mean() - 2.0) < 0.06 and abs(z.std() - 3.0) < 0.06
    e = _sample(lambda: torch.empty(n, device="jax").exponential_(2.0))
    assert e.min() >= 0 and abs(e.mean() - 0.5) < 0.02
    g = _sample(lambda: torch.empty(n, device="jax").geometric_(0.25))
    assert g.min() >= 1 and np.all(g == np.round(g)) and abs(g.mean() - 4.0) < 0.1
    ln = _sample(lambda: torch.empty(n, device="jax").log_normal_(0.0, 0.5))
    assert abs(np.log(ln).mean()) < 0.02 and abs(np.log(ln).std() - 0.5) < 0.02
    c = _sample(lambda: torch.empty(n, device="jax").cauchy_(1.0, 2.0))
    assert abs(np.median(c) - 1.0) < 0.1 and abs(np.percentile(c, 75) - 3.0) < 0.15
    b = _sample(lambda: torch.bernoulli(torch.full((n,), 0.3, device="jax")))
    assert set(np.unique(b)) == {0.0, 1.0} and abs(b.mean() - 0.3) < 0.01
    pois = _sample(lambda: torch.poisson(torch.full((n,), 3.0, device="jax")))
    assert abs(pois.mean() - 3.0) < 0.05 and abs(pois.var() - 3.0) < 0.15


def test_multinomial_semantics():
    probs = torch.tensor([[0.1, 0.2, 0.7, 0.0], [1.0, 1.0, 1.0, 1.0]], device="jax")
    for k in range(20):
        s = _sample(lambda: torch.multinomial(probs, 3), key=k)
        assert s.shape == (2, 3)
        assert len(set(s[0])) == 3 and 3 not in s[0]  # no repeats, never the zero-probability category
        assert len(set(s[1])) == 3
    w = torch.tensor([1.0, 3.0, 0.0, 4.0], device="jax")
    draws = _sample(lambda: torch.multinomial(w, 40000, replacement=True))
    freq = np.bincount(draws.astype(int), minlength=4) / draws.size
    np.testing.assert_allclose(freq, [0.125, 0.375, 0.0, 0.5], atol=0.01)
    first = np.array([_sample(lambda: torch.multinomial(w, 1), key=k)[0] for k in range(400)])
    assert abs((first == 3).mean() - 0.5) < 0.08  # without replacement the first draw follows the weights


def test_in_place_sampler_on_view_touches_only_the_view():
    x = np.asarray(jaxtorch.call_torch(_normal_into_view, rng=jax.random.key(3)))
    assert np.all(x[[0, 3]] == 0) and np.all(x[1:3] != 0)


def test_eager_generator_follows_torch_manual_seed():
    with jaxtorch.default_env():
        torch.manual_seed(0)
        a = torch.randn(3, 4, device="jax").cpu()
        b = torch.randn(3, 4, device="jax").cpu()
        torch.manual_seed(0)
        c = torch.randn(3, 4, device="jax").cpu()
    assert torch.equal(a, c) and not torch.equal(a, b)


def test_jit_without_key_raises_missing_key():
    with pytest.raises(jaxtorch.MissingKeyError):
        jax.jit(lambda x: jaxtorch.call_torch(lambda t: t + torch.rand(3, device="jax"), x))(jnp.ones(3))


def test_nn_init_on_jax_parameters():
    with jaxtorch.default_env():
        lin = torch.nn.Linear(64, 32).to("jax")
        torch.nn.init.kaiming_uniform_(lin.weight)
        torch.nn.init.normal_(lin.bias, 1.0, 0.1)
        w, b = lin.weight.detach().cpu(), lin.bias.detach().cpu()
    bound = 1 / np.sqrt(64) * np.sqrt(6)  # kaiming_uniform_ with a=0: gain sqrt(2) * sqrt(3 / fan_in)
    assert w.abs().max() <= bound and w.std() > bound / 3
    assert abs(b.mean() - 1.0) < 0.1


def test_randn_under_enable_globally_then_jit_with_key():
    def f(x):
        return x + torch.randn(x.shape, device="jax")

    g = jax.jit(lambda x, k: jaxtorch.call_torch(f, x, rng=k))
    x = jnp.zeros((3, 4))
    a, b, c = g(x, jax.random.key(0)), g(x, jax.random.key(0)), g(x, jax.random.key(1))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(a), np.asarray(c))
