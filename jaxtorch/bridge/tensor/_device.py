"""The `jax` device in torch: PrivateUse1 renamed to "jax", set up as a Python backend.

`torch.device("jax")` names it; `"jax:N"` places data on `jax.devices()[N]`. Tensors on it
report index 0 (torch's Python backend hook supports one device index for autograd); the
physical placement, or sharding, is the JAX array's own.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import sys
import threading
import warnings
from pathlib import Path

import jax
import torch
import torch.utils.backend_registration as _br

DEVICE_TYPE = "jax"


class _JaxDeviceModule:
    """What torch expects of `torch.jax` (a registered device module)."""

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def is_initialized() -> bool:
        return True

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def device_count() -> int:
        return jax.device_count()

    @staticmethod
    def _is_in_bad_fork() -> bool:
        return False

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        """Called by `torch.manual_seed`: reseeds jaxtorch's eager random generator."""
        from ..core import _random

        _random.manual_seed(seed)

    manual_seed = manual_seed_all

    @staticmethod
    def get_rng_state(device=None) -> torch.Tensor:
        """The eager generator's state as a uint8 tensor (for `torch.random.fork_rng`)."""
        from ..core import _random

        return _random.get_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, device=None) -> None:
        from ..core import _random

        _random.set_state(state)


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
        print(f"jaxtorch: compiling its C++ device guard once (at most about 15 s; cached in "
              f"{built.parent}); `pip install -e .` builds it at install time instead", file=sys.stderr, flush=True)
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
            "inside loss.backward() on the jax device will abort the process. Install a C++ compiler to fix this."
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
        _br._setup_privateuseone_for_python_backend(DEVICE_TYPE, backend_module=_JaxDeviceModule())
        if torch.cuda.is_available():
            warnings.warn(_ONE_ACCELERATOR, stacklevel=3)
    return torch.device(DEVICE_TYPE, 0)


JAX_DEVICE: torch.device = _setup()


# ---- moving modules: the Parameter objects stay -------------------------------------------
# A CPU tensor and a `JaxTensor` have different TensorImpl types, so torch's `Module._apply`
# would make new Parameter objects for a move across the jax device, and an optimizer (or
# a hook) built before `model.to("jax")` would hold the old ones and silently do nothing.
# torch's `swap_tensors` path (`torch.__future__.set_swap_module_params_on_conversion`)
# exists for this: each Parameter object takes the moved tensor's content and keeps its
# identity. jaxtorch turns it on for the duration of a move to or from the jax device only
# (the flag is global: turned on for good it would change every move, CPU/CUDA included).


_torch_swap_tensors = torch.utils.swap_tensors


def _stale_graph(grad_outputs):
    raise RuntimeError(
        "jaxtorch: backward() through an autograd graph built before the module moved across the jax device: "
        "that graph holds the parameters from before the move. Run the forward again after the move."
    )


def _swap_tensors(t1: torch.Tensor, t2: torch.Tensor) -> None:
    """`torch.utils.swap_tensors`, also when an autograd graph saved `t1` (a forward ran before
    the move, as in "compute a reference on the CPU, then move"): the graph keeps the tensor
    from before the move, and a backward through it raises instead of losing the gradient."""
    try:
        return _torch_swap_tensors(t1, t2)
    except RuntimeError as e:
        if "use_count" not in str(e):
            raise
    if t1.requires_grad and t1.is_leaf:
        torch.autograd.graph.get_gradient_edge(t1).node.register_prehook(_stale_graph)
    for name in ("__class__", "__dict__"):  # neither class has slots (torch checked, before use_count)
        a, b = getattr(t1, name), getattr(t2, name)
        setattr(t1, name, b)
        setattr(t2, name, a)
    torch._C._swap_tensor_impl(t1, t2)


def _holds_jax(module: torch.nn.Module) -> bool:
    return any(t.device.type == DEVICE_TYPE for t in itertools.chain(module.parameters(), module.buffers()))


