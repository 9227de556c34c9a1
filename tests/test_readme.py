"""Every Python block of README.md runs as written (issue 14, item 5).

Each block runs in a fresh interpreter (the PyTorch-first one switches on `enable_globally()`,
which would leak into the other tests), with this checkout's jaxtorch first on the path.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def python_blocks(markdown: str) -> list[tuple[str, str]]:
    """(heading above the block, code) for each fenced ```python block of `markdown`."""
    blocks, heading = [], "top"
    for m in re.finditer(r"^(#+ [^\n]*)$|^```python\n(.*?)^```", markdown, re.M | re.S):
        if m.group(1):
            heading = m.group(1).lstrip("# ").strip()
        else:
            blocks.append((heading, m.group(2)))
    return blocks


BLOCKS = python_blocks((ROOT / "README.md").read_text())


def test_blocks_are_found():
    headings = [h for h, _ in BLOCKS]
    assert "30 seconds, JAX-first" in headings and "30 seconds, PyTorch-first" in headings


@pytest.mark.parametrize("code", [c for _, c in BLOCKS], ids=[h for h, _ in BLOCKS])
def test_readme_block_runs_as_written(code, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, f"README block failed:\n{code}\n--- stderr ---\n{out.stderr[-4000:]}"


def test_every_notebook_is_listed():
    notebooks = sorted(p.stem for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    readme = (ROOT / "README.md").read_text()
    missing = [n for n in notebooks if f"[{n}](notebooks/{n}.ipynb)" not in readme]
    assert notebooks and not missing, f"README.md's notebook table lacks {missing}"
