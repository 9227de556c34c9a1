"""The tutorial notebooks run top to bottom and print the results they teach.

Each notebook in `notebooks/` is executed in a fresh `python3` kernel with nbclient; any
cell error fails the test (`CellExecutionError` shows the cell and its traceback). The
committed notebooks have no outputs (they are written by `notebooks/make_notebooks.py`).
"""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"

# Lines each notebook must print: the results it exists to show.
EXPECTED = {
    "01_quickstart": ["device: jax:0", "res.jax() -> ArrayImpl", "problems: none",
                      "GPT2Block/attn/c_attn/aten::addmm", "2 matmul(s) found"],
    "02_training": ["restored state is identical: True", "resumed to step 200", "<image/png>",
                    "eager PyTorch test accuracy"],
    "03_feature_extractor": ["TorchModule(Sequential", "backbone unchanged: True\nhead changed: True",
                             "entry functions: 1", "trained parameters: ['head.bias', 'head.kernel']"],
    "04_sharding": ["8 devices", "data parallel, losses", "same as one device: True\nfc1.weight replicated: True",
                    "each device holds (16, 32)", "same placement as the weight: True", "norms match NumPy: True"],
    "05_interop": ["grad_fn: _JaxVjpBackward", "mean of per-example grads == batch grad: True",
                   "matches a loop: True", "JaxModule(eqx: MLP)"],
    "07_lazy": ["compiled programs: 3", "compiled programs: 0  (compile time 0.00s)\ncache hits: 20",
                "unplanned executions (what forced them):", "Tensor.item() / bool() / int() / float() at"],
}


def _text(nb) -> str:
    """Everything the code cells wrote: streams and the text form of results."""
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.output_type == "stream":
                parts.append(out.text)
            elif out.output_type in ("execute_result", "display_data"):
                parts.append(out.data.get("text/plain", "") + ("<image/png>" if "image/png" in out.data else ""))
    return "".join(parts)


def test_every_notebook_is_tested():
    assert {p.stem for p in NOTEBOOKS.glob("*.ipynb")} == set(EXPECTED)


def test_committed_notebooks_have_no_outputs():
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, f"{path.name}: clear outputs before committing"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_notebook_runs(name):
    path = NOTEBOOKS / f"{name}.ipynb"
    nb = nbformat.read(path, as_version=4)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)  # each notebook sets what it needs (04 asks for 8 devices)
    client = NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}})
    client.execute(env=env)  # raises CellExecutionError on the first failing cell
    text = _text(nb)
    for expected in EXPECTED[name]:
        assert expected in text, f"{name}: expected {expected!r} in the output:\n{text[-4000:]}"