def _refuse_uninitialized(module: torch.nn.Module) -> None:
    """A lazy module (`nn.LazyLinear`) moved before its first forward would get a 0-element
    weight and then fail with torch's unrelated shape assertion: say what to do instead."""
    from torch.nn.parameter import UninitializedTensorMixin

    for name, t in itertools.chain(module.named_parameters(), module.named_buffers()):
        if isinstance(t, UninitializedTensorMixin):
            from ..core._errors import JaxtorchError

            raise JaxtorchError(
                f"jaxtorch cannot move `{name}` to or from the jax device: it is an uninitialized parameter of a "
                "lazy module (nn.LazyLinear, nn.LazyConv2d, ...), whose shape is known only after a first forward. "
                "Run one forward on the CPU first (e.g. with a sample batch), then move the module; or give the "
                "layer its input size (nn.Linear(in_features, out_features))."
            )


# The swap flag is process-wide: moves across the jax device take turns, so one thread's move
# never ends with the flag another thread's move needs turned off.
_MOVE_LOCK = threading.RLock()


@contextlib.contextmanager
def _keeping_parameters(module: torch.nn.Module):
    """Run a move with torch's swap path on; re-attach the tensor hooks the swap leaves behind."""
    _refuse_uninitialized(module)
    with _MOVE_LOCK:
        hooks = [(p, p._backward_hooks, p._post_accumulate_grad_hooks) for p in module.parameters()]
        old = torch.__future__.get_swap_module_params_on_conversion()
        torch.__future__.set_swap_module_params_on_conversion(True)
        torch.utils.swap_tensors = _swap_tensors
        try:
            yield
        except RuntimeError as e:
            if "Couldn't swap" not in str(e):
                raise
            from ..core._errors import JaxtorchError

            raise JaxtorchError(
                f"jaxtorch moves a module across the jax device keeping its Parameter objects (so optimizers and "
                f"hooks built before the move keep working), and torch could not swap one ({e}; cause: "
                f"{e.__cause__}). This happens when something holds a weak reference to a parameter "
                "(torch.compile, a weakref cache): move the module before that."
            ) from e
        finally:
            torch.__future__.set_swap_module_params_on_conversion(old)
            torch.utils.swap_tensors = _torch_swap_tensors
            for p, backward, post in hooks:  # the swap moved their C++ registration to the old tensor
                if backward is not None:
                    p._backward_hooks = backward
                if post is not None:
                    p._post_accumulate_grad_hooks = post
    for p in module.parameters():
        _own_root(p)


def _own_root(p: torch.Tensor) -> None:
    """Make a moved Parameter the root of its data.

    `Parameter(t)` detaches `t`, which on the jax device is an identity view of the moved tensor;
    nothing but the Parameter holds that tensor, so the Parameter takes its array and the chain is
    dropped (otherwise every array the Parameter holds has a second holder, which keeps lazy mode
    from donating it on the first step).
    """
    from ._tensor import JaxTensor, own_root

    if isinstance(p, JaxTensor):
        own_root(p, holders=0)


def _patch_module_moves() -> None:
    """`Module.to`, `.cpu` and `.to_empty` keep Parameter objects across the jax device."""
    Module = torch.nn.Module
    if getattr(Module.to, "_jaxtorch", False):
        return
    torch_to, torch_cpu, torch_to_empty = Module.to, Module.cpu, Module.to_empty

    @functools.wraps(torch_to)
    def to(self, *args, **kwargs):
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
        if device is not None and (device.type == DEVICE_TYPE or _holds_jax(self)):
            with _keeping_parameters(self):
                return torch_to(self, *args, **kwargs)
        return torch_to(self, *args, **kwargs)

    @functools.wraps(torch_cpu)
    def cpu(self):
        if _holds_jax(self):
            with _keeping_parameters(self):
                return torch_cpu(self)
        return torch_cpu(self)

    @functools.wraps(torch_to_empty)
    def to_empty(self, *, device, recurse=True):
        if is_jax_device(device) or _holds_jax(self):
            with _keeping_parameters(self):
                return torch_to_empty(self, device=device, recurse=recurse)
        return torch_to_empty(self, device=device, recurse=recurse)

    for f in (to, cpu, to_empty):
        f._jaxtorch = True
    Module.to, Module.cpu, Module.to_empty = to, cpu, to_empty


_patch_module_moves()


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
