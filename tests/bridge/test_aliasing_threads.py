"""Views and aliasing across `jaxtorch.jit` boundaries, and in-place ops from several
threads (issue 23, item 8). The reference is eager torch on the CPU.
"""

from __future__ import annotations

import threading

import pytest
import torch

import jaxtorch

N_THREADS, M_ADDS = 6, 40


def _overlap(a, b):
    a.add_(1)
    return b.sum(), b * 1


@pytest.mark.parametrize(
    "views",
    [lambda t: (t[:3], t[1:]), lambda t: (t, t[1:]), lambda t: (t[1:], t), lambda t: (t.view(2, 2), t[2:])],
    ids=["two-slices", "tensor-and-slice", "slice-and-tensor", "reshape-and-slice"],
)
def test_overlapping_views_as_separate_arguments(views):
    ref = torch.arange(4.0)
    expected = _overlap(*views(ref))
    base = torch.arange(4.0).to("jax")
    got = jaxtorch.jit(_overlap)(*views(base))
    assert float(got[0].cpu()) == float(expected[0])
    assert got[1].cpu().tolist() == expected[1].tolist()
    assert base.cpu().tolist() == ref.tolist()


def test_returning_an_input_returns_that_tensor():
    @jaxtorch.jit
    def ident(a, b):
        return a, b + 1

    t = torch.zeros(3, device="jax")
    r, _ = ident(t, t)
    assert r is t


def test_returning_a_view_of_an_input_aliases_it():
    @jaxtorch.jit
    def tail(a):
        return a[1:], a.view(3, 1)

    t = torch.zeros(3, device="jax")
    v, w = tail(t)
    v.add_(1)
    assert t.cpu().tolist() == [0.0, 1.0, 1.0]
    t.mul_(2)
    assert v.cpu().tolist() == [2.0, 2.0] and w.cpu().flatten().tolist() == [0.0, 2.0, 2.0]


def test_in_place_write_then_returned_view_sees_the_write():
    @jaxtorch.jit
    def f(a):
        a.add_(5)
        return a[:2]

    t = torch.zeros(4, device="jax")
    v = f(t)
    assert v.cpu().tolist() == [5.0, 5.0] and t.cpu().tolist() == [5.0] * 4
    t.zero_()
    assert v.cpu().tolist() == [0.0, 0.0]


def _hammer(lazy: bool) -> tuple[list, list]:
    shared = torch.zeros(3, device="jax")
    own = [torch.zeros(3, device="jax") for _ in range(N_THREADS)]
    errors: list = []

    def work(i):
        try:
            if lazy:
                with jaxtorch.lazy():
                    for _ in range(M_ADDS):
                        shared.add_(1)
                        own[i].add_(1)
                        shared[1:].add_(1)  # through a view too
            else:
                for _ in range(M_ADDS):
                    shared.add_(1)
                    own[i].add_(1)
                    shared[1:].add_(1)
        except Exception as e:  # (reported below)
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(N_THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return shared.cpu().tolist(), [o.cpu().tolist() for o in own]


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_in_place_adds_from_threads_lose_no_update(lazy):
    shared, own = _hammer(lazy)
    n = N_THREADS * M_ADDS
    assert shared == [n, 2 * n, 2 * n]
    assert own == [[M_ADDS] * 3] * N_THREADS
    assert not jaxtorch.bridge.core._lazy.is_enabled()  # the last block to close turned lazy mode off


@pytest.mark.parametrize(
    "views", [lambda t: (t[:3], t[1:]), lambda t: (t.view(2, 2), t.view(2, 2).t())], ids=["slices", "transpose"]
)
def test_overlapping_cpu_views_as_separate_arguments(views):
    def f(a, b):
        a.mul_(2)
        return b.sum(), b * 1

    ref = torch.arange(1.0, 5.0)
    expected = f(*views(ref))
    base = torch.arange(1.0, 5.0)
    got = jaxtorch.jit(f)(*views(base))
    assert float(got[0].cpu()) == float(expected[0])
    assert got[1].cpu().tolist() == expected[1].tolist()
    assert base.tolist() == ref.tolist()
