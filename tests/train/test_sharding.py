"""GSPMD: data- and tensor-parallel results equal single-device ones (8 simulated CPU devices).

The pytest process has one device, so each check runs in a subprocess with
`XLA_FLAGS=--xla_force_host_platform_device_count=8` (see `_multidevice.py`).
"""

import subprocess
import sys

import pytest
from jax.sharding import PartitionSpec as P

from jaxtorch.train._sharding import path_name, spec_for

from ._procs import ROOT, cpu_env


def run_check(name: str, devices: int = 8, timeout: int = 600) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.train._multidevice", name],
        cwd=ROOT,
        env=cpu_env(devices),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0 and f"OK {name}" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout


@pytest.mark.parametrize("check", ["parallel", "checkpoint", "xla", "device_loader_loop"])
def test_on_eight_devices(check):
    run_check(check)


def test_llama_tensor_parallel_on_auto_and_explicit_meshes():
    """Issue 12: jax.make_mesh's Explicit axes failed in the attention reshape (ShardingTypeError)."""
    run_check("llama_meshes")


def test_factories_honour_device_index():
    run_check("factory_placement")


def test_rules_first_match_wins():
    rules = [(r"fc1\.weight$", P("model", None)), (r"fc1\.", P("model")), (r".*", P())]
    assert spec_for("fc1.weight", rules) == P("model", None)
    assert spec_for("fc1.bias", rules) == P("model")
    assert spec_for("opt_state.0.mu.fc1.weight", rules) == P("model", None)
    assert spec_for("fc2.weight", rules) == P()
    assert spec_for("fc2.weight", []) == P()
    import jax

    paths = [path_name(p) for p, _ in jax.tree_util.tree_flatten_with_path({"params": {"a.b": 1}, "l": [2]})[0]]
    assert paths == ["l.0", "params.a.b"]
