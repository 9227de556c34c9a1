"""Resident-memory readings for the loading benchmarks (`load.py`, `device_map.py`), from /proc (Linux).

_reset_peak(); ...; extra = _peak() - baseline
"""

from __future__ import annotations

import os


def _rss() -> int:
    """This process's resident memory now, in bytes (`/proc/self/statm`)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak() -> None:
    """Restart this process's peak resident memory (`VmHWM`) from its resident memory now (clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak() -> int:
    """Peak resident memory since `_reset_peak` (`VmHWM`), in bytes. Not `ru_maxrss`: Linux carries that
    across `exec` from the parent, so a child would report the benchmark parent's memory."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")
