"""`torch.Generator(device="jax")` and `generator=` on the jax device (issue 23, item 2).

Same seed, same draws; different generators independent; the default generator untouched by
a draw from `g`; eagerly and in lazy mode; refused with a clear error under jax tracing.
"""

import copy
import pickle
import threading

import jax
import jax.numpy as jnp
import pytest
import torch

import jaxtorch
from jaxtorch.bridge.core._errors import GeneratorUnderTraceError


def _w():
    return torch.empty(6, 5, device="jax")


_P = [0.1, 0.2, 0.3, 0.4, 0.0, 0.5]
DRAWS = {
    "randn": lambda g: torch.randn(6, generator=g, device="jax"),
    "rand": lambda g: torch.rand(6, generator=g, device="jax"),
    "randint": lambda g: torch.randint(0, 1000, (6,), generator=g, device="jax"),
    "randint_high": lambda g: torch.randint(1000, (6,), generator=g, device="jax"),
    "randperm": lambda g: torch.randperm(20, generator=g, device="jax"),
    "normal_": lambda g: _w().normal_(generator=g),
    "uniform_": lambda g: _w().uniform_(generator=g),
    "bernoulli": lambda g: torch.bernoulli(torch.full((20,), 0.5, device="jax"), generator=g),
    "bernoulli_": lambda g: _w().bernoulli_(0.5, generator=g),
    "multinomial": lambda g: torch.multinomial(torch.tensor(_P, device="jax"), 3, generator=g),
    "multinomial_replacement": lambda g: torch.multinomial(torch.tensor(_P, device="jax"), 8, True, generator=g),
    "exponential_": lambda g: _w().exponential_(generator=g),
    "random_": lambda g: _w().random_(0, 100, generator=g),
    "torch.normal": lambda g: torch.normal(0.0, 1.0, (6,), generator=g, device="jax"),
    "init.normal_": lambda g: torch.nn.init.normal_(_w(), generator=g),
    "init.uniform_": lambda g: torch.nn.init.uniform_(_w(), generator=g),
    "init.kaiming_uniform_": lambda g: torch.nn.init.kaiming_uniform_(_w(), generator=g),
    "init.kaiming_normal_": lambda g: torch.nn.init.kaiming_normal_(_w(), generator=g),
    "init.xavier_uniform_": lambda g: torch.nn.init.xavier_uniform_(_w(), generator=g),
    "init.xavier_normal_": lambda g: torch.nn.init.xavier_normal_(_w(), generator=g),
    "init.trunc_normal_": lambda g: torch.nn.init.trunc_normal_(_w(), generator=g),
    "init.orthogonal_": lambda g: torch.nn.init.orthogonal_(_w(), generator=g),
}


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu()


def test_generator_on_the_jax_device():
    g = torch.Generator(device="jax")
    assert g.device.type == "jax"
    assert isinstance(g, torch.Generator) and isinstance(torch.default_generator, torch.Generator)
    assert g.manual_seed(5) is g and g.initial_seed() == 5
    c = torch.Generator()  # torch's own generator, unchanged
    assert c.device.type == "cpu" and type(c) is torch._C.Generator
    assert torch.Generator("cpu").device.type == "cpu"


@pytest.mark.parametrize("name", list(DRAWS))
def test_same_seed_same_draws(env, name):
    g = torch.Generator(device="jax")
    draw = DRAWS[name]
    g.manual_seed(1)
    a = _cpu(draw(g))
    b = _cpu(draw(g))
    g.manual_seed(1)
    a2 = _cpu(draw(g))
    g.manual_seed(2)
    c = _cpu(draw(g))
    assert torch.equal(a, a2)
    assert not torch.equal(a, b) and not torch.equal(a, c)  # the stream moves on; seeds differ


