"""The `jax` device in torch: PrivateUse1 renamed to "jax", set up as a Python backend.

`torch.device("jax")` names it; `"jax:N"` places data on `jax.devices()[N]`. Tensors on it
report index 0 (torch's Python backend hook supports one device index for autograd); the
physical placement, or sharding, is the JAX array's own.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import sys
import sysconfig
import tempfile
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

import jax
import torch

from ..._compat import (
    current_autograd_node,
    current_graph_task_id,
    get_engine_run_backward,
    privateuse1_backend_name,
    set_engine_run_backward,
    setup_privateuse1_python_backend,
    torch_version,
)
from ._device_module import DEVICE_MODULE

DEVICE_TYPE = "jax"


_GUARD_NAME = "jaxtorch_device_guard"
_GUARD_SOURCE = Path(__file__).parent.parent / "_device_guard.cpp"


def guard_cache_dir() -> Path:
    """Where the compiled C++ device guard is kept: one folder per torch version, Python and guard source.

    `$JAXTORCH_CACHE_DIR`, else `$XDG_CACHE_HOME/jaxtorch`, else `~/.cache/jaxtorch`, then
    `device_guard/torch-<version>-<python>-<hash>` (the hash covers the source, torch's version, Python
    and the platform), so a new torch or a changed source compiles afresh and never loads a stale build.

    **Example:**
        ```python
        guard_cache_dir()  # ~/.cache/jaxtorch/device_guard/torch-2.13.0+cpu-cpython-311-1a2b3c4d5e6f7a8b
        ```
    """
    root = os.environ.get("JAXTORCH_CACHE_DIR") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "jaxtorch"
    )
    key = hashlib.sha256(_GUARD_SOURCE.read_bytes())
    key.update(f"{torch_version()} {sys.implementation.cache_tag} {sysconfig.get_platform()}".encode())
    tag = f"torch-{torch_version()}-{sys.implementation.cache_tag}-{key.hexdigest()[:16]}"
    return Path(root, "device_guard", tag)


def _import_guard(path: Path):
    """The guard module compiled at `path`, checked to be the one built for this torch."""
    spec = importlib.util.spec_from_file_location(_GUARD_NAME, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if module.TORCH_VERSION != torch_version():
        raise ImportError(f"{path} was built for torch {module.TORCH_VERSION}, not {torch_version()}")
    return module


@contextlib.contextmanager
def _exclusive(lock: Path):
    """Hold an exclusive lock on the file `lock` (released if the process dies), where `fcntl` exists."""
    try:
        import fcntl
    except ImportError:  # Windows: no lock; a concurrent compile there only repeats the work
        yield
        return
    with open(lock, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _compile_guard(directory: Path, target: Path):
    """Compile the guard into `target` with torch's cpp_extension, one process at a time, saying so once.

    Another process compiling into the same cache (pytest-xdist workers) waits on the lock and then
    loads its result. The build runs in a private folder and the library is moved into place
    atomically, so an interrupted build leaves nothing half-written to load.
    """
    from torch.utils.cpp_extension import load

    directory.mkdir(parents=True, exist_ok=True)
    with _exclusive(directory / "lock"):
        if target.exists():  # compiled by another process while this one waited
            return _import_guard(target), "cached"
        # measured: 12-13 s on 2 cores shared with many busy processes (load ~16); less on a quiet machine
        print(
            f"jaxtorch: compiling its C++ device guard once for torch {torch_version()} (at most about 15 s; "
            f"cached in {directory})",
            file=sys.stderr,
            flush=True,
        )
        build = Path(tempfile.mkdtemp(prefix="build-", dir=directory))
        try:
            load(
                _GUARD_NAME,
                [str(_GUARD_SOURCE)],
                build_directory=str(build),
                extra_cflags=[f"-DJAXTORCH_TORCH_VERSION={torch_version()}"],
            )
            built = next(build.glob(f"{_GUARD_NAME}*.so"), None) or next(build.glob(f"{_GUARD_NAME}*.pyd"))
            os.replace(built, target)
        finally:
            shutil.rmtree(build, ignore_errors=True)
        return _import_guard(target), "compiled"


_FAILED = "build-failed.txt"  # in guard_cache_dir(): why the last build failed (its first line)


def _short(e: BaseException) -> str:
    """`Type: first line` of `e`: a compiler's log is many lines, and a warning on every import says one."""
    first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
    return f"{type(e).__name__}: {first[:200]}"


