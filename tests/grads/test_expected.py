"""`expected_failures.txt` names only real (path, case) pairs of the gradient tests."""

from __future__ import annotations

from tests.grads import _paths, test_hf_models, test_module_db
from tests.grads._expected import EXPECTED, EXPECTED_FILE
from tests.grads._semantics import CASES


def test_expected_failures_name_real_cases():
    names = set(CASES) | set(test_module_db._names()) | set(test_hf_models.MODELS)
    unknown = [f"{p} {n}" for (p, n) in EXPECTED if n not in names or p not in _paths.PATHS]
    assert not unknown, f"{EXPECTED_FILE.name} names unknown cases: {unknown}"
