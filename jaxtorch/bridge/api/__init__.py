"""Layer 5 of the bridge: the entry points users call.

The JAX-first API (`extract`, `call_torch`, `torch_module_to_jax`), the torch-first
compiler (`jaxtorch.compile`/`jit`), `export` and `JaxModule`; re-exported by `jaxtorch`.
"""
