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

from jaxtorch.bridge import device

ROOT = Path(__file__).resolve().parents[2]

# Runs `import jaxtorch` with the prebuilt module hidden, as in a checkout that was never installed.
_WITHOUT_PREBUILT = """
import sys
class Hide:
    def find_spec(self, name, path=None, target=None):
        if name == "jaxtorch.bridge._device_guard":
            raise ImportError("hidden by the test")
sys.meta_path.insert(0, Hide())
import jaxtorch.bridge.device as d
print(repr(d.CPP_GUARD))
"""


def test_import_loads_the_guard_built_at_install():
    assert device.CPP_GUARD == "prebuilt", (
        "the C++ device guard was not built by the install: run `pip install -r requirements.txt` "
        "(or `pip install -e .`) in this checkout")
    from jaxtorch.bridge import _device_guard

    assert _device_guard.TORCH_VERSION == torch.__version__


def test_a_guard_built_for_another_torch_is_not_loaded(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "0.0.1")
    assert device._prebuilt_guard() is None


def test_without_the_prebuilt_guard_import_compiles_once_and_says_so(tmp_path):
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop("JAXTORCH_PYTHON_GUARD", None)

    def run():
        return subprocess.run([sys.executable, "-c", _WITHOUT_PREBUILT], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=600)

    first = run()
    assert first.returncode == 0 and first.stdout.strip() == "'built at import'", first.stderr
    said = [line for line in first.stderr.splitlines() if "C++ device guard" in line]
    assert len(said) == 1 and said[0].startswith("jaxtorch: compiling its C++ device guard once (at most about"), first.stderr
    second = run()  # cached: loads without compiling or saying anything
    assert second.stdout.strip() == "'built at import'" and "C++ device guard" not in second.stderr, second.stderr
