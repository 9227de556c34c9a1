"""One of two processes (2 CPU devices each) joined by `jax.distributed` on loopback; run by
test_collectives.py:

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m tests.interop._collectives_multi PROCESS_ID PORT

The DDP-style step of `_collectives_worker` runs over all 4 devices of both processes (its
`dist.all_reduce` a cross-process JAX psum) and must equal eager torch on the CPU on the global
batch; it prints "OK multi <process> <last loss as hex>".
"""

from __future__ import annotations

import sys

import jax
import numpy as np


def multi(process_id: int, port: int) -> None:
    """One of 2 processes x 2 CPU devices: the DDP step over all 4 devices equals eager torch."""
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id, initialization_timeout=120
    )
    assert jax.process_count() == 2 and jax.device_count() == 4
    import torch.distributed as dist  # (after `initialize`: importing jaxtorch starts JAX's backend)
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from ._collectives_worker import ddp_training, reference_training

    dist.init_process_group("jax", rank=0, world_size=4, store=dist.HashStore())
    mesh = Mesh(np.array(jax.devices()), ("d",))

    def put(a, spec):
        sharding = NamedSharding(mesh, spec)
        if spec == P():
            return jax.make_array_from_process_local_data(sharding, a)
        half = a.shape[0] // 2  # this process's rows of the global batch
        return jax.make_array_from_process_local_data(sharding, a[process_id * half : (process_id + 1) * half])

    params, losses = ddp_training(mesh, put)
    ref_params, ref_losses = reference_training()
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for got, ref in zip(params, ref_params, strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    print("OK multi", process_id, float(losses[-1]).hex())
    jax.distributed.shutdown()


if __name__ == "__main__":
    multi(int(sys.argv[1]), int(sys.argv[2]))
