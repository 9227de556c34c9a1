"""GPU check for issue 31 (run on a machine with an NVIDIA GPU and CUDA builds of jax and torch).

1. fp16 loss scaling: the same small model trained with `torch.amp.GradScaler` and fp16 autocast on
   torch's own CUDA (a subprocess that never imports jaxtorch: torch allows one accelerator per
   process) and on the jax device backed by the GPU, eagerly and under `jaxtorch.jit` (its first
   step eager: SGD's momentum is created there), with an inf gradient injected at two steps: the
   scale sequences and skipped steps must be equal, the parameters close (fp16 products differ
   between cuBLAS and XLA).
2. The float32 reciprocal GradScaler uses (`jaxtorch.bridge.core._float_bits.f32_reciprocal`, int32 arithmetic) on
   the GPU against numpy's correctly rounded `float32(1 / float64(x))`, over every positive normal
   float32 whose reciprocal is normal, and XLA's own f32 division for comparison.

    python benchmarks/gpu_issue31.py            # prints one JSON line per part
    python benchmarks/gpu_issue31.py cpu 2      # a dry run on the CPU: CPU torch's GradScaler, 2 chunks
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np

STEPS, INF_AT = 8, (2, 5)

TRAIN = r"""
import json, sys, torch, torch.nn.functional as F
dev = sys.argv[1]
if dev == "jax":
    import jaxtorch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
g = torch.Generator().manual_seed(1)
xs = [torch.randn(32, 16, generator=g) for _ in range(STEPS)]
ys = [torch.randn(32, 4, generator=g) for _ in range(STEPS)]
model = model.to(dev)
opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
scaler = torch.amp.GradScaler(dev, init_scale=2.0**16, growth_interval=2)

def step(model, opt, scaler, x, y, poison):
    opt.zero_grad()
    with torch.autocast(dev, dtype=torch.float16):
        loss = F.mse_loss(model(x).float(), y)
    scaler.scale(loss * poison).backward()
    scaler.step(opt)
    scaler.update()
    return loss

run = step
if len(sys.argv) > 2 and sys.argv[2] == "jit":
    import jaxtorch
    run = jaxtorch.jit(step)
scales, losses = [], []
for i in range(STEPS):
    poison = torch.tensor(float("inf") if i in INF_AT else 1.0, device=dev)
    loss = (step if i == 0 else run)(model, opt, scaler, xs[i].to(dev), ys[i].to(dev), poison)
    scales.append(float(scaler.get_scale()))
    losses.append(float(loss.detach().cpu()))
params = [p.detach().cpu().double().flatten().tolist() for p in model.parameters()]
print(json.dumps({"scales": scales, "losses": losses, "params": params}))
""".replace("STEPS", str(STEPS)).replace("INF_AT", repr(INF_AT))


def _train(*args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", TRAIN, *args], capture_output=True, text=True, timeout=240)
    if out.returncode:
        return {"error": out.stderr[-2000:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def grad_scaler(ref_device: str) -> None:
    ref = _train(ref_device)
    for mode in ("eager", "jit"):
        t0 = time.perf_counter()
        got = _train("jax", mode)
        if "error" in got or "error" in ref:
            print(json.dumps({"part": f"grad_scaler_{mode}", "error": got.get("error") or ref.get("error")}))
            continue
        diff = max(abs(a - b) for pa, pb in zip(ref["params"], got["params"]) for a, b in zip(pa, pb))
        print(
            json.dumps(
                {
                    "part": f"grad_scaler_{mode}",
                    "scales_equal": ref["scales"] == got["scales"],
                    "scales_cuda": ref["scales"],
                    "scales_jax": got["scales"],
                    "max_param_diff": diff,
                    "seconds": round(time.perf_counter() - t0, 1),
                }
            )
        )


def reciprocal(chunks: int, chunk: int = 1 << 25) -> None:
    import jax
    import jax.numpy as jnp

    from jaxtorch.bridge.core._float_bits import f32_reciprocal

    f = jax.jit(lambda b: f32_reciprocal(jax.lax.bitcast_convert_type(b, jnp.float32)))
    div = jax.jit(lambda b: 1.0 / jax.lax.bitcast_convert_type(b, jnp.float32))
    lo, hi = 0x00800000, 0x7E800000  # positive normal floats whose reciprocal is normal
    hi = min(hi, lo + chunks * chunk)
    bad = bad_div = 0
    t0 = time.perf_counter()
    for start in range(lo, hi, chunk):
        bits = np.arange(start, min(start + chunk, hi), dtype=np.uint32).view(np.int32)
        want = (1.0 / bits.view(np.float32).astype(np.float64)).astype(np.float32).view(np.int32)
        bad += int(np.count_nonzero(np.asarray(f(bits)).view(np.int32) != want))
        bad_div += int(np.count_nonzero(np.asarray(div(bits)).view(np.int32) != want))
    print(
        json.dumps(
            {
                "part": "f32_reciprocal",
                "device": str(jax.devices()[0]),
                "values": hi - lo,
                "mismatches": bad,
                "xla_division_mismatches": bad_div,
                "seconds": round(time.perf_counter() - t0, 1),
            }
        )
    )


if __name__ == "__main__":
    grad_scaler(sys.argv[1] if len(sys.argv) > 1 else "cuda")
    reciprocal(int(sys.argv[2]) if len(sys.argv) > 2 else 1 << 30)
