"""Packaging (issue 22, item 8): a pure-Python wheel, and no torch in the build requirements.

With torch among the build requirements, pip put a second torch (multi-GB, CUDA, from PyPI) into its
isolated build environment even where torch was installed, and the compiled device guard made the
wheel platform-specific. The guard is now compiled on first import (`tests/bridge/test_device_guard.py`).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[(]", requirement.strip(), maxsplit=1)[0].lower()


def test_the_build_requirements_have_no_torch():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    requires = [_name(r) for r in pyproject["build-system"]["requires"]]
    assert "torch" not in requires and requires == ["setuptools"], requires
    assert not (ROOT / "setup.py").exists()  # nothing imports torch, or builds an extension, at install


def test_the_wheel_is_pure_python_and_ships_the_guard_source(tmp_path):
    src = tmp_path / "src"  # a copy, so the build's own folders stay out of the checkout
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "jaxtorch", src / "jaxtorch", ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyd"))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(src),
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "w"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    (wheel,) = (tmp_path / "w").glob("*.whl")
    assert wheel.name.endswith("-py3-none-any.whl"), wheel.name
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if n.endswith((".so", ".pyd", ".dylib"))], names
    assert "jaxtorch/bridge/_device_guard.cpp" in names  # compiled from this on first import
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    torch_reqs = [line for line in metadata.splitlines() if line.startswith("Requires-Dist: torch")]
    assert torch_reqs == ["Requires-Dist: torch<2.15,>=2.13"], torch_reqs  # an installed 2.13 or 2.14 satisfies it
