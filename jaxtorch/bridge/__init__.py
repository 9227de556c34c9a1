"""The bridge between torch values and JAX values, in layers that only look down.

- `core`: arrays and how they run (errors, dtypes, rng, pytrees, the eager and lazy executors);
- (`jaxtorch.ops`: the ATen-to-JAX lowerings, built on `core` only, imported by no `bridge` module);
- `tensor`: `JaxTensor`, the `jax` device, conversions, autograd glue;
- `dispatch`: routing, the interpreter, foreach, the torch modes;
- `state`: module state (bind by identity, restore; holders, layouts, scopes, mesh axes);
- `api`: the entry points (`extract`, `call_torch`, `compile`, `export`, `JaxModule`).

Every module here is private (`_name.py`); the public names are re-exported by `jaxtorch`.
See `docs/architecture.md`.
"""
