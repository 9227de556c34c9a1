"""The documentation builds strictly (issue 14, item 8): `mkdocs build --strict` with the API
reference from the docstrings (mkdocstrings), every notebook as a page (mkdocs-jupyter, from its
jupytext source) and the README as the home page. A broken reference (an unknown `::: name`, a
link to a missing page or file) fails the build.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import jaxtorch

ROOT = Path(__file__).resolve().parents[1]


def _hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_strict_build(tmp_path):
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    home = (site / "index.html").read_text()
    assert "What is tested, against the peers" in home and "entries passing" in home  # feature table, coverage
    api = (site / "api" / "jax_first" / "index.html").read_text()
    assert "Turn a <code>torch.nn.Module</code> into" in api  # extract's docstring
    for source in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py")):
        page = site / "notebooks" / source.stem / "index.html"
        assert page.exists(), f"no page for {source.name}"
        assert f'href="notebooks/{source.stem}/"' in home  # in the navigation


def test_api_reference_covers_the_public_api():
    documented = set()
    for page in (ROOT / "docs" / "api").glob("*.md"):
        documented |= set(re.findall(r"^::: jaxtorch\.(?:\w+\.)*(\w+)$", page.read_text(), re.M))
    missing = sorted(set(jaxtorch.__all__) - documented)
    assert not missing, f"add `::: jaxtorch.NAME` to a page of docs/api/ for: {missing}"


def test_readme_links_point_into_the_site():
    hooks = _hooks()
    text = (
        "[nb](notebooks/01_quickstart.ipynb) [t](tests/test_readme.py) [gone](tests/no_such_file.py) "
        "[web](https://jax.dev) [home](index.md)"
    )
    assert hooks.readme_for_site(text, {"index.md"}) == (
        "[nb](notebooks/01_quickstart.py) t [gone](tests/no_such_file.py) [web](https://jax.dev) [home](index.md)"
    )
