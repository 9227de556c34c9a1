"""Worker for test_distributed.py: data-parallel training with JAX's distributed runtime.

python -m tests.train._distributed single OUT.npz
python -m tests.train._distributed multi OUT.npz PROCESS_ID PORT CKPT     (4 CPU devices each)
"""

import sys

import jax
import numpy as np

from ._procs import init_two_processes


def main(argv):
    mode, out = argv[0], argv[1]
    if mode == "multi":
        init_two_processes(int(argv[2]), int(argv[3]))

    import jax.numpy as jnp
    import optax
    import torch
    from jax.sharding import Mesh

    import jaxtorch.xla as xm
    from jaxtorch.train import make_train_step, save_checkpoint, shard, shard_batch

    from ._models import MLP

    torch.manual_seed(0)
    model = MLP()
    init, step = make_train_step(model, lambda o, y: jnp.mean((o - y) ** 2), optax.adam(1e-2))
    state = init()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)) for _ in range(3)]
    if mode == "multi":
        mesh = Mesh(np.array(jax.devices()), ("data",))
        state = shard(state, mesh)
        lo, hi = 8 * jax.process_index(), 8 * (jax.process_index() + 1)  # this process's rows
        batches = [shard_batch((x[lo:hi], y[lo:hi]), mesh) for x, y in batches]
        assert batches[0][0].shape == (16, 8) and not batches[0][0].is_fully_addressable
    run = step
    if mode == "multi":
        # Compile ahead, then meet at a coordination-service barrier: the first collective then
        # starts in both processes together (Gloo gives up on a peer after 30 s, and tracing
        # plus compiling can take longer than that on a loaded machine).
        run = step.lower(state, *batches[0], None).compile()
        from jax._src import distributed

        distributed.global_state.client.wait_at_barrier("jaxtorch_train_compiled", 600_000)
    for x, y in batches:
        state, loss = run(state, x, y, None)
    host = {k: np.asarray(v.addressable_data(0)) for k, v in state.params.items()}  # replicated
    np.savez(out, loss=np.asarray(loss.addressable_data(0)), **host)
    if mode == "multi":
        save_checkpoint(state, argv[4])  # collective: gathers, process 0 writes
        xm.master_print("OK multi", xm.get_ordinal(), xm.world_size())
        jax.distributed.shutdown()
    else:
        print("OK single")


if __name__ == "__main__":
    main(sys.argv[1:])
