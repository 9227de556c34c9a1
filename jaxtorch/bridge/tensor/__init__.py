"""Layer 2 of the bridge: the tensor and the device.

`JaxTensor` (a torch wrapper subclass holding a `jax.Array`, tracer or pending value), the
`jax` device registration, every conversion between torch and JAX values, and the
autograd glue (`call_jax`).
"""

from . import _generator  # noqa: F401  (makes `torch.Generator(device="jax")` work)
