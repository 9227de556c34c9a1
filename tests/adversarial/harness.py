"""The adversarial suite's registry: each case is a function that checks one contract against eager CPU torch.

A case passes when jaxtorch matches eager CPU torch, or refuses with a clear error where the issue allows one
(`refuses_or`). Known failures live in `expected_failures.txt` (`case: reason`) and are checked both ways by
`test_contracts.py`: an unlisted failure fails, and so does a listed case that passes.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

CASES: dict[str, Callable[[], None]] = {}


def scratch_dir(prefix: str) -> Path:
    """A new empty folder under the system's temporary folder, removed when this process exits.

    Cases are plain functions without pytest's `tmp_path`; before this helper each left its folder behind
    (hundreds of `jt-io-*` / `jt-loading-*` folders in /tmp after a run). Removed at exit rather than at the
    case's end because a case may leave memory-mapped weights open. Example: `scratch_dir("jt-io-") / "m.pt"`."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def case(name: str) -> Callable[[Callable[[], None]], Callable[[], None]]:
    """Register `fn` as the case `name` (a `family/what` path)."""

    def register(fn: Callable[[], None]) -> Callable[[], None]:
        assert name not in CASES, f"duplicate case {name}"
        CASES[name] = fn
        return fn

    return register


def load_expected(path: Path = Path(__file__).parent / "expected_failures.txt") -> dict[str, str]:
    """`case: reason` lines (blank lines and `#` comments skipped) -> {case: reason}."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, _, reason = line.partition(":")
            out[name.strip()] = reason.strip()
    return out


def clear_error(exc: BaseException, *words: str) -> None:
    """`exc` is a jaxtorch error or a torch-style error whose message names one of `words` (case-insensitive)."""
    msg = str(exc).lower()
    assert not isinstance(exc, (AttributeError, RecursionError)), f"not a clear error: {exc!r}"
    for internal in ("privateuse1", "invalid python storage", "no lowering"):  # torch/jaxtorch internals
        assert internal not in msg, f"not a clear error: {exc!r}"
    assert any(w.lower() in msg for w in words), f"message names none of {words}: {exc}"


def refuses_or(check: Callable[[], None], *words: str) -> None:
    """Run `check`; it passes, or it raises a clear error naming one of `words`. Never a wrong value."""
    try:
        check()
    except AssertionError:
        raise
    except Exception as e:
        clear_error(e, *words)


def refuses(call: Callable[[], object], what: str, *words: str, error: type[BaseException] = Exception) -> Any:
    """`call()` raises a clear `error` naming one of `words` (returned, for further checks); running is
    the silent failure `what`."""
    try:
        call()
    except AssertionError:
        raise
    except error as e:
        clear_error(e, *words)
        return e
    raise AssertionError(what)


def equal(actual, expected) -> None:
    """Bit-equal values and the same dtype (torch tensors or arrays)."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), type(actual)
        assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
        actual, expected = actual.detach().cpu(), expected.detach().cpu()
        if expected.dtype == torch.bfloat16:
            actual, expected = actual.float(), expected.float()
        actual, expected = actual.numpy(), expected.numpy()
    np.testing.assert_array_equal(np.asarray(actual), np.asarray(expected))


def close(actual, expected, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Close values (torch tensors or arrays), same shape."""
    a = actual.detach().cpu().float().numpy() if isinstance(actual, torch.Tensor) else np.asarray(actual)
    e = expected.detach().cpu().float().numpy() if isinstance(expected, torch.Tensor) else np.asarray(expected)
    assert a.shape == e.shape, (a.shape, e.shape)
    np.testing.assert_allclose(a, e, rtol=rtol, atol=atol)


def load_cases() -> dict[str, Callable[[], None]]:
    """Import every `cases_*.py` beside this file (each registers its cases) and return the registry."""
    import importlib

    for path in sorted(Path(__file__).parent.glob("cases_*.py")):
        importlib.import_module(f"{__package__ or 'tests.adversarial'}.{path.stem}")
    return CASES


def failures() -> dict[str, str]:
    """Run every case here, in this process: {failing case: the first line of its error}."""
    out = {}
    for name, fn in sorted(CASES.items()):
        try:
            fn()
        except BaseException as e:
            first = (str(e).strip().splitlines() or [""])[0][:160]
            out[name] = f"{type(e).__name__}: {first}"
    return out


if __name__ == "__main__":  # python -m tests.adversarial.harness > tests/adversarial/expected_failures.txt
    import importlib
    import sys

    registry = importlib.import_module("tests.adversarial.harness")  # not __main__: the cases register there
    registry.load_cases()
    sys.stdout.write(
        "# Known failures of the adversarial suite: 'case: reason', checked both ways by test_contracts.py.\n"
        "# Regenerate: python -m tests.adversarial.harness > tests/adversarial/expected_failures.txt\n"
    )
    for name, reason in registry.failures().items():
        sys.stdout.write(f"{name}: {reason}\n")
