"""Layer 3 of the bridge: dispatch.

How an ATen op on the `jax` device reaches its JAX lowering: the routing, the interpreter
that builds one runner per op, the foreach ops, and the torch modes that turn it all on.

`import jaxtorch` registers the "jax" torch.distributed backend (`_collectives.install_jax_backend`,
called by `jaxtorch._install`): `dist.init_process_group("jax", ...)` then runs collectives as JAX ones.
"""
