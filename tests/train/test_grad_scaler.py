"""fp16 loss scaling: `torch.amp.GradScaler("jax")` trains as CPU torch's `GradScaler("cpu")` does.

The reference is eager CPU torch on the same inputs: the same scale sequence, the same skipped
steps (inf/NaN gradients) and the same parameters, eagerly, in lazy mode and under `jaxtorch.jit`;
the two kernels and the inverse scale bit for bit. Run the exhaustive check of the float32
reciprocal (all 2**32 bit patterns, several minutes) with `JAXTORCH_SLOW=1`.
"""

from __future__ import annotations

import itertools
import os
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import jaxtorch
from jaxtorch.bridge.core._float_bits import f32_reciprocal
from jaxtorch.bridge.dispatch._grad_scaler import inverse_scale
from tests._dtypes import enable_x64

INF, NAN = float("inf"), float("nan")
# the loss is multiplied by these: inf and NaN give non-finite gradients (steps torch skips)
POISON = [1.0, 1.0, INF, 1.0, 1.0, NAN, 1.0]
STEPS = len(POISON)


# ---- the inverse scale ---------------------------------------------------------------------------
def _float64_path(bits: np.ndarray) -> np.ndarray:
    """`scale.double().reciprocal().float()`, as GradScaler computes it on CPU torch, as bits."""
    x = torch.from_numpy(bits.view(np.float32).copy())
    return x.double().reciprocal().float().numpy().view(np.uint32)


def _assert_same_bits(bits: np.ndarray) -> None:
    got = np.asarray(f32_reciprocal(jnp.asarray(bits.view(np.float32)))).view(np.uint32)
    want = _float64_path(bits)
    nan = np.isnan(want.view(np.float32))
    ok = (got == want) | (nan & np.isnan(got.view(np.float32)))
    assert ok.all(), [hex(b) for b in bits[~ok][:5]]


def test_reciprocal_matches_the_float64_path():
    specials = [0, 0x80000000, 1, 0x80000001, 0x007FFFFF, 0x00800000, 0x3F800000, 0x40400000, 0x47800000]
    specials += [0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000, 0xFF800000, 0x7FC00000, 0x00200000, 0x7E800000, 0x7E7FFFFF]
    rng = np.random.default_rng(0)
    random = rng.integers(0, 1 << 32, 1 << 16, dtype=np.uint64).astype(np.uint32)
    every_mantissa_near_one = (np.uint32(0x3F800000) + np.arange(0, 1 << 23, 97, dtype=np.uint32)).astype(np.uint32)
    _assert_same_bits(np.concatenate([np.array(specials, np.uint32), random, every_mantissa_near_one]))


@pytest.mark.skipif(not os.environ.get("JAXTORCH_SLOW"), reason="all 2**32 float32 values: JAXTORCH_SLOW=1")
def test_reciprocal_matches_the_float64_path_everywhere():
    for start in range(0, 1 << 32, 1 << 24):
        _assert_same_bits(np.arange(start, start + (1 << 24), dtype=np.uint64).astype(np.uint32))


def test_inverse_scale_of_a_jax_tensor():
    scale = torch.full((), 3.0, device="jax")
    inv = inverse_scale(scale)
    assert inv.dtype == torch.float32 and inv.device.type == "jax"
    assert inv.cpu().item() == torch.tensor(3.0).double().reciprocal().float().item()


# ---- the two kernels against CPU torch's -----------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_unscale_kernel_matches_torch(dtype):
    g = torch.Generator().manual_seed(1)
    finite = [torch.randn(5, 3, generator=g).mul(1000).to(dtype), torch.tensor([1e-7, -0.0, 3.0]).to(dtype)]
    lists = (finite, [*finite, torch.tensor([1.0, INF]).to(dtype)], [torch.tensor([NAN, 2.0]).to(dtype)])
    for grads, inv, found in itertools.product(lists, [1.0, 1 / 3, 2.0**-16, 1e30], [0.0, 0.5]):
        cpu = [t.clone() for t in grads]
        cpu_found = torch.tensor(found)
        torch._amp_foreach_non_finite_check_and_unscale_(cpu, cpu_found, torch.tensor(inv))
        jx = [t.to("jax") for t in grads]
        jx_found = torch.tensor(found).to("jax")
        torch._amp_foreach_non_finite_check_and_unscale_(jx, jx_found, torch.tensor(inv).to("jax"))
        assert jx_found.cpu().item() == cpu_found.item()
        for a, b in zip(jx, cpu):
            assert a.dtype == b.dtype
            torch.testing.assert_close(a.cpu(), b, rtol=0, atol=0, equal_nan=True)


