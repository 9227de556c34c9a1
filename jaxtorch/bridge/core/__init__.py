"""Layer 0 of the bridge: arrays and how they run (no torch tensor subclass here).

Errors, dtype mapping, PRNG keys, matmul precision, the pytree registry, JAX-trace
adoption by torch's autograd threads, and the two executors (eager: cached `jax.jit` per
op; lazy: a recorded graph run at `mark_step`), and the lowerings' registry (`_registry`).
`jaxtorch.ops` builds on this layer only, and no `bridge` module imports it.
"""
