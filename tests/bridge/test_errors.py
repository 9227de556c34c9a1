"""Errors a user meets say what went wrong and what to do."""

import jax
import jax.numpy as jnp
import pytest
import torch

import jaxtorch
from jaxtorch import JaxtorchError


def test_unsupported_op_names_the_op_and_how_to_register():
    lib = torch.library.Library("jaxtorch_test", "DEF")
    lib.define("bar(Tensor x) -> Tensor")
    lib.impl("bar", lambda x: x * 2, "CPU")
    with pytest.raises(jaxtorch.UnsupportedOpError) as e:
        jaxtorch.call_torch(lambda t: torch.ops.jaxtorch_test.bar(t), jnp.ones(2))
    msg = str(e.value)
    assert "jaxtorch_test::bar" in msg and "register_op" in msg


def test_data_dependent_under_jit_is_a_clear_error():
    f = lambda x: x[x > 0]
    out = jaxtorch.call_torch(f, jnp.array([1.0, -1.0, 2.0]))  # eager works
    assert out.tolist() == [1.0, 2.0]
    with pytest.raises(jaxtorch.DataDependentError, match="depends on the data"):
        jax.jit(lambda x: jaxtorch.call_torch(f, x))(jnp.array([1.0, -1.0, 2.0]))


def test_item_under_jit_is_a_clear_error():
    def f(x):
        return x * 2 if x.sum().item() > 0 else x

    with pytest.raises(jaxtorch.DataDependentError, match="item"):
        jax.jit(lambda x: jaxtorch.call_torch(f, x))(jnp.ones(2))


def test_cpu_tensor_mixed_in_names_both_devices():
    with jaxtorch.default_env():
        a = torch.ones(3, device="jax")
        with pytest.raises(jaxtorch.DeviceMismatchError, match="jax:0 and cpu"):
            a + torch.ones(3)
        # a 0-dim CPU tensor is allowed, as torch allows it with CUDA tensors
        assert (a + torch.tensor(1.0)).tolist() == [2.0, 2.0, 2.0]


def test_cpu_tensor_is_moved_inside_call_torch():
    const = torch.ones(3)
    out = jax.jit(lambda x: jaxtorch.call_torch(lambda t: t + const, x))(jnp.ones(3))
    assert out.tolist() == [2.0, 2.0, 2.0]


def test_float64_with_x64_off_says_how_to_fix():
    with pytest.raises(jaxtorch.Float64Error, match="jax_enable_x64"):
        with jaxtorch.default_env():
            torch.zeros(3, dtype=torch.float64).to("jax")  # float64 data is never narrowed silently
    with pytest.raises(jaxtorch.Float64Error, match="jax_enable_x64"):  # and so is a float64 dtype asked for
        with jaxtorch.default_env():
            torch.zeros(3, dtype=torch.float64, device="jax")


def test_random_under_jit_without_key_is_an_error():
    f = lambda x: torch.nn.functional.dropout(x, 0.5, training=True)
    with pytest.raises(jaxtorch.MissingKeyError, match="rng="):
        jax.jit(lambda x: jaxtorch.call_torch(f, x))(jnp.ones(8))
    a = jax.jit(lambda x, k: jaxtorch.call_torch(f, x, rng=k))(jnp.ones(64), jax.random.key(0))
    b = jax.jit(lambda x, k: jaxtorch.call_torch(f, x, rng=k))(jnp.ones(64), jax.random.key(0))
    c = jax.jit(lambda x, k: jaxtorch.call_torch(f, x, rng=k))(jnp.ones(64), jax.random.key(1))
    assert (a == b).all() and not (a == c).all()


def test_random_factory_inside_call_torch_draws_from_rng():
    f = lambda x: x + torch.rand(3)  # (no device: jax by default inside call_torch)
    run = jax.jit(lambda x, k: jaxtorch.call_torch(f, x, rng=k))
    a, b = run(jnp.zeros(3), jax.random.key(0)), run(jnp.zeros(3), jax.random.key(1))
    assert not (a == b).all()
    assert (run(jnp.zeros(3), jax.random.key(0)) == a).all()


def test_moving_an_uninitialized_lazy_module_says_to_run_a_forward_first():
    """Before, the weight became a 0-element tensor and the first forward failed with torch's
    unrelated in_features assertion."""
    jaxtorch.enable_globally()
    m = torch.nn.Sequential(torch.nn.LazyLinear(4))
    with pytest.raises(JaxtorchError, match=r"`0.weight`.*lazy module.*Run one forward on the CPU first"):
        m.to("jax")
    assert isinstance(m[0].weight, torch.nn.parameter.UninitializedParameter)  # left as found
    x = torch.randn(2, 3)
    want = m(x)  # the way out: initialize, then move
    weight = m[0].weight
    m.to("jax")
    assert m[0].weight is weight
    torch.testing.assert_close(m(x.to("jax")).cpu(), want)
