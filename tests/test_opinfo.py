"""PyTorch's OpInfo suite through jaxtorch (issue 3), with a two-way expected-failures list.

Each (mode, entry) is one test. An entry that fails must be listed in
`tests/opinfo/expected_failures.txt` with its reason; a listed entry that passes fails
the suite too, so the list stays true. Regenerate the list's candidates with
`python -m tests.opinfo.harness --mode all`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.expected import check_listed, load_expected
from tests.opinfo import harness

EXPECTED_FILE = Path(__file__).parent / "opinfo" / "expected_failures.txt"
EXPECTED = load_expected(EXPECTED_FILE)
ENTRIES = harness.entry_by_id()


def _cases():
    for mode in harness.MODES:
        for eid, op in ENTRIES.items():
            if harness._dtypes(op, mode):
                yield pytest.param(mode, eid, id=f"{mode}-{eid}")


def test_expected_failures_name_real_entries():
    unknown = [f"{m} {e}" for (m, e) in EXPECTED if e not in ENTRIES or m not in harness.MODES]
    assert not unknown, f"expected_failures.txt names unknown entries: {unknown}"


@pytest.mark.parametrize("mode,eid", list(_cases()))
def test_opinfo(mode, eid):
    ok, reason = harness.run_entry(ENTRIES[eid], mode)
    check_listed(mode, eid, ok, reason, EXPECTED, EXPECTED_FILE.name)
