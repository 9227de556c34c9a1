"""PyTorch's ModuleInfo database through jaxtorch (issue 13), with a two-way expected-failures list.

Each (mode, module) is one test: `jax.jit` of `extract`'s forward, `jax.grad` against
`torch.autograd`, and PyTorch-first `.to("jax")` (see `tests/modules/harness.py`). A module
that fails must be listed in `tests/modules/expected_failures.txt` with its reason; a listed
module that passes fails the suite too, so the list stays true.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.expected import load_expected
from tests.modules import harness

EXPECTED_FILE = Path(__file__).parent / "expected_failures.txt"
EXPECTED = load_expected(EXPECTED_FILE)
ENTRIES = harness.entries()


def test_expected_failures_name_real_entries():
    unknown = [f"{m} {e}" for (m, e) in EXPECTED if e not in ENTRIES or m not in harness.MODES]
    assert not unknown, f"expected_failures.txt names unknown modules: {unknown}"


@pytest.mark.parametrize("mode,name", [pytest.param(m, n, id=f"{m}-{n}") for m in harness.MODES for n in ENTRIES])
def test_module(mode, name):
    ok, reason = harness.run_entry(ENTRIES[name], mode)
    listed = EXPECTED.get((mode, name))
    if ok is None:
        assert listed is None, f"{mode} {name} is listed as failing but has nothing to test ({reason})"
    elif ok:
        assert listed is None, f"{mode} {name} now passes: remove it from {EXPECTED_FILE.name}"
    else:
        assert listed is not None, f"{mode} {name} fails and is not in {EXPECTED_FILE.name}: {reason}"
        if listed.startswith("data-dependent"):  # the clear error, naming the torch line
            assert reason.startswith("data-dependent") and listed.split("at ")[-1] in reason, reason