def _load_cpp_guard() -> str:
    """Register the C++ device guard; returns `"cached"`, `"compiled"` (at this import) or `""` (none).

    The guard is compiled on first import into `guard_cache_dir()` (printing one line) and loaded from
    there afterwards. Without a C++ compiler (or ninja, which torch's cpp_extension uses) the build fails:
    the failure is remembered in the cache (`build-failed.txt`), so later imports warn in one line without
    compiling again; `JAXTORCH_GUARD_RETRY=1` tries again (after installing a compiler or ninja).
    torch's Python guard stays in that case (see `_keep_backward_errors`). `JAXTORCH_PYTHON_GUARD=1`
    keeps torch's Python guard without trying.

    **Example:**
        ```bash
        pip install ninja && JAXTORCH_GUARD_RETRY=1 python -c "import jaxtorch"   # build it now
        ```
    """
    if os.environ.get("JAXTORCH_PYTHON_GUARD"):
        return ""
    directory = target = None
    try:
        directory = guard_cache_dir()
        target = directory / f"{_GUARD_NAME}{importlib.machinery.EXTENSION_SUFFIXES[0]}"
        failed = directory / _FAILED
        if not target.exists() and failed.exists() and not os.environ.get("JAXTORCH_GUARD_RETRY"):
            _warn_no_guard(failed.read_text().strip(), remembered=True)
            return ""
        module, how = (_import_guard(target), "cached") if target.exists() else _compile_guard(directory, target)
        module.register_guard()
        failed.unlink(missing_ok=True)
        return how
    except Exception as e:  # (no compiler, no ninja, a read-only cache: the Python guard stays)
        reason = _short(e)
        if directory is not None:
            with contextlib.suppress(OSError):
                directory.mkdir(parents=True, exist_ok=True)
                (directory / _FAILED).write_text(reason + "\n")
        _warn_no_guard(reason, remembered=False)
        return ""


def _warn_no_guard(reason: str, *, remembered: bool) -> None:
    """One short warning: the reason's first line, never a compiler's log."""
    when = "remembered from an earlier import" if remembered else "at this import"
    warnings.warn(
        f"jaxtorch could not build its C++ device guard ({when}: {reason}); torch's Python guard is used, which "
        "calls into Python at every device switch (jaxtorch keeps an exception an op or a tensor or module hook "
        "raises inside loss.backward(), others are lost). Install a C++ compiler and "
        "ninja (`pip install ninja`), then set JAXTORCH_GUARD_RETRY=1 once to build it; JAXTORCH_PYTHON_GUARD=1 "
        "silences this.",
        stacklevel=3,
    )


_LOST = "returned NULL without setting an exception"

# With torch's Python device guard, an exception that leaves Python for torch's C++ while its autograd
# engine runs a backward is lost (or aborts the process, for a tensor hook): the guard calls back into
# Python as C++ unwinds. So jaxtorch's entry points the engine calls (`engine_entry`, `keep_hook_errors`)
# keep it here instead, by graph task, with the autograd node that ran, and hand C++ a harmless failure
# (`_KEPT`, which C++ cannot cast) or, for a hook, the gradient unchanged; `engine_run_backward` raises
# the kept exception, its type, message and traceback, once the engine returns.
_kept: dict[int, tuple[BaseException, object]] = {}  # graph task id -> (first exception, its autograd node)
_kept_lock = threading.Lock()
_in_flight = [0]  # backward passes running (all threads)


class _Kept:
    def __repr__(self) -> str:
        return "<jaxtorch: an exception raised in backward, raised again when backward() returns>"


_KEPT = _Kept()  # what an op the engine called returns in place of raising: C++ fails without Python


def _keep(e: BaseException) -> bool:
    """Keep `e` for the backward pass running on this thread; False (keep nothing) outside one."""
    task = current_graph_task_id()
    if task < 0:
        return False
    with _kept_lock:
        _kept.setdefault(task, (e, current_autograd_node()))
    return True


def _failed_here() -> bool:
    """Whether the backward pass running on this thread has already kept an exception."""
    return bool(_kept) and current_graph_task_id() in _kept


def engine_entry(fn: Callable, depth: int = 0) -> Callable:
    """`fn` (an entry point torch's C++ calls: `__torch_dispatch__`), keeping an exception raised while the
    autograd engine called it, when torch's Python guard is used; `fn` itself with the C++ guard.

    `depth` is the number of Python frames between torch's C++ and the returned function (1 when a
    `__torch_dispatch__` calls it): only a call straight from the engine keeps (a `Function.backward` or
    a hook calling ops gets their exceptions, as usual).
    """
    if CPP_GUARD:
        return fn

    @functools.wraps(fn)
    def entry(*args, **kwargs):
        if _kept and _failed_here() and sys._getframe(depth).f_back is None:
            return _KEPT  # the pass already failed (in a hook): stop it at its next op
        try:
            return fn(*args, **kwargs)
        except BaseException as e:
            if sys._getframe(depth).f_back is None and _keep(e):
                return _KEPT
            raise

    return entry


def keep_hook_errors(hook: Callable) -> Callable:
    """`hook` (a tensor hook torch's engine calls) keeping its exception for `engine_run_backward`,
    with torch's Python guard (the process aborts otherwise); `hook` itself with the C++ guard."""
    if CPP_GUARD:
        return hook

    @functools.wraps(hook)
    def kept(*args, **kwargs):
        if _kept and _failed_here():
            return None  # the pass already failed: later hooks do not run
        try:
            return hook(*args, **kwargs)
        except BaseException as e:
            if _keep(e):
                return None  # the gradient unchanged; the pass stops at its next op
            raise

    return kept


