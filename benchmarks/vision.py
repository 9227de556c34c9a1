"""Convolutional networks under `jax.jit` on the CPU (issue 13 item 3).

For `models.cnn("resnet18")` and `models.cnn("mobilenet_v2")`, batch 8, 3x112x112:
- forward (eval mode): jaxtorch's `extract` + `jax.jit` against (a) eager torch under
  `torch.no_grad()` and (b) the same network written by hand in JAX in NHWC layout with
  BatchNorm folded into the convolutions (`cnn_jax.py`, the XLA floor on this machine);
- train step (train-mode BatchNorm, cross entropy, SGD with momentum): jaxtorch's
  `make_train_step` against (a) eager torch forward + backward + `torch.optim.SGD` and (b) the
  hand-written NHWC network under `jax.value_and_grad` + `optax.sgd`.

All three sides of a row are timed interleaved (one call of each in turn) in several rounds;
each round gives a median, and the table shows the range of the per-round ratios. The
hand-written network is checked against torch before it is timed, and the optimized HLO of
both jitted programs is counted (transposes, copies, convolutions, fusions). The forward rows
add a fourth side: the hand-written network taking its weights in torch's OIHW layout and
transposing them to HWIO inside the program, as every program given torch-layout weights must.

    python benchmarks/vision.py                       # both networks, forward and train step
    python benchmarks/vision.py --only resnet18 --rounds 7 --hlo
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]  # this checkout's jaxtorch
from cnn_jax import convert, with_torch_layout  # noqa: E402
from models import cnn  # noqa: E402

import jaxtorch  # noqa: E402
from jaxtorch.train import make_train_step  # noqa: E402

BATCH, SIZE, LR, MOMENTUM = 8, 112, 0.01, 0.9
ROWS: list[tuple[str, ...]] = []


def timed_rounds(fns: dict[str, Callable[[], object]], rounds: int, calls: int, warmup: int = 2) -> dict[str, list]:
    """Per-round median seconds of each function, the functions called in turn (interleaved)."""
    for _ in range(warmup):
        for f in fns.values():
            f()
    out = {k: [] for k in fns}
    for _ in range(rounds):
        times = {k: [] for k in fns}
        for _ in range(calls):
            for k, f in fns.items():
                t0 = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t0)
        for k in fns:
            out[k].append(statistics.median(times[k]))
    return out


def hlo_counts(text: str) -> dict[str, int]:
    """Instructions of an optimized HLO module: the transposes/copies the entry computation
    materializes (its fusions named after a transpose or copy), then counts over all computations
    (fused ones included): transposes, copies, convolutions, fusions, the YNNPACK fusions that run
    XLA:CPU's convolutions, reduce-windows, select-and-scatters, scatters."""
    lines = text.splitlines()
    entry = text[text.index("\nENTRY") :].splitlines()
    relayouts = sum(1 for ln in entry if re.search(r"%(transpose|copy)[\w.-]* = ", ln))
    count = lambda op: sum(1 for ln in lines if re.search(rf"= \S+ {op}\(", ln))
    conv_fusions = sum(1 for ln in lines if re.search(r"ynn_fusion[.\d]* = ", ln))
    return {
        "entry relayouts": relayouts,
        "transpose": count("transpose"),
        "copy": count("copy"),
        "convolution": count("convolution"),
        "fusion": count("fusion"),
        "ynn-fusion": conv_fusions,
        "reduce-window": count("reduce-window"),
        "select-and-scatter": count("select-and-scatter"),
        "scatter": count("scatter"),
    }


def _ratio_range(a: list[float], b: list[float]) -> str:
    r = sorted(x / y for x, y in zip(a, b))
    return f"{r[0]:.2f}x-{r[-1]:.2f}x" if len(r) > 1 else f"{r[0]:.2f}x"


def _ms(ts: list[float]) -> str:
    return f"{min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f} ms"


