"""The README's training example runs: loss falls, checkpoint/resume, evaluation in torch."""

import importlib.util
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_cnn.py"


def test_train_cnn_example(capsys):
    spec = importlib.util.spec_from_file_location("train_cnn", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    result = mod.main(steps=60)
    assert result["last_loss"] < 0.8 * result["first_loss"]
    assert result["accuracy"] > 0.4  # 4 classes: chance is 0.25
    out = capsys.readouterr()
    assert "checkpoint:" in out.out
    # stderr is not a terminal here: plain progress lines, no tqdm redraws
    assert "train step 20/30: loss" in out.out and "train step 60/60: loss" in out.out
    assert "\r" not in out.err
