"""Layer 3 of the bridge: dispatch.

How an ATen op on the `jax` device reaches its JAX lowering: the routing, the interpreter
that builds one runner per op, the foreach ops, and the torch modes that turn it all on.
"""
