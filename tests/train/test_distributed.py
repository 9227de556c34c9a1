"""Two processes x 4 CPU devices on loopback (jax.distributed) train like one process."""

import subprocess
import sys

import numpy as np

from jaxtorch.train import load_checkpoint

from ._procs import ROOT, cpu_env, free_port, spawn, wait_all


def test_two_processes_match_single_process(tmp_path):
    port = free_port()
    worker = "tests.train._distributed"
    ckpt = tmp_path / "ckpt.safetensors"
    procs = [spawn([worker, "multi", str(tmp_path / f"p{i}.npz"), str(i), str(port), str(ckpt)], 4) for i in range(2)]
    single = subprocess.run(
        [sys.executable, "-m", worker, "single", str(tmp_path / "single.npz")],
        cwd=ROOT,
        env=cpu_env(1),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert single.returncode == 0, single.stderr[-4000:]
    outs = wait_all(procs)
    assert "OK multi 0 2" in outs[0] and "OK multi" not in outs[1]  # master_print: process 0 only
    ref = np.load(tmp_path / "single.npz")
    runs = [np.load(tmp_path / f"p{i}.npz") for i in range(2)]
    saved = load_checkpoint(ckpt)
    for name in ref.files:
        np.testing.assert_array_equal(runs[0][name], runs[1][name], err_msg=name)
        np.testing.assert_allclose(runs[0][name], ref[name], atol=1e-5, rtol=1e-5, err_msg=name)
        if name != "loss":
            np.testing.assert_array_equal(np.asarray(saved.params[name]), runs[0][name], err_msg=name)
    assert int(saved.step) == 3
