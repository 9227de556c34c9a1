"""The C++ device guard of the `jax` device is compiled on first import, into a per-user cache (issue 22, item 8).

The wheel is pure Python (`tests/test_packaging.py`); `import jaxtorch` compiles
`jaxtorch/bridge/_device_guard.cpp` with torch's cpp_extension into `guard_cache_dir()` (keyed by
torch version, Python and the source's hash), saying so in one line, and loads it from there
afterwards. With it, an exception raised inside `loss.backward()` is an ordinary Python exception;
with torch's Python guard the process aborts.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from jaxtorch.bridge.tensor import _device as device

ROOT = Path(__file__).resolve().parents[2]

_STATE = "import jaxtorch.bridge.tensor._device as d; print(repr(d.CPP_GUARD))"


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

# An op of the backward pass (ReLU's) raises: torch's engine must hand the exception back to Python.
_RAISE_IN_BACKWARD = """
import torch, jaxtorch

def boom(*args, **kwargs):
    raise ValueError("raised inside backward")

jaxtorch.register_op(torch.ops.aten.threshold_backward.default, boom)
with jaxtorch.default_env():
    m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1)).to("jax")
    loss = m(torch.ones(2, 3, device="jax")).sum()
    try:
        loss.backward()
    except ValueError as e:
        print("caught:", e)
"""


def _env(**env) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if k != "JAXTORCH_PYTHON_GUARD"}
    return {**base, **env, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def _python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], env=_env(**env), cwd=ROOT, capture_output=True, text=True, timeout=600
    )


def _said(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "C++ device guard" in line]


def test_import_loads_the_compiled_guard_from_the_cache():
    assert device.CPP_GUARD in ("cached", "compiled"), (
        "the C++ device guard is not in place (no C++ compiler or ninja?): see the warning `import jaxtorch` gave"
    )
    assert next(device.guard_cache_dir().glob("jaxtorch_device_guard*")).is_file()


def test_the_cache_is_keyed_by_torch_version_and_source(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXTORCH_CACHE_DIR", str(tmp_path))
    here = device.guard_cache_dir()
    assert here.is_relative_to(tmp_path) and torch.__version__ in here.name
    monkeypatch.setattr(torch, "__version__", "0.0.1")
    assert device.guard_cache_dir() != here  # another torch never loads this build
    monkeypatch.undo()
    monkeypatch.setenv("JAXTORCH_CACHE_DIR", str(tmp_path))
    source = tmp_path / "guard.cpp"
    source.write_bytes(device._GUARD_SOURCE.read_bytes() + b"\n// changed\n")
    monkeypatch.setattr(device, "_GUARD_SOURCE", source)
    assert device.guard_cache_dir() != here  # nor does a changed source


def test_the_cpp_guard_is_the_one_torch_calls():
    # torch's Python guard (registered after ours) is never called once the C++ one is in place
    with_cpp = _python(_PYTHON_GUARD_CALLS)
    assert with_cpp.returncode == 0 and with_cpp.stdout.split() == ["0"], with_cpp.stderr
    without = _python(_PYTHON_GUARD_CALLS, JAXTORCH_PYTHON_GUARD="1")  # the spy does see calls without it
    assert without.returncode == 0 and int(without.stdout.split()[-1]) > 0, without.stderr


def test_an_exception_inside_backward_is_raised_not_an_abort():
    out = _python(_RAISE_IN_BACKWARD)
    assert out.returncode == 0 and out.stdout.strip() == "caught: raised inside backward", out.stderr
    python_guard = _python(_RAISE_IN_BACKWARD, JAXTORCH_PYTHON_GUARD="1")  # jaxtorch keeps it there too
    assert python_guard.returncode == 0 and python_guard.stdout.strip() == "caught: raised inside backward", (
        python_guard.stderr
    )


def test_first_import_compiles_once_under_concurrent_imports_and_says_so(tmp_path):
    # two processes (pytest-xdist workers, say) importing into one empty cache: one compiles, the other
    # waits on the lock and loads its build; one line is said in all
    env = _env(JAXTORCH_CACHE_DIR=str(tmp_path))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _STATE], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert sorted(out.strip() for out, _ in outs) == ["'cached'", "'compiled'"], outs
    said = [line for _, err in outs for line in _said(err)]
    assert len(said) == 1 and said[0].startswith("jaxtorch: compiling its C++ device guard once for torch"), outs
    builds = list((tmp_path / "device_guard").glob("*/*"))
    assert sorted(p.name.split(".")[0] for p in builds) == ["jaxtorch_device_guard", "lock"], builds  # no leftovers
    again = _python(_STATE, JAXTORCH_CACHE_DIR=str(tmp_path))  # cached: loads without compiling or saying anything
    assert again.stdout.strip() == "'cached'" and not _said(again.stderr), again.stderr


def test_without_a_compiler_the_python_guard_stays_with_a_warning(tmp_path):
    out = _python(_STATE, JAXTORCH_CACHE_DIR=str(tmp_path), CXX="/nonexistent/c++")
    assert out.returncode == 0 and out.stdout.strip() == "''", out.stderr
    assert "could not build its C++ device guard" in out.stderr and "Install a C++ compiler" in out.stderr
    assert not list((tmp_path / "device_guard").glob("*/jaxtorch_device_guard*"))  # nothing half-built is kept


# ---- issue 30 item 17: a failed build is remembered; the Python guard's fallback keeps what it can ----

_FAILED_STATE = """
import warnings
warnings.simplefilter("always")
import jaxtorch.bridge.tensor._device as d
print(repr(d.CPP_GUARD))
"""


def test_a_failed_build_is_remembered_warned_in_one_line_and_retried_on_request(tmp_path):
    no_compiler = {"JAXTORCH_CACHE_DIR": str(tmp_path), "CXX": "/nonexistent/c++"}
    first = _python(_FAILED_STATE, **no_compiler)
    assert first.returncode == 0 and first.stdout.strip() == "''", first.stderr
    assert "could not build its C++ device guard (at this import" in first.stderr, first.stderr
    (failed,) = (tmp_path / "device_guard").glob("*/build-failed.txt")
    assert failed.read_text().count("\n") == 1  # the reason's first line, not the compiler's log
    again = _python(_FAILED_STATE, **no_compiler)
    assert again.stdout.strip() == "''" and not [line for line in _said(again.stderr) if "compiling" in line]
    warned = [line for line in again.stderr.splitlines() if "could not build" in line]
    assert len(warned) == 1 and "remembered from an earlier import" in warned[0], again.stderr
    assert "JAXTORCH_GUARD_RETRY=1" in warned[0]
    retry = _python(_FAILED_STATE, JAXTORCH_GUARD_RETRY="1", **no_compiler)
    assert [line for line in _said(retry.stderr) if "compiling its C++ device guard" in line], retry.stderr
    assert "(at this import" in retry.stderr


_RAISE_IN_FUNCTION_BACKWARD = """
import torch, jaxtorch

class Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        raise KeyError("raised in Function.backward")

x = torch.ones(3, device="jax", requires_grad=True)
try:
    Boom.apply(x).sum().backward()
except KeyError as e:
    print("caught:", e)
"""

_RAISE_IN_HOOK = """
import torch, jaxtorch

def hook(g):
    raise ZeroDivisionError("raised in a hook")

x = torch.ones(3, device="jax", requires_grad=True)
y = x * 3
y.register_hook(hook)
try:
    y.sum().backward()
except ZeroDivisionError as e:
    print("caught:", e)
"""


def test_the_python_guard_keeps_an_exception_raised_in_a_function_backward():
    out = _python(_RAISE_IN_FUNCTION_BACKWARD, JAXTORCH_PYTHON_GUARD="1")
    assert out.returncode == 0 and out.stdout.strip() == "caught: 'raised in Function.backward'", out.stderr


def test_the_python_guard_keeps_an_exception_raised_in_a_hook():
    out = _python(_RAISE_IN_HOOK, JAXTORCH_PYTHON_GUARD="1")
    assert out.returncode == 0 and out.stdout.strip() == "caught: raised in a hook", out.stderr


# An op of the backward pass raises (its type and message kept), under the modes or not, with
# `.backward()` and `torch.autograd.grad`; a later backward runs and raises nothing stale.
_KEEP_OP_ERRORS = """
import contextlib, traceback, torch, jaxtorch

class Odd(Exception):
    pass

fail = set()  # widths whose ReLU backward raises (read when JAX traces the op: a new width each time)

def threshold_backward(grad, x, threshold):
    if grad.shape[-1] in fail:
        raise Odd(f"odd: {tuple(grad.shape)}")
    return grad * (x > threshold)

jaxtorch.register_op(torch.ops.aten.threshold_backward.default, threshold_backward)
for width, env in ((4, contextlib.nullcontext), (5, jaxtorch.default_env)):
    with env():
        m = torch.nn.Sequential(torch.nn.Linear(3, width), torch.nn.ReLU(), torch.nn.Linear(width, 1)).to("jax")
        fail.add(width)
        for backward in ("backward", "grad"):
            loss = m(torch.ones(2, 3, device="jax")).sum()
            try:
                loss.backward() if backward == "backward" else torch.autograd.grad(loss, m[0].weight)
            except Odd as e:
                where = "".join(traceback.format_tb(e.__traceback__))
                print(backward, type(e).__name__, e, "threshold_backward" in where)
        fail.clear()
        m.zero_grad()
        m(torch.ones(2, 3, device="jax")).sum().backward()
        (g,) = torch.autograd.grad(m(torch.ones(2, 3, device="jax")).sum(), m[2].bias)
        print("then", m[2].bias.grad.tolist(), g.tolist())
