"""Two processes x 4 CPU devices on loopback (jax.distributed) train like one process."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

from jaxtorch.train import load_checkpoint

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int) -> dict:
    return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}


def test_two_processes_match_single_process(tmp_path):
    port = _free_port()
    cmd = [sys.executable, "-m", "tests.train._distributed"]
    ckpt = tmp_path / "ckpt.safetensors"
    procs = [
        subprocess.Popen(
            cmd + ["multi", str(tmp_path / f"p{i}.npz"), str(i), str(port), str(ckpt)],
            cwd=ROOT,
            env=_env(4),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    single = subprocess.run(
        cmd + ["single", str(tmp_path / "single.npz")],
        cwd=ROOT,
        env=_env(1),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert single.returncode == 0, single.stderr[-4000:]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=600)
            outs.append(out)
            assert p.returncode == 0, err[-4000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
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
