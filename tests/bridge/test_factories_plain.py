"""Factories on the jax device with plain `import jaxtorch`: no `enable_globally`, no `default_env`.

A newcomer's first line is often `torch.arange(3, device="jax")`. Torch builds such a factory for a
backend from `empty` and the op's `out=` overload; `arange.out`'s reference calls `prims.iota`, whose
ATen kernel calls `torch.arange` again (a RecursionError), and `tril_indices` had no kernel at all.
Each case runs in a fresh process (nothing else has set a mode) and is compared with CPU torch:
values and dtype exactly for deterministic factories, structure for random ones.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]

# name -> expression of `d` (the device); deterministic: compared with CPU torch exactly
EXACT = {
    "arange": "torch.arange(3, device=d)",
    "arange_start_step": "torch.arange(5, 0, -2, device=d)",
    "arange_float": "torch.arange(0, 1, 0.25, device=d)",
    "arange_dtype_float": "torch.arange(5, dtype=torch.float32, device=d)",
    "arange_int32": "torch.arange(5, dtype=torch.int32, device=d)",
    "arange_bfloat16": "torch.arange(0, 2, 0.5, dtype=torch.bfloat16, device=d)",
    "arange_device_index": "torch.arange(3, device=d + ':0')",
    "arange_arith": "torch.arange(3, device=d) * 2 + torch.arange(3, device=d)",
    "range": "torch.range(0, 1, 0.1, device=d)",
    "range_int": "torch.range(1, 10, 3, dtype=torch.int64, device=d)",
    "full": "torch.full((2, 3), 7, device=d)",
    "full_float": "torch.full((2,), 1.5, device=d)",
    "full_half": "torch.full((2,), 3.0, dtype=torch.float16, device=d)",
    "full_bool": "torch.full((2,), True, device=d)",
    "zeros": "torch.zeros(2, 3, device=d)",
    "zeros_int64": "torch.zeros(2, dtype=torch.int64, device=d)",
    "ones": "torch.ones(2, 3, device=d)",
    "scalar_tensor": "torch.scalar_tensor(3, device=d)",
    "linspace": "torch.linspace(0, 1, 5, device=d)",
    "linspace_int": "torch.linspace(0, 10, 5, dtype=torch.int64, device=d)",
    "logspace": "torch.logspace(0, 1, 5, device=d)",
    "eye": "torch.eye(3, device=d)",
    "eye_rect": "torch.eye(2, 3, device=torch.device(d))",
    "tril_indices": "torch.tril_indices(3, 3, device=d)",
    "triu_indices": "torch.triu_indices(3, 4, 1, device=d)",
    "fftfreq": "torch.fft.fftfreq(4, device=d)",
    "tensor": "torch.tensor([1, 2, 3], device=d)",
    "tensor_float": "torch.tensor([1.0, 2.0], device=d)",
    "as_tensor": "torch.as_tensor([1, 2], device=d)",
    "one_hot": "F.one_hot(torch.tensor([0, 2, 1], device=d), 3)",
    "one_hot_inferred": "F.one_hot(torch.tensor([0, 2, 1], device=d))",
    "one_hot_of_arange": "F.one_hot(torch.arange(3, device=d) % 2)",
    "bartlett_window": "torch.bartlett_window(5, device=d)",
    "hamming_window": "torch.hamming_window(6, device=d)",
    "meshgrid": "torch.meshgrid(torch.arange(2, device=d), torch.arange(3, device=d), indexing='ij')[1]",
    "cartesian_prod": "torch.cartesian_prod(torch.arange(2, device=d), torch.arange(2, device=d))",
    "arange_out": "torch.arange(4, out=torch.empty(0, dtype=torch.int64, device=d))",
    "arange_out_int32": "torch.arange(0, 4, out=torch.empty(2, dtype=torch.int32, device=d))",
    "linspace_out": "torch.linspace(0, 1, 5, out=torch.empty(5, device=d))",
    "eye_out": "torch.eye(2, out=torch.empty(2, 2, device=d))",
    "full_out": "torch.full((7,), 2, out=torch.empty(7, dtype=torch.float16, device=d))",
    "range_out": "torch.range(0, 4, out=torch.empty(2, device=d))",
}
# name -> expression of `d`: compared with CPU torch to float32 rounding (a different order of operations)
CLOSE = {
    "hann_window": "torch.hann_window(5, device=d)",
    "kaiser_window": "torch.kaiser_window(5, device=d)",
    "kaiser_window_symmetric": "torch.kaiser_window(7, False, device=d)",
    "kaiser_window_beta": "torch.kaiser_window(64, True, 8.6, device=d)",
    "kaiser_window_half": "torch.kaiser_window(6, dtype=torch.float16, device=d)",
}
# name -> expression giving a tuple of plain values that must agree with CPU torch's (random factories)
STRUCTURAL = {
    "randn": "(lambda t: (t.shape, t.dtype, t.device.type == dev))(torch.randn(2, 3, device=d))",
    "rand_in_unit": "(lambda t: (t.shape, t.dtype, bool(((t >= 0) & (t < 1)).all())))(torch.rand(50, device=d))",
    "randint": "(lambda t: (t.dtype, bool(((t >= 2) & (t < 5)).all())))(torch.randint(2, 5, (40,), device=d))",
    "randint_int32": "torch.randint(3, (4,), dtype=torch.int32, device=d).dtype",
    "randperm_is_permutation": "(lambda t: (t.dtype, t.sort().values.tolist()))(torch.randperm(6, device=d))",
    "randperm_out": "torch.randperm(4, out=torch.empty(4, dtype=torch.int64, device=d)).sort().values.tolist()",
    "randint_out": (
        "(lambda t: (t.dtype, t.shape))(torch.randint(0, 5, (2, 3), out=torch.empty(0, dtype=torch.int64, device=d)))"
    ),
    "normal": "(lambda t: (t.shape, t.dtype))(torch.normal(0.0, 1.0, (3,), device=d))",
    "empty": "(lambda t: (t.shape, t.dtype))(torch.empty(2, 3, device=d))",
    "requires_grad": (
        "(lambda t: (t.requires_grad, t.is_leaf, t.dtype))(torch.arange(3.0, device=d, requires_grad=True))"
    ),
    "zeros_requires_grad": "torch.zeros(3, device=d, requires_grad=True).requires_grad",
    "seeded_generator": (
        "(lambda g: (g.manual_seed(0), torch.randn(3, generator=g, device=d).tolist())[1] == "
        "(g.manual_seed(0), torch.randn(3, generator=g, device=d).tolist())[1])(torch.Generator(device=d))"
    ),
}
# name -> expression that must raise (x64 off): the error's class name
RAISES = {
    "float64_arange": ("torch.arange(3, dtype=torch.float64, device=d)", "Float64Error"),
    "int64_beyond_32_bits": ("torch.arange(2**40, 2**40 + 3, device=d)", "Int64Error"),
}

_SCRIPT = r"""
import json, sys
sys.setrecursionlimit(2000)  # a loop shows as a RecursionError quickly
import torch
import torch.nn.functional as F
import jaxtorch  # plain import: no enable_globally, no default_env
cases = json.loads(sys.argv[1])
out = {}
def plain(x):
    if isinstance(x, torch.Tensor):
        return {"dtype": str(x.dtype), "device": x.device.type, "values": x.cpu().tolist()}
    return repr(x)
