"""mkdocs hooks: the notebooks section of the navigation, and README.md as the home page.

The navigation's "Notebooks" section lists every `notebooks/NN_name.py` (jupytext sources,
rendered by mkdocs-jupyter), so a new notebook appears without editing mkdocs.yml.

README links are relative to the repository root. In the site:
- a link to a notebook (`notebooks/NN_name.ipynb`) goes to the notebook's page (rendered from
  its jupytext source `notebooks/NN_name.py`);
- a link to a Markdown file that is also a page stays a link (`docs/x.md` becomes `x.md`);
- a link to another file of the repository (a test, a benchmark README) becomes its text, since
  that file is not part of the site; a link to a file that does not exist is left alone, so the
  strict build reports it.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_INCLUDE = "--8<-- README.md"
_LINK = re.compile(r"\[([^\]]+)\]\(([^)\s#]+)(#[^)]*)?\)")


def _rewrite(match: re.Match, pages: set[str]) -> str:
    text, target, anchor = match.group(1), match.group(2), match.group(3) or ""
    if "://" in target or target.startswith("mailto:"):
        return match.group(0)
    if target.startswith("notebooks/") and target.endswith(".ipynb"):
        source = target[: -len(".ipynb")] + ".py"
        if (ROOT / source).exists():
            return f"[{text}]({source}{anchor})"
    if target.startswith("docs/") and target[len("docs/") :] in pages:
        return f"[{text}]({target[len('docs/') :]}{anchor})"
    if target in pages or not (ROOT / target).exists():
        return match.group(0)
    return text


def readme_for_site(readme: str, pages: set[str]) -> str:
    """`readme` with its repository links rewritten for the site (see the module docstring)."""
    return _LINK.sub(lambda m: _rewrite(m, pages), readme)


def on_config(config):
    notebooks = [f"notebooks/{p.name}" for p in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py"))]
    for entry in config.nav or []:
        if isinstance(entry, dict) and "Notebooks" in entry:
            entry["Notebooks"] = notebooks
    return config


def on_page_markdown(markdown: str, page, config, files) -> str:
    if _INCLUDE not in markdown:
        return markdown
    pages = {f.src_uri for f in files.documentation_pages()}
    readme = (ROOT / "README.md").read_text()
    return markdown.replace(_INCLUDE, readme_for_site(readme, pages))
