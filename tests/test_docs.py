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
    # its **Arguments:** list renders as a list (docs/griffe_lists.py), not as one run-on paragraph
    assert "<p><strong>Arguments:</strong></p>\n<ul>\n<li><code>module</code>" in api
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


# --- The public names' docstrings (issue 32, item 6) -------------------------------------------------------------

SECTIONS = ("**Arguments:**", "**Returns:**", "**Example:**")
# what every docstring Example may use without importing it
PRELUDE = "import torch, jax, jax.numpy as jnp, jaxtorch\n"
_COVERAGE = ["check", "how", "family", "op_name", "universe", "report", "Report", "main"]


def public_names() -> dict[str, object]:
    """Every public name, `jaxtorch.NAME` or `jaxtorch.MODULE.NAME`, -> its object (each object once)."""
    import jaxtorch.coverage

    found: dict[str, object] = {}
    seen: set[int] = set()
    groups = [("jaxtorch", jaxtorch, jaxtorch.__all__)]
    groups += [
        (f"jaxtorch.{m}", getattr(jaxtorch, m), getattr(jaxtorch, m).__all__) for m in ("train", "xla", "generation")
    ]
    groups.append(("jaxtorch.coverage", jaxtorch.coverage, _COVERAGE))
    for prefix, module, names in groups:
        for name in names:
            obj = getattr(module, name)
            if id(obj) not in seen:
                seen.add(id(obj))
                found[f"{prefix}.{name}"] = obj
    return found


def _doc(obj: object) -> str:
    import inspect
    import types

    return (obj.__doc__ or "") if isinstance(obj, types.ModuleType) else (inspect.getdoc(obj) or "")


def _examples(doc: str) -> list[str]:
    """The ```python blocks after a docstring's **Example:** heading, dedented."""
    import textwrap

    tail = doc.partition("**Example:**")[2]
    return [textwrap.dedent(b) for b in re.findall(r"```python\n(.*?)\n[ \t]*```", tail, re.S)]


def _is_error(obj: object) -> bool:
    """An exception or warning class: its Example must leave the instance it caught in `caught`."""
    return isinstance(obj, type) and issubclass(obj, BaseException)


def test_every_public_name_has_arguments_returns_and_an_example():
    import types

    missing = {}
    for name, obj in public_names().items():
        doc = _doc(obj)
        # a module's docstring introduces it and gives an example; an error (or warning) class says when it is
        # raised and the way out, its Example catching it; a class gives its constructor's arguments
        wanted = ("**Example:**",) if isinstance(obj, types.ModuleType) or _is_error(obj) else SECTIONS
        lacking = [s for s in wanted if s not in doc]
        if not lacking and not _examples(doc):
            lacking = ["a ```python block under **Example:**"]
        if lacking:
            missing[name] = lacking
    assert not missing, f"docstrings lacking sections: {missing}"


def _documented_objects() -> set[int]:
    """The objects a `::: jaxtorch...` block of docs/api renders (a module block: its members too)."""
    import importlib

    ids: set[int] = set()
    for page in (ROOT / "docs" / "api").glob("*.md"):
        text = page.read_text()
        for path, options in re.findall(r"^::: (jaxtorch[\w.]*)\n((?:    .*\n?)*)", text, re.M):
            module_name, _, attr = path.rpartition(".")
            try:
                obj = importlib.import_module(path)
            except ImportError:
                obj = getattr(importlib.import_module(module_name), attr)
            ids.add(id(obj))
            if isinstance(obj, type(jaxtorch)):
                listed = re.search(r"members:\s*(\[.*?\]|false)", options)
                members = getattr(obj, "__all__", []) if listed is None else re.findall(r"\w+", listed.group(1))
                ids |= {id(getattr(obj, m)) for m in members if m != "false"}
    return ids


def test_every_public_name_is_rendered_by_a_docs_page():
    documented = _documented_objects()
    missing = sorted(name for name, obj in public_names().items() if id(obj) not in documented)
    assert not missing, f"add a `::: NAME` block to a page of docs/api/ for: {missing}"


_RUNNER = """
import sys, traceback, json
PRELUDE = {prelude!r}
failures = []
for name, is_error, code in json.load(open(sys.argv[1])):
    ns = {{"__name__": "__doc_example__"}}
    try:
        exec(compile(PRELUDE + code, name, "exec"), ns)
        if is_error and not isinstance(ns.get("caught"), eval(name, ns)):
            raise AssertionError("an error class's example catches it as `caught`")
    except BaseException:
        failures.append(name + ":\\n" + traceback.format_exc(limit=-3))
print("\\n".join(failures))
sys.exit(1 if failures else 0)
"""


def test_docstring_examples_run(tmp_path):
    import json

    blocks = [(name, _is_error(obj), code) for name, obj in public_names().items() for code in _examples(_doc(obj))]
    assert len(blocks) >= len(public_names())
    (tmp_path / "examples.json").write_text(json.dumps(blocks))
    (tmp_path / "run.py").write_text(_RUNNER.format(prelude=PRELUDE))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, str(tmp_path / "run.py"), str(tmp_path / "examples.json")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, (out.stdout + out.stderr)[-8000:]
