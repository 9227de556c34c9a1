"""The expected-failures lists of the OpInfo and ModuleInfo suites: one `mode name: reason` per line."""

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