def _update_sequence(device, scale, tracker, founds, growth, backoff, interval):
    s = torch.tensor(scale).to(device)
    t = torch.tensor(tracker, dtype=torch.int32).to(device)
    out = []
    for f in founds:
        ret = torch._amp_update_scale_(s, t, torch.tensor(f).to(device), growth, backoff, interval)
        assert ret is s
        out.append((s.cpu().item(), t.cpu().item()))
    return out


@pytest.mark.parametrize(
    "scale, growth, backoff, interval",
    [
        (65536.0, 2.0, 0.5, 2),
        (3.0, 4.0, 0.25, 1),
        (2.0**126, 2.0, 0.5, 1),  # growing past float32's largest value keeps the scale
        (2.0**-140, 2.0, 0.5, 3),  # subnormal scales
        (1.0, 2.0, 0.5, 2**40),  # an interval the int32 tracker never reaches
    ],
)
def test_update_scale_kernel_matches_torch(scale, growth, backoff, interval):
    founds = [0.0, 0.0, 1.0, 0.0, NAN, 0.0, 0.0, 2.0, 0.0, 0.0, 0.0]
    expected = _update_sequence("cpu", scale, 0, founds, growth, backoff, interval)
    assert _update_sequence("jax", scale, 0, founds, growth, backoff, interval) == expected


def test_update_scale_in_lazy_mode():
    founds = [0.0, 1.0, 0.0, 0.0, 0.0]
    expected = _update_sequence("cpu", 8.0, 0, founds, 2.0, 0.5, 2)
    with jaxtorch.lazy():
        assert _update_sequence("jax", 8.0, 0, founds, 2.0, 0.5, 2) == expected


def test_a_factor_float32_cannot_hold_is_computed_in_float64_with_x64():
    founds = [0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    expected = _update_sequence("cpu", 3.0, 0, founds, 1.1, 0.9, 1)
    with enable_x64():
        assert _update_sequence("jax", 3.0, 0, founds, 1.1, 0.9, 1) == expected


def test_a_factor_float32_cannot_hold_is_refused_without_x64():
    s, t = torch.tensor(8.0).to("jax"), torch.tensor(1, dtype=torch.int32).to("jax")
    with pytest.raises(jaxtorch.GradScalerError, match="jax_enable_x64"):
        torch._amp_update_scale_(s, t, torch.tensor(0.0).to("jax"), 1.1, 0.5, 2)
    assert (s.cpu().item(), t.cpu().item()) == (8.0, 1)  # nothing written


# ---- training loops against CPU torch --------------------------------------------------------------
def _model(device):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).to(device)


def _optimizer(name, model):
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=1e-2)
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9 if name == "momentum" else 0.0)


def _data(n: int = STEPS):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g), torch.tensor(p)) for p in POISON[:n]]


def step(model, opt, scaler, x, y, poison, clip=False, dtype=torch.float16):
    """One fp16 step as torch's AMP recipe writes it (`clip`: unscale_, then clip the gradients)."""
    opt.zero_grad()
    with torch.autocast(x.device.type, dtype=dtype):
        loss = F.mse_loss(model(x).float(), y)
    scaler.scale(loss * poison).backward()
    if clip:
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    scaler.step(opt)
    scaler.update()
    return loss


def _train(device, opt_name, run=step, eager_first=0, **kw):
    """(scale, growth tracker, parameters) after each step."""
    model = _model(device)
    opt = _optimizer(opt_name, model)
    scaler = torch.amp.GradScaler(device, init_scale=2.0**14, growth_interval=2)
    out = []
    for i, (x, y, p) in enumerate(_data()):
        (step if i < eager_first else run)(model, opt, scaler, x.to(device), y.to(device), p.to(device), **kw)
        params = [t.detach().cpu().clone() for t in model.parameters()]
        out.append((scaler.get_scale(), scaler._get_growth_tracker(), params))
    return out


