"""Layer 3 of the bridge: dispatch.

How an ATen op on the `jax` device reaches its JAX lowering: the routing, the interpreter
that builds one runner per op, the foreach ops, and the torch modes that turn it all on.

Importing this layer registers the "jax" torch.distributed backend (`_collectives`), so
`import jaxtorch` does: `dist.init_process_group("jax", ...)` then runs collectives as JAX ones.
"""

from ._collectives import install_jax_backend

install_jax_backend()