@pytest.mark.parametrize("name", ["randn", "randperm", "init.kaiming_uniform_", "multinomial", "bernoulli_"])
def test_same_seed_same_draws_in_lazy_mode(env, name):
    g = torch.Generator(device="jax")
    with jaxtorch.lazy():
        g.manual_seed(7)
        a = DRAWS[name](g)
        g.manual_seed(7)
        b = DRAWS[name](g)
        jaxtorch.sync()
    assert torch.equal(_cpu(a), _cpu(b))
    g.manual_seed(7)
    # lazy and eager draw the same keys (a fused lazy program may round the last bit differently)
    torch.testing.assert_close(_cpu(a), _cpu(DRAWS[name](g)))


def test_generators_are_independent(env):
    g1, g2 = torch.Generator(device="jax").manual_seed(3), torch.Generator(device="jax").manual_seed(3)
    a = _cpu(torch.randn(4, generator=g1, device="jax"))
    torch.randn(4, generator=g2, device="jax")
    torch.randn(4, generator=g2, device="jax")  # draws from g2 do not move g1
    g1.manual_seed(3)
    assert torch.equal(a, _cpu(torch.randn(4, generator=g1, device="jax")))


def test_default_generator_unchanged_by_a_draw_from_g(env):
    g = torch.Generator(device="jax").manual_seed(0)
    torch.manual_seed(11)
    want = _cpu(torch.randn(4, device="jax"))
    torch.manual_seed(11)
    torch.randn(4, generator=g, device="jax")
    torch.nn.init.normal_(_w(), generator=g)
    assert torch.equal(want, _cpu(torch.randn(4, device="jax")))


def test_fork_rng_restores_the_jax_stream(env):
    torch.manual_seed(0)
    with torch.random.fork_rng(device_type="jax"):
        torch.randn(3, device="jax")
    a = _cpu(torch.randn(3, device="jax"))
    torch.manual_seed(0)
    assert torch.equal(a, _cpu(torch.randn(3, device="jax")))


def test_state_round_trip(env):
    g = torch.Generator(device="jax").manual_seed(9)
    torch.randn(2, generator=g, device="jax")
    state = g.get_state()
    a = _cpu(torch.randn(5, generator=g, device="jax"))
    g.set_state(state)
    assert torch.equal(a, _cpu(torch.randn(5, generator=g, device="jax")))
    for h in (copy.deepcopy(g), pickle.loads(pickle.dumps(g))):
        h.set_state(state)
        assert h.device.type == "jax"
        assert torch.equal(a, _cpu(torch.randn(5, generator=h, device="jax")))


def test_cpu_generator_seeds_jax_draws(env):
    """A CPU generator given to a jax-device op is used (its own stream), not ignored."""
    c = torch.Generator().manual_seed(4)
    a = _cpu(torch.randn(4, generator=c, device="jax"))
    c.manual_seed(4)
    assert torch.equal(a, _cpu(torch.randn(4, generator=c, device="jax")))


def test_generator_in_call_torch_overrides_the_key():
    g = torch.Generator(device="jax")

    def f():
        g.manual_seed(1)
        return torch.randn(3, generator=g)

    a = jaxtorch.call_torch(f, rng=jax.random.key(0))
    b = jaxtorch.call_torch(f, rng=jax.random.key(1))
    assert jnp.array_equal(a, b)


def test_generator_under_jit_is_refused():
    g = torch.Generator(device="jax").manual_seed(1)

    def f(x):
        return x + torch.randn(3, generator=g)

    with pytest.raises(GeneratorUnderTraceError, match="rng="):
        jax.jit(lambda x: jaxtorch.call_torch(f, x, rng=jax.random.key(0)))(jnp.zeros(3))
    with pytest.raises(GeneratorUnderTraceError):
        jaxtorch.jit(f)(torch.zeros(3))


def test_threads_with_their_own_generators(env):
    out: dict = {}

    def worker(i):
        g = torch.Generator(device="jax").manual_seed(i)
        out[i] = [_cpu(torch.randn(4, generator=g, device="jax")) for _ in range(5)]

    threads = [threading.Thread(target=worker, args=(i,)) for i in (1, 2, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    g = torch.Generator(device="jax").manual_seed(1)
    want = [_cpu(torch.randn(4, generator=g, device="jax")) for _ in range(5)]
    assert all(torch.equal(a, b) for a, b in zip(out[1], want))