def _assert_like_cpu(got, expected, exact: bool):
    for i, ((s, t, ps), (es, et, eps)) in enumerate(zip(got, expected)):
        assert (s, t) == (es, et), f"step {i}: scale/tracker {(s, t)}, torch {(es, et)}"
        for a, b in zip(ps, eps):
            if exact:
                torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"step {i}")
            else:
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=f"step {i}")
    skipped = [i for i in range(1, len(expected)) if all(torch.equal(a, b) for a, b in zip(got[i][2], got[i - 1][2]))]
    assert skipped == [i for i, p in enumerate(POISON) if p != 1.0]  # the inf and NaN steps, and only those


@pytest.mark.parametrize(
    "opt_name, clip, dtype",
    [("sgd", False, torch.float16), ("momentum", True, torch.float16), ("adam", False, torch.float16)]
    + [("sgd", False, torch.bfloat16)],
)
def test_eager_training_matches_cpu(opt_name, clip, dtype):
    expected = _train("cpu", opt_name, clip=clip, dtype=dtype)
    _assert_like_cpu(_train("jax", opt_name, clip=clip, dtype=dtype), expected, exact=opt_name == "sgd")


def test_lazy_training_matches_cpu():
    expected = _train("cpu", "adam")

    def lazy_step(*args):
        step(*args)
        jaxtorch.sync()

    with jaxtorch.lazy():
        got = _train("jax", "adam", run=lazy_step)
    _assert_like_cpu(got, expected, exact=False)


def test_compiled_training_matches_cpu_without_recompiling():
    """SGD: every step compiled, the scaler an argument; its scale is made by the first call."""
    compiled = jaxtorch.jit(step)
    expected = _train("cpu", "sgd")
    _assert_like_cpu(_train("jax", "sgd", run=compiled), expected, exact=True)
    assert compiled.compilations == 2  # the first call creates the scale: the second sees it as state


def test_compiled_adam_after_one_eager_step():
    """Adam creates its state in its first step: that step runs eagerly, the rest compiled (one program
    for skipped and taken steps, the scale and growth tracker as its state)."""
    compiled = jaxtorch.jit(step)
    expected = _train("cpu", "adam")
    _assert_like_cpu(_train("jax", "adam", run=compiled, eager_first=1), expected, exact=False)
    assert compiled.compilations == 1


def test_compiled_step_that_would_create_optimizer_state_is_refused():
    model = _model("jax")
    opt = _optimizer("adam", model)
    scaler = torch.amp.GradScaler("jax")
    before = [p.detach().cpu().clone() for p in model.parameters()]
    x, y, p = _data(1)[0]
    with pytest.raises(jaxtorch.GradScalerError, match="first steps eagerly"):
        jaxtorch.jit(step)(model, opt, scaler, x.to("jax"), y.to("jax"), p.to("jax"))
    assert not opt.state and scaler._scale is None  # nothing changed
    assert all(torch.equal(a.detach().cpu(), b) for a, b in zip(model.parameters(), before))


def test_compiled_step_with_a_global_scaler_is_refused():
    model = _model("jax")
    opt = _optimizer("sgd", model)
    scaler = torch.amp.GradScaler("jax")

    @jaxtorch.jit
    def closed_over(model, opt, x, y, poison):
        return step(model, opt, scaler, x, y, poison)

    x, y, p = _data(1)[0]
    with pytest.raises(jaxtorch.GradScalerError, match="as an argument"):
        closed_over(model, opt, x.to("jax"), y.to("jax"), p.to("jax"))
    assert scaler._scale is None  # no traced value leaked into it


def test_state_dict_round_trip():
    model = _model("jax")
    opt = _optimizer("sgd", model)
    scaler = torch.amp.GradScaler("jax", init_scale=64.0, growth_interval=3)
    for x, y, p in _data(3):
        step(model, opt, scaler, x.to("jax"), y.to("jax"), p.to("jax"))
    state = scaler.state_dict()
    assert (state["scale"], state["_growth_tracker"]) == (32.0, 0)  # two steps taken, then an inf: halved
    other = torch.amp.GradScaler("jax")
    other.load_state_dict(state)
    assert other.state_dict() == state


def test_the_documented_example_runs(capsys):
    """docs/api/grad_scaler.md's example runs and prints what it says."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "api" / "grad_scaler.md").read_text()
    code = re.search(r"```python\n(.*?)```", page, re.S)
    assert code is not None
    exec(compile(code.group(1), "grad_scaler.md", "exec"), {})
    assert capsys.readouterr().out.split() == ["16384.0", "1"]
