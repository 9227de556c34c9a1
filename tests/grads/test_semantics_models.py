"""One gradient, whichever path (issue 29, item 6): models whose gradients carry torch's
autograd meaning (`.detach()`, `no_grad`, custom `autograd.Function` backwards, hooks, a
gradient penalty) give CPU PyTorch's gradients on every path (`tests/grads/_paths.py`).

Each (path, model) is one test, compared with CPU torch at 1e-5 relative (float32). A pair
that fails must be listed in `tests/grads/expected_failures.txt` with its reason; a listed
pair that passes fails too ("now passes: remove it"), so the list stays true.
"""

from __future__ import annotations

import functools

import pytest

from tests.grads import _paths
from tests.grads._expected import check
from tests.grads._semantics import CASES


def _loss(out):
    return out


@functools.cache
def _reference(name: str):
    factory, inputs = CASES[name]
    return _paths.grads_cpu(factory, inputs, _loss)


@pytest.mark.parametrize("path", _paths.PATHS)
@pytest.mark.parametrize("name", list(CASES))
def test_semantics(name, path):
    factory, inputs = CASES[name]
    check(path, name, lambda: _paths.compare(_reference(name), _paths.GRADS[path](factory, inputs, _loss)))
