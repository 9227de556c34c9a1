"""Worker for test_load.py: `load_params` on several devices / processes.

python -m tests.train._load_worker tp CKPT                      (8 CPU devices, one process)
python -m tests.train._load_worker multi CKPT PROCESS_ID PORT   (2 processes x 4 CPU devices)
python -m tests.train._load_worker indivisible DIR               (8 CPU devices: a rule that does not divide)

Every byte `load_params` reads passes through `jaxtorch.train._load.read_slice`; the worker
counts them and prints "OK <mode> <bytes read> <bytes expected>".
"""

import sys

import jax
import numpy as np

from ._procs import init_two_processes


def _count_reads():
    from jaxtorch.train import _load

    counted = {"bytes": 0}
    real = _load.read_slice

    def read_slice(entry, index):
        out = real(entry, index)
        counted["bytes"] += out.nbytes
        return out

    _load.read_slice = read_slice
    return counted


def indivisible(directory: str) -> None:
    """A rule splitting a (12, 6) weight's rows over 8 devices: print the error load_params raises."""
    import torch
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P
    from safetensors.torch import save_file

    import jaxtorch

    model = torch.nn.Linear(6, 12)
    save_file({k: v.detach() for k, v in model.state_dict().items()}, f"{directory}/m.safetensors")
    mesh = Mesh(np.array(jax.devices()), ("model",))
    try:
        jaxtorch.load_params(model, f"{directory}/m.safetensors", mesh=mesh, rules=[(r"weight$", P("model"))])
    except ValueError as e:
        print("OK indivisible", type(e).__name__, str(e).replace("\n", " "))


def main(argv):
    mode, ckpt = argv[0], argv[1]
    if mode == "indivisible":
        return indivisible(ckpt)
    if mode == "multi":
        init_two_processes(int(argv[2]), int(argv[3]))
    import safetensors.numpy
    import torch
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    import jaxtorch

    from .test_load import CONFIG, llama

    counted = _count_reads()
    with torch.device("meta"):
        model = llama(CONFIG)
    mesh = Mesh(np.array(jax.devices()), ("model",))
    file = safetensors.numpy.load_file(ckpt)
    if mode == "tp":  # Megatron-style: column-split q/k/v/gate/up, row-split o/down, the rest replicated
        rules = [
            (r"(q_proj|k_proj|v_proj|gate_proj|up_proj)\.weight$", P("model", None)),
            (r"(o_proj|down_proj)\.weight$", P(None, "model")),
        ]
        params, state = jaxtorch.load_params(model, ckpt, mesh=mesh, rules=rules)
        arrays = {**params, **state}
        q = arrays["model.layers.0.self_attn.q_proj.weight"]
        assert q.sharding.spec == P("model", None), q.sharding
        assert len({str(s.index) for s in q.addressable_shards}) == 8
        expected = sum(v.nbytes for v in file.values())  # each distinct slice read once, replicas reused
    else:  # every weight split on axis 0 over the 8 devices of both processes: each process reads half
        params, state = jaxtorch.load_params(model, ckpt, mesh=mesh, rules=[(r"weight$", P("model"))])
        arrays = {**params, **state}
        expected = sum(v.nbytes for v in file.values()) // 2
    for name, value in file.items():
        a = arrays[name]
        for shard in a.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), value[shard.index])
    print("OK", mode, counted["bytes"], expected)
    if mode == "multi":
        jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
