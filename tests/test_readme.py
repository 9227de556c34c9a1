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


# ---- the README's facts match the code (issue 30, item 19) ----------------------------------------------------------
README = (ROOT / "README.md").read_text()


def test_adversarial_counts_are_current():
    from tests.adversarial import test_contracts
    from tests.adversarial.harness import CASES

    m = re.search(r"adversarial contracts suite \((\d+) cases.*?\| (\d+) / (\d+) .*?(\d+) listed with reasons", README)
    assert m, "README.md's adversarial row not found"
    total, passing, total2, listed = map(int, m.groups())
    assert total == total2 == len(CASES), (total, total2, len(CASES))
    assert listed == len(test_contracts.EXPECTED), (listed, len(test_contracts.EXPECTED))
    assert passing <= total - listed, (passing, total, listed)


def test_named_jax_loops_are_the_ones_the_code_uses():
    """Each `lax.<loop>` the README says a module uses appears in that module's source."""
    claims = re.findall(r"a (lax\.\w+) decode loop[^\n]*\((jaxtorch/[\w/]+\.py)\)", README)
    assert claims, "README.md's decode-loop claim not found"
    for primitive, path in claims:
        assert primitive in (ROOT / path).read_text(), f"README says {path} uses {primitive}; it does not"


def test_named_hugging_face_switches_are_not_deprecated():
    """Every `model.<name>_enable()` the README shows exists in the pinned transformers and warns no deprecation."""
    import warnings

    transformers = pytest.importorskip("transformers")
    names = sorted(set(re.findall(r"`(\w+_enable)\(\)`", README)))
    assert names, "README.md names no Hugging Face *_enable() switch"
    cfg = transformers.LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2
    )
    for name in names:
        model = transformers.LlamaForCausalLM(cfg)
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            warnings.simplefilter("error", DeprecationWarning)
            getattr(model, name)()
