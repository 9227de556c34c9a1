"""Subprocesses with several simulated CPU devices, and the two-process `jax.distributed` set-up
their workers share (`_distributed.py`, `_load_worker.py`).

Example:
    ```python
    port = free_port()
    procs = [spawn(["tests.train._distributed", "multi", out, str(i), str(port)], devices=4) for i in range(2)]
    outs = wait_all(procs)  # their stdouts; each must exit 0
    ```
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def cpu_env(devices: int) -> dict[str, str]:
    """This process's environment with JAX on `devices` simulated CPU devices."""
    return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}


def free_port() -> int:
    """A loopback port free now (for `jax.distributed`'s coordinator)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(module_args: list[str], devices: int) -> subprocess.Popen:
    """`python -m MODULE ARGS...` from the repository root on `devices` CPU devices, output piped."""
    return subprocess.Popen(
        [sys.executable, "-m", *module_args],
        cwd=ROOT,
        env=cpu_env(devices),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_all(procs: list[subprocess.Popen], timeout: float = 600) -> list[str]:
    """The stdout of each process once it exits; each must exit 0 (else its stderr's end is the
    failure). Processes still running when this fails are killed."""
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            assert p.returncode == 0, err[-4000:]
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outs


def init_two_processes(process_id: int, port: int) -> None:
    """Join a `jax.distributed` run of 2 processes x 4 CPU devices on loopback `port`."""
    import jax

    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id, initialization_timeout=120
    )
    assert jax.process_count() == 2 and jax.device_count() == 8 and jax.local_device_count() == 4
