"""The `jax` device in torch: PrivateUse1 renamed to "jax", set up as a Python backend.

`torch.device("jax")` names it; `"jax:N"` places data on `jax.devices()[N]`. Tensors on it
report index 0 (torch's Python backend hook supports one device index for autograd); the
physical placement, or sharding, is the JAX array's own.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import jax
import torch
import torch.utils.backend_registration as _br

from ._device_module import DEVICE_MODULE

DEVICE_TYPE = "jax"


_JIT_NAME = "jaxtorch_device_guard_c10"


def _prebuilt_guard():
    """The guard module built at install time (setup.py), or None if missing or built for another torch."""
    try:
        from .. import _device_guard
    except ImportError:  # not built (a source checkout without `pip install -e .`), or it does not link
        return None
    return _device_guard if _device_guard.TORCH_VERSION == torch.__version__ else None


def _build_guard_now():
    """Compile the guard with torch's cpp_extension (cached in its build directory), saying so first."""
    from torch.utils.cpp_extension import _get_build_directory, load

    src = Path(__file__).parent.parent / "_device_guard.cpp"
    built = Path(_get_build_directory(_JIT_NAME, False)) / f"{_JIT_NAME}.so"
    if not built.exists() or built.stat().st_mtime < src.stat().st_mtime:
        # measured: 12-13 s on 2 cores shared with many busy processes (load ~16); less on a quiet machine
        print(
            f"jaxtorch: compiling its C++ device guard once (at most about 15 s; cached in "
            f"{built.parent}); `pip install -e .` builds it at install time instead",
            file=sys.stderr,
            flush=True,
        )
    return load(_JIT_NAME, [str(src)], extra_cflags=[f"-DJAXTORCH_TORCH_VERSION={torch.__version__}"])


def _load_cpp_guard() -> str:
    """Register the C++ device guard; returns where it came from: `"prebuilt"`, `"built at import"` or `""`.

    The install (`pip install -r requirements.txt`, setup.py) builds it as `jaxtorch.bridge._device_guard`;
    a checkout without that module, or one built for another torch version, compiles it here once.
    `JAXTORCH_PYTHON_GUARD=1` keeps torch's Python guard.
    """
    if os.environ.get("JAXTORCH_PYTHON_GUARD"):
        return ""
    module = _prebuilt_guard()
    if module is not None:
        module.register_guard()
        return "prebuilt"
    try:
        _build_guard_now().register_guard()
        return "built at import"
    except Exception as e:  # no compiler: the Python guard still works, errors in backward abort
        warnings.warn(
            f"jaxtorch could not build its C++ device guard ({type(e).__name__}: {e}); an exception raised "
            "inside loss.backward() on the jax device will abort the process. Install a C++ compiler to fix this.",
            stacklevel=2,
        )
        return ""


# Where the C++ device guard came from: "prebuilt" (the install built it), "built at import", or "" (none:
# torch's Python guard is used).
CPP_GUARD: str = ""


_ONE_ACCELERATOR = (
    "jaxtorch made 'jax' torch's current accelerator (torch.accelerator.current_accelerator() is "
    "whichever backend renamed PrivateUse1, and torch supports one per process). In this process, "
    "torch autograd on CUDA tensors fails with an internal assert ('opt_ready_stream && "
    "opt_parent_stream'): run PyTorch-on-CUDA training in a separate process, or run the model on "
    "the GPU through JAX (`model.to('jax')`, `jaxtorch.extract`), which is what jaxtorch is for."
)


def _setup() -> torch.device:
    global CPP_GUARD
    if torch._C._get_privateuse1_backend_name() != DEVICE_TYPE:
        torch.utils.rename_privateuse1_backend(DEVICE_TYPE)
        CPP_GUARD = _load_cpp_guard()
        _br._setup_privateuseone_for_python_backend(DEVICE_TYPE, backend_module=DEVICE_MODULE)
        if torch.cuda.is_available():
            warnings.warn(_ONE_ACCELERATOR, stacklevel=3)
    return torch.device(DEVICE_TYPE, 0)


JAX_DEVICE: torch.device = _setup()


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
