"""Shape mismatches on the jax device raise CPU torch's own error (type and message), for
operators (`@`, `<`: Python would turn a `TypeError` into "unsupported operand") and functions,
eagerly and lazily."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F

import jaxtorch


def _pair(shape_a, shape_b, dtype=torch.float32):
    return torch.ones(shape_a, dtype=dtype), torch.ones(shape_b, dtype=dtype)


_INT = torch.int64
CASES = {
    "add": (operator.add, _pair((3,), (4,))),
    "sub": (operator.sub, _pair((3,), (4,))),
    "mul": (operator.mul, _pair((2, 3), (4, 3))),
    "truediv": (operator.truediv, _pair((3,), (4,))),
    "matmul": (operator.matmul, _pair((2, 3), (4, 5))),
    "matmul_vec": (operator.matmul, _pair((2, 3), (4,))),
    "lt": (operator.lt, _pair((3,), (4,))),
    "le": (operator.le, _pair((3,), (4,))),
    "eq": (operator.eq, _pair((3,), (4,))),
    "and": (operator.and_, _pair((3,), (4,), _INT)),
    "or": (operator.or_, _pair((3,), (4,), _INT)),
    "xor": (operator.xor, _pair((3,), (4,), _INT)),
    "pow": (operator.pow, _pair((3,), (4,))),
    "torch.matmul": (torch.matmul, _pair((2, 3), (4, 5))),
    "bmm": (torch.bmm, _pair((2, 2, 3), (2, 4, 5))),
    "bmm_batch": (torch.bmm, _pair((2, 2, 3), (3, 3, 5))),
    "mm": (torch.mm, _pair((2, 3), (4, 5))),
    "cat": (lambda a, b: torch.cat([a, b], dim=1), _pair((2, 3), (4, 5))),
    "stack": (lambda a, b: torch.stack([a, b]), _pair((2, 3), (2, 4))),
    "linear": (F.linear, _pair((2, 3), (4, 5))),
    "conv2d": (F.conv2d, _pair((1, 3, 5, 5), (2, 4, 3, 3))),
    "conv1d": (F.conv1d, _pair((1, 3, 5), (2, 4, 3))),
    "where": (lambda a, b: torch.where(a > 0, a, b), _pair((3,), (4,))),
    "maximum": (torch.maximum, _pair((3,), (4,))),
    "addmm": (lambda a, b: torch.addmm(a.new_ones(2, 5), a, b), _pair((2, 3), (4, 5))),
    "iadd": (lambda a, b: a.add_(b), _pair((3,), (4,))),
}


def _cpu_error(fn, a, b) -> BaseException:
    with pytest.raises(Exception) as e:  # (each case's own type, compared below)
        fn(a, b)
    return e.value


def _key(text: str) -> str:
    return str(text).splitlines()[0]


@pytest.mark.parametrize("mode", ["eager", "lazy"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_shape_error_is_torchs(name, mode):
    fn, (a, b) = CASES[name]
    want = _cpu_error(fn, a.clone(), b.clone())
    with jaxtorch.default_env():
        ja, jb = a.to("jax"), b.to("jax")
        if mode == "lazy":
            with jaxtorch.lazy():
                with pytest.raises(type(want)) as got:
                    jaxtorch.sync(fn(ja, jb))
        else:
            with pytest.raises(type(want)) as got:
                fn(ja, jb)
    assert type(got.value) is type(want)
    assert _key(want) in str(got.value)


def test_shape_error_without_the_global_mode():
    a, b = torch.ones(2, 3).to("jax"), torch.ones(4, 5).to("jax")
    with pytest.raises(RuntimeError, match=r"mat1 and mat2 shapes cannot be multiplied \(2x3 and 4x5\)"):
        a @ b


def test_shape_error_inside_call_torch_and_jit():
    import jax
    import jax.numpy as jnp

    f = lambda x, y: x @ y
    msg = r"mat1 and mat2 shapes cannot be multiplied \(2x3 and 4x5\)"
    with pytest.raises(RuntimeError, match=msg):
        jaxtorch.call_torch(f, jnp.ones((2, 3)), jnp.ones((4, 5)))
    with pytest.raises(RuntimeError, match=msg):
        jax.jit(lambda x, y: jaxtorch.call_torch(f, x, y))(jnp.ones((2, 3)), jnp.ones((4, 5)))
    with pytest.raises(RuntimeError, match=msg):
        jaxtorch.jit(f)(torch.ones(2, 3).to("jax"), torch.ones(4, 5).to("jax"))


def test_valid_shapes_still_work_and_match():
    a, b = torch.randn(2, 3), torch.randn(3, 4)
    with jaxtorch.default_env():
        got = (a.to("jax") @ b.to("jax")).cpu()
    torch.testing.assert_close(got, a @ b)


def test_a_jax_own_failure_is_not_masked():
    """An error that torch's checks would not raise keeps jaxtorch's / JAX's error."""
    import jax
    import jax.numpy as jnp

    with pytest.raises(jaxtorch.DataDependentError):
        jax.jit(lambda x: jaxtorch.call_torch(lambda t: t[t > 0], x))(jnp.ones(3))