def _reaches(roots, node) -> bool:
    """Whether the autograd `node` is in the graph of `roots` (tensors)."""
    todo: list = [t.grad_fn for t in roots if isinstance(t, torch.Tensor)]
    seen: set[int] = set()
    while todo:
        n = todo.pop()
        if n is None or id(n) in seen:
            continue
        if n is node:
            return True
        seen.add(id(n))
        todo.extend(next_fn for next_fn, _ in n.next_functions)
    return False


def _claim(roots) -> BaseException | None:
    """The exception kept by this backward pass (whose graph holds `roots`), taken out of `_kept`."""
    with _kept_lock:
        alone = _in_flight[0] == 1
        for task, (e, node) in list(_kept.items()):
            if alone or node is None or _reaches(roots, node):
                del _kept[task]
                if alone:
                    _kept.clear()
                return e
    return None


def _keep_backward_errors() -> None:
    """With torch's Python guard, an exception raised in an op or a tensor hook of the backward pass is
    kept by jaxtorch's entry points (`engine_entry`, `keep_hook_errors`) and raised here, as it was,
    once torch's engine returns. An exception lost anyway (CPython's bare `SystemError: ... returned NULL
    without setting an exception`) becomes an error naming the way out."""
    run = get_engine_run_backward()
    if getattr(run, "_jaxtorch_wrapped", False):
        return

    def engine_run_backward(t_outputs, *args, **kwargs):
        with _kept_lock:
            _in_flight[0] += 1
        kept = None
        try:
            try:
                out = run(t_outputs, *args, **kwargs)
            except BaseException as e:
                kept = _claim(t_outputs) if _kept else None
                if kept is None:
                    if isinstance(e, SystemError) and _LOST in str(e):
                        raise RuntimeError(_LOST_MESSAGE) from e
                    raise
            else:
                kept = _claim(t_outputs) if _kept else None
                if kept is None:
                    return out
        finally:
            with _kept_lock:
                _in_flight[0] -= 1
                if not _in_flight[0]:
                    _kept.clear()  # nothing kept outlives the passes that were running
        raise kept  # the user's exception, with its traceback (outside `except`: no context added)

    engine_run_backward._jaxtorch_wrapped = True  # type: ignore[attr-defined]
    set_engine_run_backward(engine_run_backward)


_LOST_MESSAGE = (
    "an exception was raised inside backward() on the jax device, and torch's Python device guard "
    "lost it (jaxtorch's C++ device guard is not built in this environment). Install a C++ compiler "
    "and ninja (`pip install ninja`) and run once with JAXTORCH_GUARD_RETRY=1 to build it; then the "
    "original exception is raised."
)


# Where the C++ device guard came from: "cached" (compiled by an earlier import), "compiled" (by this
# import), or "" (none: torch's Python guard is used).
CPP_GUARD: str = ""


_ONE_ACCELERATOR = (
    "jaxtorch made 'jax' torch's current accelerator (torch.accelerator.current_accelerator() is "
    "whichever backend renamed PrivateUse1, and torch supports one per process). In this process, "
    "torch autograd on CUDA tensors fails with an internal assert ('opt_ready_stream && "
    "opt_parent_stream'): run PyTorch-on-CUDA training in a separate process, or run the model on "
    "the GPU through JAX (`model.to('jax')`, `jaxtorch.extract`), which is what jaxtorch is for."
)


def install() -> None:
    """Make torch's PrivateUse1 backend the `jax` device (idempotent; `jaxtorch._install` calls it).

    Renames PrivateUse1 to "jax", registers `torch.jax` (the device module torch asks by name),
    and loads the C++ device guard (compiling it the first time) or, without one, keeps the
    exceptions torch's Python guard loses in backward.

    **Example:** `install(); torch.zeros(2, device="jax")`.
    """
    global CPP_GUARD
    if privateuse1_backend_name() != DEVICE_TYPE:
        torch.utils.rename_privateuse1_backend(DEVICE_TYPE)
        CPP_GUARD = _load_cpp_guard()
        if not CPP_GUARD:
            _keep_backward_errors()
        setup_privateuse1_python_backend(DEVICE_TYPE, backend_module=DEVICE_MODULE)
        if torch.cuda.is_available():
            warnings.warn(_ONE_ACCELERATOR, stacklevel=4)


# PrivateUse1's first device: it reads "jax:0" once `install` has renamed the backend
JAX_DEVICE: torch.device = torch.device("privateuseone", 0)


def is_jax_device(device) -> bool:
    """Whether `device` (a `torch.device`, string or None) names the jax device."""
    if device is None:
        return False
    if isinstance(device, torch.device):
        return device.type == DEVICE_TYPE
    if isinstance(device, str):
        return device.split(":")[0] == DEVICE_TYPE
    return False


def jax_device_of(device) -> jax.Device | None:
    """The `jax.Device` that `"jax:N"` names, or None for JAX's default placement: a bare
    `"jax"`, and `"jax:0"`, the name torch gives it (torch fills in index 0). Arrays placed
    by None stay uncommitted, as `jnp`'s do; an explicit `"jax:N"`, N > 0, commits them."""
    device = torch.device(device)
    if not device.index:
        return None
    return jax.devices()[device.index]
