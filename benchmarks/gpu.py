"""GPU check (run on a machine with an NVIDIA GPU and CUDA builds of jax and torch).

Absolute timings on one GPU: the jitted GPT-2-style forward and train step through
jaxtorch, against eager PyTorch on CUDA, and the eager `a + b` dispatch overhead against
plain JAX; plus the logits against PyTorch's.

PyTorch's CUDA reference runs in a subprocess that never imports jaxtorch: jaxtorch
makes "jax" torch's accelerator, after which torch autograd on CUDA tensors fails (torch
supports one accelerator per process; see `jaxtorch/bridge/tensor/_device.py`). So the two sides
are timed one after the other, not interleaved: quote these on an otherwise idle GPU.

    python benchmarks/gpu.py        # (python benchmarks/gpu.py 2: a quick dry run on the CPU)
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from models import gpt2

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run of this script


def median_time(f, n: int, warmup: int = 3) -> float:
    """Median seconds of `f()` (which must synchronize)."""
    for _ in range(warmup):
        f()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _ids() -> torch.Tensor:
    return torch.randint(0, 8192, (8, 128), generator=torch.Generator().manual_seed(0))


def torch_side(n: int, logits_path: str) -> dict:
    """Eager PyTorch on CUDA (no jaxtorch in this process): forward, train step, logits."""

    def sync():
        if DEV == "cuda":
            torch.cuda.synchronize()

    ids = _ids().to(DEV)
    model = gpt2(4).to(DEV)
    with torch.no_grad():
        np.save(logits_path, model(ids).logits.float().cpu().numpy())

    def fwd():
        with torch.no_grad():
            model(ids)
        sync()

    tmodel = gpt2(4).train().to(DEV)
    opt = torch.optim.Adam(tmodel.parameters(), lr=1e-4)

    def step():
        opt.zero_grad(set_to_none=True)
        tmodel(ids, labels=ids).loss.backward()
        opt.step()
        sync()

    return {"forward": median_time(fwd, n), "train": median_time(step, max(3, n // 2))}


def main(n: int = 50) -> None:
    import jax
    import optax

    import jaxtorch
    from jaxtorch.train import make_train_step

    with tempfile.TemporaryDirectory() as tmp:
        logits_path = str(Path(tmp) / "logits.npy")
        out = subprocess.run(
            [sys.executable, __file__, "--torch", str(n), logits_path], check=True, capture_output=True, text=True
        ).stdout
        ref = json.loads(out.strip().splitlines()[-1])
        ref_logits = np.load(logits_path)

    print(f"jax {jax.__version__} {jax.devices()}, torch {torch.__version__} ({DEV})")
    print("| benchmark | ratio | detail |\n|---|---|---|")
    dev = jax.devices()[0]
    jids = jax.device_put(jaxtorch.to_jax(_ids()), dev)
    params, fn = jaxtorch.extract(gpt2(4))
    params = jax.device_put(params, dev)
    f = jax.jit(lambda p, i: fn(p, i).logits)
    err = float(np.max(np.abs(np.asarray(f(params, jids)) - ref_logits)))
    print(
        f"| GPT-2 logits, jaxtorch vs torch ({DEV}), max abs diff | {err:.2e} | float32 matmuls at torch's precision |"
    )
    t = median_time(lambda: f(params, jids).block_until_ready(), n)
    print(
        f"| GPT-2 4x256 forward 8x128: jaxtorch jit / torch eager | {t / ref['forward']:.2f}x | "
        f"{t * 1e3:.2f} ms vs {ref['forward'] * 1e3:.2f} ms |"
    )

    init, step = make_train_step(gpt2(4).train(), lambda out, _: out.loss, optax.adam(1e-4))
    box = {"s": jax.device_put(init(), dev)}
    batch = {"input_ids": jids, "labels": jids}

    def jt():
        box["s"], loss = step(box["s"], batch, None, jax.random.key(0))
        loss.block_until_ready()

    t = median_time(jt, max(3, n // 2))
    print(
        f"| GPT-2 train step (value_and_grad + adam) / torch backward + Adam | {t / ref['train']:.2f}x | "
        f"{t * 1e3:.2f} ms vs {ref['train'] * 1e3:.2f} ms |"
    )

    jaxtorch.enable_globally()
    try:
        a, b = torch.randn(64, 64, device="jax"), torch.randn(64, 64, device="jax")
        ja, jb = a.jax(), b.jax()
        t_jt = median_time(lambda: (a + b).jax().block_until_ready(), 40 * n, warmup=200)
        t_j = median_time(lambda: (ja + jb).block_until_ready(), 40 * n, warmup=200)
    finally:
        jaxtorch.disable_globally()
    print(
        f"| eager `a + b` 64x64 / plain JAX (both synchronized) | {t_jt / t_j:.2f}x | "
        f"{t_jt * 1e6:.1f} us vs {t_j * 1e6:.1f} us |"
    )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--torch":
        print(json.dumps(torch_side(int(sys.argv[2]), sys.argv[3])))
    else:
        main(int(sys.argv[1]) if len(sys.argv) > 1 else 50)
