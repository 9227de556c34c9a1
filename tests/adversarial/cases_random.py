"""Generators on the jax device (issue 23 item 2): honoured (same seed, same draws) or refused, never ignored."""

from __future__ import annotations

import torch

import jaxtorch

from .harness import case, equal, refuses_or


def _jax_generator(seed: int) -> torch.Generator:
    g = torch.Generator(device="jax")
    g.manual_seed(seed)
    return g


DRAWS = {
    "randn": lambda g: torch.randn(4, 3, generator=g, device="jax"),
    "rand": lambda g: torch.rand(5, generator=g, device="jax"),
    "randint": lambda g: torch.randint(0, 100, (6,), generator=g, device="jax"),
    "randperm": lambda g: torch.randperm(10, generator=g, device="jax"),
    "normal_": lambda g: torch.empty(5, device="jax").normal_(generator=g),
    "uniform_": lambda g: torch.empty(5, device="jax").uniform_(generator=g),
    "bernoulli": lambda g: torch.bernoulli(torch.full((8,), 0.5, device="jax"), generator=g),
    "multinomial": lambda g: torch.multinomial(torch.ones(6, device="jax"), 3, generator=g),
    "exponential_": lambda g: torch.empty(5, device="jax").exponential_(generator=g),
    "init.normal_": lambda g: torch.nn.init.normal_(torch.empty(3, 4, device="jax"), generator=g),
    "init.uniform_": lambda g: torch.nn.init.uniform_(torch.empty(3, 4, device="jax"), generator=g),
    "init.kaiming_uniform_": lambda g: torch.nn.init.kaiming_uniform_(torch.empty(3, 4, device="jax"), generator=g),
    "init.xavier_normal_": lambda g: torch.nn.init.xavier_normal_(torch.empty(3, 4, device="jax"), generator=g),
    "init.trunc_normal_": lambda g: torch.nn.init.trunc_normal_(torch.empty(3, 4, device="jax"), generator=g),
}

for _name, _draw in DRAWS.items():

    @case(f"generator/same_seed_same_draws/{_name}")
    def _same(draw=_draw):
        g1, g1_again, g2 = _jax_generator(1), _jax_generator(1), _jax_generator(2)  # must work: never refused

        def check():
            with jaxtorch.default_env():
                a = draw(g1).cpu()
                b = draw(g1_again).cpu()
                c = draw(g2).cpu()
            equal(a, b)
            assert not torch.equal(a, c) or a.numel() < 2, "different seeds gave the same draws"

        refuses_or(check, "generator")


@case("generator/jax_generator_constructs")
def _constructs():
    g = torch.Generator(device="jax")
    assert g.device.type == "jax"
    g.manual_seed(3)
    assert g.initial_seed() == 3


@case("generator/state_round_trip")
def _state_round_trip():
    with jaxtorch.default_env():
        g = _jax_generator(5)
        state = g.get_state()
        a = torch.randn(4, generator=g, device="jax").cpu()
        g.set_state(state)
        b = torch.randn(4, generator=g, device="jax").cpu()
    equal(a, b)


@case("generator/does_not_advance_default")
def _independent():
    def check():
        g = _jax_generator(9)
        with jaxtorch.default_env():
            jaxtorch.manual_seed(0)
            a = torch.randn(4, device="jax").cpu()
            jaxtorch.manual_seed(0)
            torch.randn(4, generator=g, device="jax")
            b = torch.randn(4, device="jax").cpu()
        equal(a, b)

    refuses_or(check, "generator")


@case("generator/consecutive_draws_differ")
def _consecutive():
    g = _jax_generator(1)

    def check():
        with jaxtorch.default_env():
            a = torch.randn(6, generator=g, device="jax").cpu()
            b = torch.randn(6, generator=g, device="jax").cpu()
        assert not torch.equal(a, b)

    refuses_or(check, "generator")


@case("generator/cpu_generator_on_jax_op")
def _cpu_generator():
    def check():
        with jaxtorch.default_env():
            a = torch.randn(4, generator=torch.Generator().manual_seed(1), device="jax").cpu()
            b = torch.randn(4, generator=torch.Generator().manual_seed(1), device="jax").cpu()
        equal(a, b)

    refuses_or(check, "generator")


@case("generator/fork_rng_jax")
def _fork_rng():
    def check():
        with jaxtorch.default_env():
            jaxtorch.manual_seed(0)
            with torch.random.fork_rng(device_type="jax"):
                torch.randn(3, device="jax")
            a = torch.randn(3, device="jax").cpu()
            jaxtorch.manual_seed(0)
            b = torch.randn(3, device="jax").cpu()
        equal(a, b)

    refuses_or(check, "generator", "fork_rng")


@case("generator/lazy_same_seed")
def _lazy():
    g1, g1_again = _jax_generator(1), _jax_generator(1)

    def check():
        with jaxtorch.default_env(), jaxtorch.lazy():
            a = torch.randn(4, generator=g1, device="jax").cpu()
            b = torch.randn(4, generator=g1_again, device="jax").cpu()
        equal(a, b)

    refuses_or(check, "generator")
