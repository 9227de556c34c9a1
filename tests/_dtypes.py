"""dtype tables and JAX's 64-bit switch, shared by the dtype tests.

Example:
    ```python
    @pytest.mark.parametrize("dtype", ARITH, ids=str)
    def test_add(dtype): ...

    with enable_x64():
        assert jnp.ones(1, jnp.float64).dtype == jnp.float64
    ```
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax
import torch

# the dtypes CPU torch's arithmetic supports (uint16/32/64 have few CPU kernels)
ARITH = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
]
# every dtype torch supports on the CPU that JAX holds without 64-bit mode
DTYPES = [*ARITH, torch.complex64, torch.uint16, torch.uint32, torch.uint64]
WIDE = [torch.float64, torch.complex128]  # need 64-bit mode


@contextlib.contextmanager
def enable_x64() -> Iterator[None]:
    """JAX's 64-bit mode on (`jax_enable_x64`, process-wide) inside the block, off after it."""
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", False)
