"""The two-way expected-failures check shared by the gradient tests.

`expected_failures.txt` holds one `path name: reason` line per known failing pair (`path`
one of `_paths.PATHS`; `name` a model of `_semantics.CASES`, a ModuleInfo entry such as
`nn.Linear`, or `hf.<model>`). An unlisted failure fails its test, and so does a listed pair
that passes.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

from tests.expected import check_listed, load_expected

EXPECTED_FILE = Path(__file__).parent / "expected_failures.txt"
EXPECTED = load_expected(EXPECTED_FILE)


def outcome(run: Callable[[], None]) -> str | None:
    """None when `run()` passes, else a one-line reason."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run()
    except Exception as e:
        return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
    return None


def check(path: str, name: str, run: Callable[[], None]) -> None:
    failure = outcome(run)
    check_listed(path, name, failure is None, failure or "", EXPECTED, EXPECTED_FILE.name)
