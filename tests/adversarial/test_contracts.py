"""The adversarial suite (issue 23 item 10): each case matches eager CPU torch or raises a clear error.

Cases live in `cases_*.py`, one file per contract. Known failures are listed in `expected_failures.txt`
with their reason and checked both ways: an unlisted failure fails, and so does a listed case that passes.
"""

from __future__ import annotations

import pytest

from .harness import load_cases, load_expected

CASES = load_cases()  # every cases_*.py beside this file

EXPECTED = load_expected()


def test_expected_failures_name_real_cases():
    unknown = sorted(set(EXPECTED) - set(CASES))
    assert not unknown, f"expected_failures.txt names unknown cases: {unknown}"


def test_there_are_at_least_150_cases():
    assert len(CASES) >= 150, len(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_case(name):
    reason = EXPECTED.get(name)
    if reason is None:
        CASES[name]()
        return
    try:
        CASES[name]()
    except (Exception, pytest.fail.Exception):  # (pytest.raises fails with a BaseException)
        return  # still failing, as listed
    pytest.fail(f"{name} passes now: remove it from expected_failures.txt (listed: {reason})")
