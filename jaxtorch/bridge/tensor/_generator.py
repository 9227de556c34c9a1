"""`torch.Generator(device="jax")`: seeded generators for random ops on the jax device.

torch builds a generator for a PrivateUse1 device through C++ hooks that a Python backend
cannot register, so `torch.Generator(device="jax")` raised `NotImplementedError`. jaxtorch
puts a thin `torch.Generator` in its place: `torch.Generator(device="jax")` gives a
`JaxGenerator`, and any other device gives torch's own generator, unchanged
(`isinstance(g, torch.Generator)` holds for both, as before).

A `JaxGenerator` is a torch generator whose stream is the CPU generator's (so `manual_seed`,
`seed`, `initial_seed`, `get_state`/`set_state`, `clone_state` and pickling are torch's own)
and whose `device` is `jax`. A random op on the jax device given `generator=g` draws its JAX
key from `g` (one number from `g`'s stream, see `core._random.key_from_generator`): the same
seed gives the same draws, generators are independent of each other and of the default
generator (`torch.manual_seed`), which a draw from `g` leaves unchanged. A CPU generator given
to a jax-device op is used the same way (its own stream), so `torch.Generator().manual_seed(0)`
seeds jax draws reproducibly too. The draws differ from CPU torch's numbers (JAX's PRNG).

Example:
    ```python
    g = torch.Generator(device="jax").manual_seed(1)
    a = torch.randn(3, generator=g, device="jax")
    g.manual_seed(1)
    b = torch.randn(3, generator=g, device="jax")   # equal to a
    ```
"""

from __future__ import annotations

from typing import Any

import torch

from ..._compat import TorchGenerator
from ._device import JAX_DEVICE, is_jax_device

_TorchGenerator = TorchGenerator  # torch's own class (what `torch.Generator` was)


class JaxGenerator(_TorchGenerator):
    """A torch generator for the jax device (its stream is held by a CPU generator)."""

    @staticmethod
    def __new__(cls, device: Any = None) -> JaxGenerator:
        return _TorchGenerator.__new__(cls, "cpu")  # type: ignore[call-arg]  # (the stub has no `__new__`)

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        """`jax:0`: ops on the jax device take it."""
        return JAX_DEVICE

    def clone_state(self) -> JaxGenerator:
        """A new jax generator in this one's state (torch's gives one of the same device)."""
        return _new_jax_generator(self.get_state())

    def __reduce__(self):
        return (_new_jax_generator, (self.get_state(),))

    def __repr__(self) -> str:
        return f"<torch.Generator device='jax' initial_seed={self.initial_seed()}>"


def _new_jax_generator(state: torch.Tensor) -> JaxGenerator:
    g = JaxGenerator()
    g.set_state(state)
    return g


_GeneratorMeta: type = type(_TorchGenerator)  # (torch's generator class has its own metaclass)


class _GeneratorType(_GeneratorMeta):
    """`isinstance(g, torch.Generator)` for every torch generator, as before the replacement."""

    def __instancecheck__(cls, obj) -> bool:
        if cls is Generator:
            return isinstance(obj, _TorchGenerator)
        return type.__instancecheck__(cls, obj)  # (a user's subclass: its own instances only)

    def __subclasscheck__(cls, sub) -> bool:
        if cls is Generator:
            return issubclass(sub, _TorchGenerator)
        return type.__subclasscheck__(cls, sub)


class Generator(_TorchGenerator, metaclass=_GeneratorType):
    """`torch.Generator(device=...)`: a `JaxGenerator` for the jax device, torch's own otherwise."""

    @staticmethod
    def __new__(cls, device: Any = None) -> Any:  # (torch's own class for the other devices, not this one)
        if cls is not Generator:  # `class MyGen(torch.Generator)`: an instance of it, as before
            return _TorchGenerator.__new__(cls, "cpu" if is_jax_device(device) else (device or "cpu"))  # type: ignore[call-arg]
        if is_jax_device(device):
            return JaxGenerator()
        return _TorchGenerator() if device is None else _TorchGenerator(device)


Generator.__module__ = "torch"
Generator.__qualname__ = Generator.__name__ = "Generator"
Generator.__doc__ = _TorchGenerator.__doc__


def install() -> None:
    """Make `torch.Generator(device="jax")` work (idempotent).

    Example: `install(); g = torch.Generator(device="jax").manual_seed(0)`.
    """
    if torch.Generator is _TorchGenerator:
        torch.Generator = Generator  # type: ignore[misc]
