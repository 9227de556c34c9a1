"""Moving modules across the jax device: the Parameter objects stay.

A CPU tensor and a `JaxTensor` have different TensorImpl types, so torch's `Module._apply`
would make new Parameter objects for a move across the jax device, and an optimizer (or
a hook) built before `model.to("jax")` would hold the old ones and silently do nothing.
torch's `swap_tensors` path (`torch.__future__.set_swap_module_params_on_conversion`)
exists for this: each Parameter object takes the moved tensor's content and keeps its
identity. jaxtorch turns it on for the duration of a move to or from the jax device only
(the flag is global: turned on for good it would change every move, CPU/CUDA included).

Module state like `_binding.py`'s, but moved for good rather than bound for one call: the
objects keep their identity, their contents change, nothing is restored but the tensor
hooks the swap carries off. `install_module_moves()` patches `Module.to`, `.cpu` and
`.to_empty`; this layer's `__init__` calls it.

Example:
    ```python
    install_module_moves()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.to("jax")          # the same Parameter objects, now JaxTensors: `opt` still updates them
    ```
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
from collections.abc import Iterator

import torch
from torch.nn.parameter import is_lazy

from ..._compat import parse_to, swap_tensor_impl
from ..core._errors import JaxtorchError
from ..tensor._device import DEVICE_TYPE, is_jax_device
from ..tensor._tensor import JaxTensor, own_root

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
    swap_tensor_impl(t1, t2)


def _holds_jax(module: torch.nn.Module) -> bool:
    """Whether a parameter or buffer of `module` is on the jax device (a move from it)."""
    return any(t.device.type == DEVICE_TYPE for t in itertools.chain(module.parameters(), module.buffers()))


def _refuse_uninitialized(module: torch.nn.Module) -> None:
    """A lazy module (`nn.LazyLinear`) moved before its first forward would get a 0-element
    weight and then fail with torch's unrelated shape assertion: say what to do instead."""
    for name, t in itertools.chain(module.named_parameters(), module.named_buffers()):
        if is_lazy(t):  # an UninitializedParameter / UninitializedBuffer
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
def _keeping_parameters(module: torch.nn.Module) -> Iterator[None]:
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
    if isinstance(p, JaxTensor):
        own_root(p, holders=0)


def install_module_moves() -> None:
    """Make `Module.to`, `.cpu` and `.to_empty` keep Parameter objects across the jax device
    (idempotent; `jaxtorch._install` calls it, so `import jaxtorch` does).

    Example: `install_module_moves(); opt = SGD(m.parameters()); m.to("jax")` (opt still works).
    """
    Module = torch.nn.Module
    if getattr(Module.to, "_jaxtorch", False):
        return
    torch_to, torch_cpu, torch_to_empty = Module.to, Module.cpu, Module.to_empty

    @functools.wraps(torch_to)
    def to(self, *args, **kwargs):
        device = parse_to(*args, **kwargs)[0]
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
        f._jaxtorch = True  # type: ignore[union-attr]
    Module.to, Module.cpu, Module.to_empty = to, cpu, to_empty  # type: ignore[method-assign]