"""


def test_the_python_guard_keeps_an_exception_raised_in_an_op_and_nothing_stale():
    out = _python(_KEEP_OP_ERRORS, JAXTORCH_PYTHON_GUARD="1")
    assert out.returncode == 0, out.stderr
    once = ["backward Odd odd: (2, {}) True", "grad Odd odd: (2, {}) True", "then [2.0] [2.0]"]
    assert out.stdout.splitlines() == [line.format(w) for w in (4, 5) for line in once], out.stderr


# A shape error raised by JAX inside an op of the backward (a hook hands back a wrong gradient), and a hook's
# exception after which the next backward on the same graph runs clean.
_KEEP_JAX_ERRORS = """
import torch, jaxtorch

x = torch.ones(3, device="jax", requires_grad=True)
w = torch.ones(3, 2, device="jax", requires_grad=True)
y = x * 2
y.register_hook(lambda g: torch.ones(5, device="jax"))  # torch takes it; the matmul's backward cannot
try:
    (y @ w).sum().backward()
except Exception as e:
    print(type(e).__name__)
calls = []
def hook(g):
    calls.append(1)
    if len(calls) == 1:
        raise IndexError("raised in a hook, once")
z = x * 3
z.register_hook(hook)
loss = z.sum()
try:
    loss.backward(retain_graph=True)
except IndexError as e:
    print("caught:", e)
x.grad = None
loss.backward()
print(x.grad.tolist())
"""


def test_the_python_guard_keeps_a_jax_error_and_runs_a_later_backward_clean():
    cpp = _python(_KEEP_JAX_ERRORS)
    python_guard = _python(_KEEP_JAX_ERRORS, JAXTORCH_PYTHON_GUARD="1")
    assert python_guard.returncode == 0 and python_guard.stdout == cpp.stdout, (python_guard.stderr, cpp.stderr)
    assert python_guard.stdout.splitlines()[1:] == ["caught: raised in a hook, once", "[3.0, 3.0, 3.0]"]


# A module's full backward hook and pre-hook raise during backward; the module trains on afterwards.
_RAISE_IN_MODULE_HOOKS = """
import torch, jaxtorch

m = torch.nn.Linear(3, 2).to("jax")
x = torch.ones(4, 3, device="jax", requires_grad=True)
for register, error in ((m.register_full_backward_hook, KeyError), (m.register_full_backward_pre_hook, OSError)):
    def hook(*args, error=error):
        raise error(f"raised in a {register.__name__}")
    handle = register(hook)
    try:
        m(x).sum().backward()
    except error as e:
        print("caught:", type(e).__name__, e)
    handle.remove()
m.zero_grad()
m(x).sum().backward()
print(m.bias.grad.tolist())
"""


def test_the_python_guard_keeps_an_exception_raised_in_a_module_backward_hook():
    expected = [
        "caught: KeyError 'raised in a register_full_backward_hook'",
        "caught: OSError raised in a register_full_backward_pre_hook",
        "[4.0, 4.0]",
    ]
    for env in ({}, {"JAXTORCH_PYTHON_GUARD": "1"}):
        out = _python(_RAISE_IN_MODULE_HOOKS, **env)
        assert out.returncode == 0 and out.stdout.splitlines() == expected, (env, out.stderr)


# Two threads run backward passes at once, each failing with its own exception.
_KEEP_PER_THREAD = """
import threading, torch, jaxtorch

def threshold_backward(grad, x, threshold):
    raise ValueError(f"width {grad.shape[-1]}")

jaxtorch.register_op(torch.ops.aten.threshold_backward.default, threshold_backward)
start = threading.Barrier(2)
wrong = []

def run(width):
    m = torch.nn.Sequential(torch.nn.Linear(3, width), torch.nn.ReLU(), torch.nn.Linear(width, 1)).to("jax")
    start.wait()
    for _ in range(20):
        try:
            m(torch.ones(2, 3, device="jax")).sum().backward()
            wrong.append("nothing raised")
        except ValueError as e:
            if str(e) != f"width {width}":
                wrong.append(str(e))

threads = [threading.Thread(target=run, args=(w,)) for w in (4, 5)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(wrong)
"""


def test_the_python_guard_keeps_each_threads_exception():
    out = _python(_KEEP_PER_THREAD, JAXTORCH_PYTHON_GUARD="1")
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_with_the_cpp_guard_function_backward_and_hook_exceptions_are_kept():
    out = _python(_RAISE_IN_FUNCTION_BACKWARD)
    assert out.stdout.strip() == "caught: 'raised in Function.backward'", out.stderr
    out = _python(_RAISE_IN_HOOK)
    assert out.stdout.strip() == "caught: raised in a hook", out.stderr