for kind, table in cases.items():
    for name, spec in table.items():
        expr = spec[0] if kind == "raises" else spec
        got = {}
        for dev in ("cpu", "jax"):
            d = dev
            try:
                got[dev] = plain(eval(expr))
            except RecursionError:
                got[dev] = "RecursionError"
            except Exception as e:
                got[dev] = "raised " + type(e).__name__ + ": " + str(e)[:300]
        out[name] = got
print("RESULTS" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def results() -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    cases = json.dumps({"exact": EXACT, "close": CLOSE, "structural": STRUCTURAL, "raises": RAISES})
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, cases], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULTS")]
    assert lines, f"the subprocess failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULTS") :])


@pytest.mark.parametrize("name", sorted(EXACT))
def test_factory_matches_cpu_torch(results, name):
    got = results[name]
    assert isinstance(got["cpu"], dict), got["cpu"]
    assert got["jax"] == {**got["cpu"], "device": "jax"}


@pytest.mark.parametrize("name", sorted(CLOSE))
def test_factory_matches_cpu_torch_to_rounding(results, name):
    got = results[name]
    assert isinstance(got["cpu"], dict) and isinstance(got["jax"], dict), got["jax"]
    assert (got["jax"]["dtype"], got["jax"]["device"]) == (got["cpu"]["dtype"], "jax")
    np.testing.assert_allclose(got["jax"]["values"], got["cpu"]["values"], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", sorted(STRUCTURAL))
def test_random_factory_matches_cpu_torch_structurally(results, name):
    got = results[name]
    assert not got["cpu"].startswith("raised"), got["cpu"]
    assert got["jax"] == got["cpu"]


@pytest.mark.parametrize("name", sorted(RAISES))
def test_factory_beyond_x64_off_raises_a_clear_error(results, name):
    got = results[name]
    assert isinstance(got["cpu"], dict), got["cpu"]  # CPU torch has 64 bits
    assert got["jax"].startswith(f"raised {RAISES[name][1]}"), got["jax"]


def test_first_line_of_a_newcomer():
    """The exact command from the bug report, in a fresh interpreter."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    code = "import torch, jaxtorch; t = torch.arange(3, device='jax'); print(t.dtype, t.device.type, t.tolist())"
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "torch.int64 jax [0, 1, 2]"
