"""Errors name the problem (issue 22 item 6, issue 23 item 9): torch's own shape messages, anomaly mode, checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
import torch
import torch.nn.functional as F

import jaxtorch

from .harness import case, clear_error

SHAPE_ERRORS = {
    "matmul_op": lambda a, b: a @ b,
    "lt": lambda a, b: a < b,
    "add": lambda a, b: a + b,
    "mul": lambda a, b: a * b,
    "sub": lambda a, b: a - b,
    "eq": lambda a, b: a == b,
    "pow": lambda a, b: a**b,
    "torch.matmul": lambda a, b: torch.matmul(a, b),
    "mm": lambda a, b: torch.mm(a, b),
    "cat": lambda a, b: torch.cat([a, b], dim=1),
    "stack": lambda a, b: torch.stack([a, b]),
    "linear": lambda a, b: F.linear(a, b),
    "where": lambda a, b: torch.where(a > 0, a, b),
    "maximum": lambda a, b: torch.maximum(a, b),
}

for _name, _op in SHAPE_ERRORS.items():

    @case(f"shape_error/{_name}")
    def _shape(op=_op):
        a, b = torch.ones(2, 3), torch.ones(4, 5)
        with pytest.raises(Exception) as cpu:
            op(a, b)
        with jaxtorch.default_env(), pytest.raises(Exception) as got:
            op(a.to("jax"), b.to("jax"))
        assert type(got.value) is type(cpu.value), (type(got.value), got.value, cpu.value)
        numbers = [w for w in str(cpu.value).replace("(", " ").replace(")", " ").split() if w.isdigit()]
        assert all(n in str(got.value) for n in numbers), (str(got.value), str(cpu.value))


@case("shape_error/conv2d_channels")
def _conv():
    x, w = torch.ones(1, 3, 5, 5), torch.ones(2, 4, 3, 3)
    with pytest.raises(RuntimeError):
        F.conv2d(x, w)
    with jaxtorch.default_env(), pytest.raises(RuntimeError):
        F.conv2d(x.to("jax"), w.to("jax"))


@case("anomaly/backward_works")
def _anomaly():
    with jaxtorch.default_env(), torch.autograd.set_detect_anomaly(True):
        x = torch.ones(3, device="jax", requires_grad=True)
        (x * x).sum().backward()
        assert torch.equal(x.grad.cpu(), torch.full((3,), 2.0))


@case("errors/to_torch_prng_key")
def _key():
    with pytest.raises(Exception) as e:
        jaxtorch.to_torch(jax.random.key(0))
    clear_error(e.value, "key")


@case("errors/to_jax_sparse")
def _sparse():
    with pytest.raises(Exception) as e:
        jaxtorch.to_jax(torch.eye(3).to_sparse())
    clear_error(e.value, "sparse")


@case("errors/jit_fn_with_torch_tensor")
def _jit_torch_arg():
    lin = torch.nn.Linear(2, 2)
    params, fn = jaxtorch.extract(lin)
    x = torch.ones(1, 2)
    try:
        out = jax.jit(fn)(params, x)
    except Exception as e:
        clear_error(e, "jaxtorch.to_jax")
    else:
        with torch.no_grad():
            assert torch.allclose(torch.from_numpy(jax.device_get(out).copy()), lin(x), atol=1e-6)


# ---- the checked mode ---------------------------------------------------------------------------
CHECKED = {
    "index_getitem": (IndexError, lambda: torch.arange(3.0, device="jax")[torch.tensor([5], device="jax")]),
    "index_negative_out": (IndexError, lambda: torch.arange(3.0, device="jax")[torch.tensor([-4], device="jax")]),
    "index_select": (
        (IndexError, RuntimeError),
        lambda: torch.index_select(torch.ones(3, device="jax"), 0, torch.tensor([3], device="jax")),
    ),
    "embedding_high": (
        IndexError,
        lambda: F.embedding(torch.tensor([10], device="jax"), torch.ones(4, 2, device="jax")),
    ),
    "embedding_negative": (
        IndexError,
        lambda: F.embedding(torch.tensor([-1], device="jax"), torch.ones(4, 2, device="jax")),
    ),
    "gather": (
        RuntimeError,
        lambda: torch.gather(torch.ones(2, 2, device="jax"), 1, torch.tensor([[0, 2]], device="jax")),
    ),
    "cross_entropy_target": (
        (IndexError, RuntimeError),
        lambda: F.cross_entropy(torch.ones(2, 3, device="jax"), torch.tensor([0, 5], device="jax")),
    ),
    "one_hot": (RuntimeError, lambda: F.one_hot(torch.tensor([4], device="jax"), 3)),
    "int_div_zero": (
        RuntimeError,
        lambda: torch.tensor([4], device="jax") // torch.tensor([0], device="jax"),
    ),
}

for _name, (_exc, _thunk) in CHECKED.items():

    @case(f"checks/eager/{_name}")
    def _checked(exc=_exc, thunk=_thunk):
        with jaxtorch.default_env(), jaxtorch.checks(), pytest.raises(exc):
            thunk()


@case("checks/jit/embedding")
def _checked_jit_embedding():
    emb = torch.nn.Embedding(4, 2)
    params, fn = jaxtorch.extract(emb)
    with jaxtorch.checks(), pytest.raises(IndexError):
        jax.jit(fn)(params, jnp.array([1, 7]))


@case("checks/jaxtorch_jit/index")
def _checked_jaxtorch_jit():
    f = jaxtorch.jit(lambda a, i: a[i])
    with jaxtorch.checks(), pytest.raises(IndexError):
        f(torch.arange(3.0), torch.tensor([5]))


@case("checks/off_by_default_in_range_ok")
def _in_range():
    with jaxtorch.default_env(), jaxtorch.checks():
        out = torch.arange(3.0, device="jax")[torch.tensor([2], device="jax")]
        assert out.cpu().tolist() == [2.0]
