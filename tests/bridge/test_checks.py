"""Checked mode (`jaxtorch.checks()`, `JAXTORCH_CHECKS=1`): out-of-range indices and integer
division by zero raise CPU torch's error (type and message) on the jax device, eagerly, lazily,
under `jaxtorch.jit` and through `extract`; off, nothing changes. And anomaly mode
(`torch.autograd.set_detect_anomaly`) works on the jax device."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import pytest
import torch
import torch.nn.functional as F

import jaxtorch

_W = torch.arange(30.0).reshape(10, 3)
_A = torch.arange(6.0)
_M = torch.arange(12.0).reshape(3, 4)


def _t(*v):
    return torch.tensor(list(v))


# name -> (fn, args): each raises on CPU torch
BAD = {
    "index": (lambda a, i: a[i], (_A, _t(6))),
    "index_negative": (lambda a, i: a[i], (_A, _t(-7))),
    "index_2d_second": (lambda a, i: a[:, i], (_M, _t(0, 4))),
    "index_two": (lambda a, i, j: a[i, j], (_M, _t(0), _t(9))),
    "index_put": (lambda a, i: a.index_put((i,), a.new_ones(1)), (_A, _t(6))),
    "setitem": (lambda a, i: a.clone().__setitem__(i, 1.0), (_A, _t(8))),
    "index_select": (lambda a, i: a.index_select(0, i), (_M, _t(3))),
    "index_select_negative": (lambda a, i: a.index_select(0, i), (_A, _t(-1))),
    "index_add": (lambda a, i: a.index_add(0, i, a.new_ones(1)), (_A, _t(6))),
    "index_copy": (lambda a, i: a.index_copy(0, i, a.new_ones(1)), (_A, _t(6))),
    "index_fill": (lambda a, i: a.index_fill(0, i, 1.0), (_A, _t(-7))),
    "take": (lambda a, i: torch.take(a, i), (_M, _t(12))),
    "gather": (lambda a, i: a.gather(1, i), (_M, _t(0, 4).reshape(1, 2))),
    "gather_negative": (lambda a, i: a.gather(0, i), (_A, _t(-1))),
    "scatter": (lambda a, i: a.scatter(0, i, a.new_ones(1)), (_A, _t(6))),
    "scatter_add": (lambda a, i: a.scatter_add(1, i, a.new_ones(1, 1)), (_M, _t(5).reshape(1, 1))),
    "scatter_reduce": (lambda a, i: a.scatter_reduce(0, i, a.new_ones(1), "amax"), (_A, _t(9))),
    "embedding": (lambda w, i: F.embedding(i, w), (_W, _t(1, 10))),
    "embedding_negative": (lambda w, i: F.embedding(i, w), (_W, _t(-1))),
    "embedding_module_2d": (lambda w, i: F.embedding(i, w, padding_idx=0), (_W, _t(1, 2, 3, 11).reshape(2, 2))),
    "cross_entropy": (lambda x, t: F.cross_entropy(x, t), (torch.zeros(2, 3), _t(0, 5))),
    "cross_entropy_negative": (lambda x, t: F.cross_entropy(x, t), (torch.zeros(2, 3), _t(0, -1))),
    "cross_entropy_smoothing": (lambda x, t: F.cross_entropy(x, t, label_smoothing=0.1), (torch.zeros(2, 3), _t(3, 0))),
    "cross_entropy_none": (lambda x, t: F.cross_entropy(x, t, reduction="none"), (torch.zeros(2, 3), _t(0, 7))),
    "nll_loss": (lambda x, t: F.nll_loss(x, t), (torch.zeros(2, 3), _t(0, 5))),
    "nll_loss_2d": (lambda x, t: F.nll_loss(x, t), (torch.zeros(1, 3, 2, 2), _t(0, 1, 2, 3).reshape(1, 2, 2))),
    "one_hot": (lambda t: F.one_hot(t, 3), (_t(0, 5),)),
    "one_hot_negative": (lambda t: F.one_hot(t, 3), (_t(0, -1),)),
    "floordiv": (lambda a, b: a // b, (_t(1, 2), _t(0, 1))),
    "floordiv_scalar": (lambda a: a // 0, (_t(1, 2),)),
    "remainder": (lambda a, b: a % b, (_t(1, 2), _t(1, 0))),
    "div_trunc": (lambda a, b: torch.div(a, b, rounding_mode="trunc"), (_t(1, 2), _t(0, 1))),
    "div_floor": (lambda a, b: torch.div(a, b, rounding_mode="floor"), (_t(1, 2), _t(0, 1))),
    "fmod": (lambda a, b: torch.fmod(a, b), (_t(1, 2), _t(0, 1))),
}

# the same ops with good arguments: checked mode gives CPU's values
GOOD = {
    "index_negative": (lambda a, i: a[i], (_A, _t(-6, 5))),
    "index_2d": (lambda a, i: a[:, i], (_M, _t(0, 3, -4))),
    "index_select": (lambda a, i: a.index_select(0, i), (_M, _t(2, 0))),
    "gather": (lambda a, i: a.gather(1, i), (_M, _t(0, 3).reshape(1, 2))),
    "scatter_add": (lambda a, i: a.scatter_add(0, i, a.new_ones(2)), (_A, _t(5, 5))),
    "embedding": (lambda w, i: F.embedding(i, w), (_W, _t(0, 9))),
    "cross_entropy_ignore": (lambda x, t: F.cross_entropy(x, t), (torch.randn(3, 3), _t(0, -100, 2))),
    "nll_loss": (lambda x, t: F.nll_loss(x, t), (torch.randn(2, 3), _t(2, 0))),
    "one_hot": (lambda t: F.one_hot(t, 3), (_t(0, 2),)),
    "floordiv": (lambda a, b: a // b, (_t(-7, 7), _t(2, -3))),
    "float_div_by_zero": (lambda a, b: a / b, (torch.ones(2), torch.zeros(2))),
    "float_floordiv_by_zero": (lambda a, b: a // b, (torch.ones(2), torch.zeros(2))),
}


def _cpu_error(fn, args) -> BaseException:
    with pytest.raises((IndexError, RuntimeError)) as e:
        fn(*[a.clone() for a in args])
    return e.value


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0]


def _on_jax(args):
    return [a.to("jax") for a in args]


@pytest.mark.parametrize("mode", ["eager", "lazy", "jit"])
@pytest.mark.parametrize("name", sorted(BAD))
def test_checked_mode_raises_torchs_error(name, mode):
    fn, args = BAD[name]
    want = _cpu_error(fn, args)
    with jaxtorch.default_env(), jaxtorch.checks():
        jargs = _on_jax(args)
        with pytest.raises(type(want)) as got:
            if mode == "lazy":
                with jaxtorch.lazy():
                    jaxtorch.sync(fn(*jargs))
            elif mode == "jit":
                jaxtorch.jit(fn)(*jargs)
            else:
                fn(*jargs)
    assert type(got.value) is type(want)
    assert _first_line(got.value) == _first_line(want)


@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("name", sorted(GOOD))
def test_checked_mode_keeps_good_values(name, mode):
    fn, args = GOOD[name]
    want = fn(*[a.clone() for a in args])
    with jaxtorch.default_env(), jaxtorch.checks():
        jargs = _on_jax(args)
        got = (jaxtorch.jit(fn) if mode == "jit" else fn)(*jargs).cpu()
    torch.testing.assert_close(got, want, equal_nan=True)


@pytest.mark.parametrize("name", ["index", "embedding", "cross_entropy", "gather"])
def test_off_by_default_nothing_raises(name):
    """Off (the default), nothing raises: out-of-range reads give the fill value (docs/api/errors.md)."""
    fn, args = BAD[name]
    with jaxtorch.default_env():
        fn(*_on_jax(args))
        jaxtorch.jit(fn)(*_on_jax(args))


def test_jit_programs_are_keyed_by_the_checks_flag():
    fn = lambda w, i: F.embedding(i, w)
    f = jaxtorch.jit(fn)
    w, bad = _W.to("jax"), _t(10).to("jax")
    f(w, bad)  # off: compiled without checks
    with jaxtorch.checks(), pytest.raises(IndexError, match="index out of range in self"):
        f(w, bad)  # on: a checked program, not the cached unchecked one
    f(w, bad)  # off again: the unchecked program
    with jaxtorch.checks(), jaxtorch.checks(False):
        f(w, bad)  # turned off inside


def test_extract_checked_eagerly_and_under_jax_jit():
    params, fn = jaxtorch.extract(torch.nn.Embedding(10, 4))
    with jaxtorch.checks():
        with pytest.raises(IndexError, match="index out of range in self"):
            fn(params, jnp.array([1, 10]))
        # under a jax.jit of your own, the check raises when the program runs (JAX's runtime
        # error, carrying torch's message)
        with pytest.raises(Exception, match="IndexError: index out of range in self"):
            jax.block_until_ready(jax.jit(fn)(params, jnp.array([1, 10])))
        out = jax.jit(fn)(params, jnp.array([1, 9]))
    want = torch.nn.functional.embedding(torch.tensor([1, 9]), torch.from_numpy(jax.device_get(params["weight"])))
    torch.testing.assert_close(torch.from_numpy(jax.device_get(out)), want)


def test_compiled_train_step_checked():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 5)).to("jax")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @jaxtorch.compile
    def step(model, opt, x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    x = torch.tensor([1, 2, 3]).to("jax")
    with jaxtorch.checks():
        step(model, opt, x, torch.tensor([0, 1, 4]).to("jax"))
        before = [p.detach().cpu().clone() for p in model.parameters()]
        with pytest.raises(IndexError, match="Target 5 is out of bounds."):
            step(model, opt, x, torch.tensor([0, 5, 1]).to("jax"))
    with jaxtorch.default_env():
        with pytest.raises(IndexError, match="Target 5 is out of bounds."), jaxtorch.checks():
            F.cross_entropy(torch.zeros(2, 3, device="jax"), torch.tensor([5, 0], device="jax"))
    # the failed step raised before writing the module's state back
    for p, b in zip(model.parameters(), before):
        torch.testing.assert_close(p.detach().cpu(), b)


def test_env_var_turns_checks_on_at_import():
    code = (
        "import torch, jaxtorch\n"
        "try:\n"
        "    torch.arange(3.0).to('jax')[torch.tensor([5]).to('jax')]\n"
        "except IndexError as e:\n"
        "    print('raised', e)\n"
    )
    env = {**os.environ, "JAXTORCH_CHECKS": "1", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert "raised index 5 is out of bounds for dimension 0 with size 3" in out.stdout, out.stderr[-2000:]


def test_checks_context_restores_on_error():
    from jaxtorch.bridge.core import _checks

    before = _checks.enabled()
    with pytest.raises(ZeroDivisionError), jaxtorch.checks():
        1 // 0  # noqa: B018
    assert _checks.enabled() == before


# ---- anomaly mode ----------------------------------------------------------------------------------
def _anomaly_run(device: str, lazy: bool = False):
    x = torch.tensor([1.0, 0.0, 2.0]).to(device).requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # anomaly mode warns that it is slow, and prints traces
        with torch.autograd.set_detect_anomaly(True):
            (x * x).sum().backward()
            good = x.grad.detach().cpu().clone()
            x.grad = None
            with pytest.raises(RuntimeError) as e:
                torch.sqrt(x - 1).sum().backward()  # d sqrt at -1: nan
    return good, e.value


@pytest.mark.parametrize("lazy", [False, True])
def test_anomaly_mode_backward_and_nan_report(lazy):
    good_cpu, err_cpu = _anomaly_run("cpu")
    with jaxtorch.default_env():
        if lazy:
            with jaxtorch.lazy():
                good, err = _anomaly_run("jax")
        else:
            good, err = _anomaly_run("jax")
    torch.testing.assert_close(good, good_cpu)
    assert str(err) == str(err_cpu) == "Function 'SqrtBackward0' returned nan values in its 0th output."


def test_anomaly_mode_module_backward_matches_cpu():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
    x = torch.randn(5, 4)
    with torch.autograd.set_detect_anomaly(True):
        m(x).sum().backward()
        want = [p.grad.clone() for p in m.parameters()]
        m.zero_grad(set_to_none=True)
        with jaxtorch.default_env():
            m.to("jax")
            m(x.to("jax")).sum().backward()
            got = [p.grad.cpu() for p in m.parameters()]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_anomaly_mode_under_jit_is_a_clear_error():
    m = torch.nn.Linear(3, 2).to("jax")

    @jaxtorch.jit
    def f(x):
        with torch.autograd.set_detect_anomaly(True):
            m(x).sum().backward()
        return m.weight.grad

    with pytest.raises(jaxtorch.DataDependentError, match="anomaly mode"):
        f(torch.ones(2, 3).to("jax"))
