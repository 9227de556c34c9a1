"""The C++ device guard of the `jax` device is built at install time (issue 14, item 4).

`pip install -r requirements.txt` (its `-e .`) runs setup.py, which compiles
`jaxtorch/bridge/_device_guard.cpp` into `jaxtorch.bridge._device_guard`; `import jaxtorch`
then loads it instead of compiling at import. A checkout without it compiles once at import,
saying so in one line.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from jaxtorch.bridge.tensor import _device as device

ROOT = Path(__file__).resolve().parents[2]

# Runs `import jaxtorch` with the prebuilt module hidden, as in a checkout that was never installed.
_WITHOUT_PREBUILT = """
import sys
class Hide:
    def find_spec(self, name, path=None, target=None):
        if name == "jaxtorch.bridge._device_guard":
            raise ImportError("hidden by the test")
sys.meta_path.insert(0, Hide())
import jaxtorch.bridge.tensor._device as d
print(repr(d.CPP_GUARD))
"""


# Counts the calls into torch's Python device guard during a backward on the jax device.
_PYTHON_GUARD_CALLS = """
import torch, torch.utils.backend_registration as br
calls = []
class Spy(br._DummyDeviceGuard):
    def type_(self):
        calls.append(1)
        return super().type_()
br._DummyDeviceGuard = Spy
import jaxtorch
with jaxtorch.default_env():
    m = torch.nn.Linear(3, 2).to("jax")
    m(torch.ones(4, 3, device="jax")).sum().backward()
print(len(calls))
"""


def _python(code: str, **env) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k != "JAXTORCH_PYTHON_GUARD"}
    env = {**base, **env, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=env.get("TORCH_EXTENSIONS_DIR", ROOT),
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_import_loads_the_guard_built_at_install():
    assert device.CPP_GUARD == "prebuilt", (
        "the C++ device guard was not built by the install: run `pip install -r requirements.txt` "
        "(or `pip install -e .`) in this checkout"
    )
    from jaxtorch.bridge import _device_guard

    assert _device_guard.TORCH_VERSION == torch.__version__


def test_a_guard_built_for_another_torch_is_not_loaded(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "0.0.1")
    assert device._prebuilt_guard() is None


def test_the_cpp_guard_is_the_one_torch_calls():
    # torch's Python guard (registered after ours) is never called once the C++ one is in place
    with_cpp = _python(_PYTHON_GUARD_CALLS)
    assert with_cpp.returncode == 0 and with_cpp.stdout.split() == ["0"], with_cpp.stderr
    without = _python(_PYTHON_GUARD_CALLS, JAXTORCH_PYTHON_GUARD="1")  # the spy does see calls without it
    assert without.returncode == 0 and int(without.stdout.split()[-1]) > 0, without.stderr


def test_without_the_prebuilt_guard_import_compiles_once_and_says_so(tmp_path):
    def run():
        return _python(_WITHOUT_PREBUILT, TORCH_EXTENSIONS_DIR=str(tmp_path))

    first = run()
    assert first.returncode == 0 and first.stdout.strip() == "'built at import'", first.stderr
    said = [line for line in first.stderr.splitlines() if "C++ device guard" in line]
    assert len(said) == 1 and said[0].startswith("jaxtorch: compiling its C++ device guard once (at most about"), (
        first.stderr
    )
    second = run()  # cached: loads without compiling or saying anything
    assert second.stdout.strip() == "'built at import'" and "C++ device guard" not in second.stderr, second.stderr
