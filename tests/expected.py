"""The expected-failures lists of the OpInfo, ModuleInfo and gradient suites: one `mode name: reason` per line,
checked both ways (`check_listed`)."""

from __future__ import annotations

from pathlib import Path


def load_expected(path: Path) -> dict[tuple[str, str], str]:
    """`mode name: reason` lines (blank lines and `#` comments skipped) -> {(mode, name): reason}."""
    expected = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            head, _, reason = line.partition(":")
            mode, name = head.split()
            expected[(mode, name)] = reason.strip()
    return expected


def check_listed(mode: str, name: str, ok: bool | None, reason: str, expected: dict, file_name: str) -> None:
    """The two-way rule: a failure (`ok` False) must be listed, a listed pair must fail; `ok` None
    (nothing to compare) must not be listed. `reason` says why it failed, or why there was nothing."""
    listed = (mode, name) in expected
    if ok is None:
        assert not listed, f"{mode} {name} is listed but has nothing to compare ({reason})"
    elif ok:
        assert not listed, f"{mode} {name} now passes: remove it from {file_name}"
    else:
        assert listed, f"{mode} {name} fails and is not in {file_name}: {reason}"