def _report(name: str, t: dict[str, list], target_torch: str, target_ref: str, side: str = "jaxtorch") -> None:
    jt, tt, ref = t[side], t["torch"], t["nhwc"]
    oihw = t.get("nhwc_oihw")
    row = (
        name,
        _ratio_range(jt, tt),
        target_torch,
        _ratio_range(jt, ref),
        target_ref,
        _ratio_range(jt, oihw) if oihw else "-",
        _ratio_range(ref, tt),
        f"{side} {_ms(jt)}, torch {_ms(tt)}, NHWC JAX {_ms(ref)}"
        + (f", NHWC JAX with OIHW weights {_ms(oihw)}" if oihw else ""),
    )
    ROWS.append(row)
    print(" | ".join(row), flush=True)


def bench_forward(name: str, rounds: int, calls: int, show_hlo: bool) -> None:
    model = cnn(name)
    x = torch.randn(BATCH, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(1))
    params, fn = jaxtorch.extract(model)
    f_jt = jax.jit(fn)
    fparams, ffn = jaxtorch.extract(model, conv_layout="flax")  # convolution weights in XLA's layout
    f_flax = jax.jit(ffn)
    rparams, rfn = convert(model, train=False)
    f_ref = jax.jit(rfn)
    oparams, ofn = with_torch_layout(rparams, rfn)
    f_oihw = jax.jit(ofn)
    jx = jnp.asarray(x.numpy())
    jx_nhwc = jnp.transpose(jx, (0, 2, 3, 1))
    with torch.no_grad():
        want = model(x).numpy()
    # the references agree with torch (float32 round-off of different convolution algorithms)
    np.testing.assert_allclose(np.asarray(f_ref(rparams, jx_nhwc)), want, rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(np.asarray(f_oihw(oparams, jx_nhwc)), want, rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(np.asarray(f_jt(params, jx)), want, rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(np.asarray(f_flax(fparams, jx)), want, rtol=1e-3, atol=1e-3)

    def torch_fwd():
        with torch.no_grad():
            model(x)

    t = timed_rounds(
        {
            "jaxtorch": lambda: f_jt(params, jx).block_until_ready(),
            "jaxtorch flax layout": lambda: f_flax(fparams, jx).block_until_ready(),
            "torch": torch_fwd,
            "nhwc": lambda: f_ref(rparams, jx_nhwc).block_until_ready(),
            "nhwc_oihw": lambda: f_oihw(oparams, jx_nhwc).block_until_ready(),
        },
        rounds,
        calls,
    )
    _report(f"{name} forward (eval)", t, "<= 1.0x", "<= 1.1x")
    _report(f'{name} forward (eval), `conv_layout="flax"`', t, "<= 1.0x", "<= 1.1x", side="jaxtorch flax layout")
    c_jt = hlo_counts(f_jt.lower(params, jx).compile().as_text())
    c_flax = hlo_counts(f_flax.lower(fparams, jx).compile().as_text())
    c_ref = hlo_counts(f_ref.lower(rparams, jx_nhwc).compile().as_text())
    print(
        f"  optimized HLO jaxtorch {c_jt}\n  optimized HLO flax layout {c_flax}\n  optimized HLO NHWC     {c_ref}",
        flush=True,
    )
    if show_hlo:
        Path(f"/tmp/{name}_fwd_jaxtorch.hlo").write_text(f_jt.lower(params, jx).compile().as_text())
        Path(f"/tmp/{name}_fwd_nhwc.hlo").write_text(f_ref.lower(rparams, jx_nhwc).compile().as_text())


def _xent(logits: jax.Array, y: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def bench_train(name: str, rounds: int, calls: int, show_hlo: bool) -> None:
    x = torch.randn(BATCH, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 1000, (BATCH,), generator=torch.Generator().manual_seed(2))
    jx, jy = jnp.asarray(x.numpy()), jnp.asarray(y.numpy())
    jx_nhwc = jnp.transpose(jx, (0, 2, 3, 1))
    opt = optax.sgd(LR, momentum=MOMENTUM)

    # jaxtorch
    init, step = make_train_step(cnn(name).train(), _xent, opt)
    box = {"s": init()}

    def jt():
        box["s"], loss = step(box["s"], jx, jy)
        loss.block_until_ready()

    finit, fstep = make_train_step(cnn(name).train(), _xent, opt, conv_layout="flax")
    fbox = {"s": finit()}

    def jt_flax():
        fbox["s"], loss = fstep(fbox["s"], jx, jy)
        loss.block_until_ready()

    # the hand-written NHWC network, train-mode BatchNorm
    rparams, rfn = convert(cnn(name).train(), train=True)

    def ref_step(p, s, x, y):
        def loss_fn(p):
            logits, stats = rfn(p, x)
            return _xent(logits, y), stats

        (loss, stats), g = jax.value_and_grad(loss_fn, has_aux=True)(p)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, stats, loss

    ref_step = jax.jit(ref_step)
    rbox = {"p": rparams, "s": opt.init(rparams)}

    def ref():
        rbox["p"], rbox["s"], _, loss = ref_step(rbox["p"], rbox["s"], jx_nhwc, jy)
        loss.block_until_ready()

    # eager torch
    tmodel = cnn(name).train()
    topt = torch.optim.SGD(tmodel.parameters(), lr=LR, momentum=MOMENTUM)

    def tt():
        topt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(tmodel(x), y)
        loss.backward()
        topt.step()
        return loss

    # same first loss on all three sides
    want = float(tt().detach())
    _, _, _, l_ref = ref_step(rparams, opt.init(rparams), jx_nhwc, jy)
    _, l_jt = step(init(), jx, jy)
    _, l_flax = fstep(finit(), jx, jy)
    np.testing.assert_allclose([float(l_ref), float(l_jt), float(l_flax)], [want] * 3, rtol=1e-4)

    t = timed_rounds({"jaxtorch": jt, "jaxtorch flax layout": jt_flax, "torch": tt, "nhwc": ref}, rounds, calls)
    _report(f"{name} train step (SGD)", t, "<= 1.0x", "-")
    _report(f'{name} train step (SGD), `conv_layout="flax"`', t, "<= 1.0x", "-", side="jaxtorch flax layout")
    c_jt = hlo_counts(step.lower(box["s"], jx, jy).compile().as_text())
    c_flax = hlo_counts(fstep.lower(fbox["s"], jx, jy).compile().as_text())
    c_ref = hlo_counts(ref_step.lower(rbox["p"], rbox["s"], jx_nhwc, jy).compile().as_text())
    print(
        f"  optimized HLO jaxtorch {c_jt}\n  optimized HLO flax layout {c_flax}\n  optimized HLO NHWC     {c_ref}",
        flush=True,
    )
    if show_hlo:
        Path(f"/tmp/{name}_train_jaxtorch.hlo").write_text(step.lower(box["s"], jx, jy).compile().as_text())
        Path(f"/tmp/{name}_train_nhwc.hlo").write_text(
            ref_step.lower(rbox["p"], rbox["s"], jx_nhwc, jy).compile().as_text()
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="resnet18,mobilenet_v2", help="comma-separated: resnet18, mobilenet_v2")
    ap.add_argument("--mode", default="forward,train", help="comma-separated: forward, train")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=5, help="calls of each side per round")
    ap.add_argument("--hlo", action="store_true", help="write the optimized HLO texts to /tmp")
    args = ap.parse_args()
    for name in args.only.split(","):
        if "forward" in args.mode:
            bench_forward(name, args.rounds, args.calls, args.hlo)
        if "train" in args.mode:
            bench_train(name, args.rounds, args.calls, args.hlo)
    print(f"\nbatch {BATCH}, 3x{SIZE}x{SIZE}; ranges over {args.rounds} rounds of {args.calls} interleaved calls\n")
    print(
        "| benchmark | jaxtorch / eager torch | target | jaxtorch / NHWC JAX | target "
        "| jaxtorch / NHWC JAX taking OIHW weights | NHWC JAX / eager torch | detail |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in ROWS:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
