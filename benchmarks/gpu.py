"""GPU check (run on a machine with an NVIDIA GPU and CUDA builds of jax and torch).

Absolute timings and ratios on one GPU, each against a reference measured in the same run:
the jitted GPT-2-style forward and train step through jaxtorch against eager PyTorch on
CUDA, the eager `a + b` dispatch overhead against plain JAX, and the logits against
PyTorch's. Not part of the test suite (CI has no GPU).

    python benchmarks/gpu.py        # (python benchmarks/gpu.py 2: a quick dry run on the CPU)
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import numpy as np
import optax
import torch

sys.path.insert(0, str(Path(__file__).parent))
import jaxtorch  # noqa: E402
from models import gpt2  # noqa: E402
from run import interleaved  # noqa: E402  (its callables here synchronize the GPU themselves)


def row(name: str, a: float, b: float, unit: float = 1e3, suffix: str = "ms") -> None:
    print(f"| {name} | {a / b:.2f}x | {a * unit:.2f} {suffix} vs {b * unit:.2f} {suffix} |", flush=True)


DEV = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run of this script


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def main(n: int = 50) -> None:
    print(f"jax {jax.__version__} {jax.devices()}, torch {torch.__version__} cuda={torch.cuda.is_available()}")
    print("| benchmark | ratio | detail |\n|---|---|---|")
    ids = torch.randint(0, 8192, (8, 128))
    jids = jax.device_put(jaxtorch.to_jax(ids), jax.devices()[0])

    model = gpt2(4)
    params, fn = jaxtorch.extract(model)
    params = jax.device_put(params, jax.devices()[0])
    f = jax.jit(lambda p, i: fn(p, i).logits)
    cmodel, cids = gpt2(4).to(DEV), ids.to(DEV)
    with torch.no_grad():
        ref = cmodel(cids).logits.float().cpu().numpy()
    err = float(np.max(np.abs(np.asarray(f(params, jids)) - ref)))
    print(f"| GPT-2 logits, jaxtorch on GPU vs torch CUDA, max abs diff | {err:.2e} | |")

    def torch_fwd():
        with torch.no_grad():
            cmodel(cids)
        sync()

    t_jt, t_t = interleaved(lambda: f(params, jids).block_until_ready(), torch_fwd, n)
    row("GPT-2 4x256 forward 8x128: jaxtorch jit / torch CUDA eager", t_jt, t_t)

    from jaxtorch.train import make_train_step

    init, step = make_train_step(gpt2(4).train(), lambda out, _: out.loss, optax.adam(1e-4), donate=True)
    box = {"s": jax.device_put(init(), jax.devices()[0])}
    batch = {"input_ids": jids, "labels": jids}

    def jt():
        box["s"], loss = step(box["s"], batch, None, jax.random.key(0))
        loss.block_until_ready()

    tmodel = gpt2(4).train().to(DEV)
    opt = torch.optim.Adam(tmodel.parameters(), lr=1e-4)

    def tt():
        opt.zero_grad(set_to_none=True)
        tmodel(cids, labels=cids).loss.backward()
        opt.step()
        sync()

    t_jt, t_t = interleaved(jt, tt, max(3, n // 2))
    row("GPT-2 train step (value_and_grad + adam) / torch CUDA backward + Adam", t_jt, t_t)

    jaxtorch.enable_globally()
    try:
        a, b = torch.randn(64, 64, device="jax"), torch.randn(64, 64, device="jax")
        ja, jb = a.jax(), b.jax()
        t_jt, t_j = interleaved(lambda: (a + b).jax().block_until_ready(), lambda: (ja + jb).block_until_ready(),
                                40 * n, warmup=200)
    finally:
        jaxtorch.disable_globally()
    row("eager `a + b` 64x64 / plain JAX (both synchronized)", t_jt, t_j, 1e6, "us")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 50)
