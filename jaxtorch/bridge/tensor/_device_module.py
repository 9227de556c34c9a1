"""`torch.jax`: the device module torch looks up for the `jax` device (`torch._register_device_module`).

torch's Python layers ask it questions by name: `torch.autocast("jax")` calls
`get_amp_supported_dtype`, `torch.utils.checkpoint` and `torch.random.fork_rng(device_type="jax")`
call `device`, `get_rng_state`, `set_rng_state`, `torch.manual_seed` calls `manual_seed_all`.
It is registered once, when `_device` renames PrivateUse1 to "jax".

RNG functions live in the section marked "random number generation" below: add new ones
(`initial_seed`, `seed`, `default_generators`, ...) there.

Example:
    ```python
    torch.jax.get_amp_supported_dtype()      # [torch.bfloat16, torch.float16]
    with torch.autocast("jax", dtype=torch.bfloat16):
        y = model(x)
    ```
"""

from __future__ import annotations

import contextlib

import jax
import torch


class JaxDeviceModule:
    """What torch expects of `torch.jax` (a registered device module)."""

    # ---- availability and devices ------------------------------------------------------
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
    def device(index=None) -> contextlib.AbstractContextManager:
        """`with torch.jax.device(i):` (torch's checkpoint and fork_rng enter it): tensors on
        the jax device report index 0 and JAX places arrays itself, so it changes nothing."""
        return contextlib.nullcontext()

    @staticmethod
    def synchronize(device=None) -> None:
        """Wait for every dispatched JAX computation (`torch.jax.synchronize()`)."""
        jax.effects_barrier()

    # ---- automatic mixed precision (`torch.autocast("jax", dtype=...)`) -------------------
    @staticmethod
    def get_amp_supported_dtype() -> list[torch.dtype]:
        """The lower-precision dtypes `torch.autocast("jax", dtype=...)` accepts (see `_autocast`)."""
        return [torch.bfloat16, torch.float16]

    # ---- random number generation -------------------------------------------------------
    # (jaxtorch's eager generator, `core._random`; generator objects and new RNG functions go here)
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
        """Restore a state from `get_rng_state`; anything else raises, as torch's CPU generator does."""
        from ..core import _random

        size = _random.get_state().numel()
        if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8 or state.numel() != size:
            got = f"{state.dtype} tensor of {state.numel()} elements" if isinstance(state, torch.Tensor) else state
            raise RuntimeError(
                f"torch.jax.set_rng_state: expected the uint8 tensor of {size} bytes that "
                f"`torch.jax.get_rng_state()` gives, got {got!s:.80} (a state of another device or generator?)"
            )
        _random.set_state(state)


DEVICE_MODULE = JaxDeviceModule()
