"""The tutorial notebooks run top to bottom and print the results they teach.

A notebook's source is a jupytext percent-format file `notebooks/NN_name.py` (edit it as a
notebook in Jupyter with jupytext, or as text), paired with `notebooks/NN_name.ipynb`, which is
committed without outputs (`jupytext --sync notebooks/NN_name.py` rewrites it). Each source is
executed in a fresh `python3` kernel with nbclient; any cell error fails the test
(`CellExecutionError` shows the cell and its traceback).
"""

from __future__ import annotations

import os
from pathlib import Path

import jupytext
import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
SOURCES = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.py"))

# Lines a notebook must print: the results it exists to show (a notebook not listed only has to run).
EXPECTED = {
    "01_quickstart": [
        "device: jax:0",
        "res.jax() -> ArrayImpl",
        "problems: none",
        "GPT2Block/attn/c_attn/aten::addmm",
        "2 matmul(s) found",
    ],
    "02_training": [
        "restored state is identical: True",
        "resumed to step 200",
        "<image/png>",
        "eager PyTorch test accuracy",
    ],
    "03_feature_extractor": [
        "TorchModule(Sequential",
        "backbone unchanged: True\nhead changed: True",
        "entry functions: 1",
        "trained parameters: ['head.bias', 'head.kernel']",
    ],
    "04_sharding": [
        "8 devices",
        "data parallel, losses",
        "same as one device: True\nfc1.weight replicated: True",
        "each device holds (16, 32)",
        "same placement as the weight: True",
        "norms match NumPy: True",
    ],
    "05_interop": [
        "grad_fn: _JaxVjpBackward",
        "mean of per-example grads == batch grad: True",
        "matches a loop: True",
        "JaxModule(eqx: MLP)",
    ],
    "06_llm": [
        "logits float32[2@data,16,256] | same as one device: True",
        "each device holds (16, 64)",
        "same tokens as torch's loop: True | as torch's generate: True",
        "programs compiled: 2 (prefill and decode)",
        "greedy_decoder, same tokens as torch's loop: True",
        "<image/png>",
        "8 arrays changed, all LoRA: True",
        "loaded q_proj.weight float32[64@model,64] -> each device holds (16, 64)",
        "loaded, tensor parallel: same logits as torch: True",
        "greedy from the loaded weights, same tokens as torch's generate: True",
    ],
    "07_lazy": [
        "compiled programs: 3",
        "compiled programs: 0  (compile time 0.00s)\ncache hits: 20",
        "unplanned executions (what forced them):",
        "Tensor.item() / bool() / int() / float() at",
    ],
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


def _cells(nb) -> list[tuple[str, str]]:
    return [(cell.cell_type, cell.source) for cell in nb.cells]


def test_every_notebook_has_a_source_and_a_paired_ipynb():
    sources = {p.stem for p in SOURCES}
    assert {"01_quickstart", "02_training"} <= sources
    assert {p.stem for p in NOTEBOOKS.glob("*.ipynb")} == sources, "each notebooks/NN_name.py pairs with a .ipynb"
    assert set(EXPECTED) <= sources


@pytest.mark.parametrize("path", SOURCES, ids=[p.stem for p in SOURCES])
def test_ipynb_is_in_sync_with_its_source_and_has_no_outputs(path):
    source = jupytext.read(path)
    nb = nbformat.read(path.with_suffix(".ipynb"), as_version=4)
    nbformat.validate(nb)
    assert _cells(nb) == _cells(source), (
        f"{path.with_suffix('.ipynb').name} differs from {path.name}: run `jupytext --sync {path.relative_to(ROOT)}`"
    )
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, f"{path.name}: clear outputs before committing"


@pytest.mark.parametrize("path", SOURCES, ids=[p.stem for p in SOURCES])
def test_notebook_runs(path):
    nb = jupytext.read(path)
    nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "JAX_PLATFORMS": "cpu",
    }
    env.pop("XLA_FLAGS", None)  # each notebook sets what it needs (04 asks for 8 devices)
    client = NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}})
    client.execute(env=env)  # raises CellExecutionError on the first failing cell
    text = _text(nb)
    for expected in EXPECTED.get(path.stem, []):
        assert expected in text, f"{path.stem}: expected {expected!r} in the output:\n{text[-4000:]}"
