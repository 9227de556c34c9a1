"""`torch.autocast("jax", dtype=...)` follows torch's CPU autocast policy, op by op.

Each case runs under `torch.autocast("cpu", dtype)` on CPU tensors and under
`torch.autocast("jax", dtype)` on the same values on the jax device: output dtypes must be
equal, values within the output dtype's tolerance.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers

import jaxtorch
from jaxtorch.bridge.dispatch import _autocast
from tests._hf_models import tiny_llama_config

LOW = (torch.bfloat16, torch.float16)
N = 8


def _r(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=_GEN, dtype=dtype)


_GEN = torch.Generator().manual_seed(0)

# (name, function, argument builder): the builder makes CPU arguments for one autocast dtype
CASES = [
    # lower-precision list
    ("mm", torch.mm, lambda d: (_r(N, N), _r(N, N))),
    ("bmm", torch.bmm, lambda d: (_r(2, N, N), _r(2, N, N))),
    ("matmul", torch.matmul, lambda d: (_r(2, N, N), _r(N, N))),
    ("addmm", torch.addmm, lambda d: (_r(N, N), _r(N, N), _r(N, N))),
    ("baddbmm", torch.baddbmm, lambda d: (_r(2, N, N), _r(2, N, N), _r(2, N, N))),
    ("addbmm", torch.addbmm, lambda d: (_r(N, N), _r(2, N, N), _r(2, N, N))),
    ("linear", F.linear, lambda d: (_r(3, N), _r(4, N), _r(4))),
    ("conv1d", F.conv1d, lambda d: (_r(1, 2, 8), _r(3, 2, 3))),
    ("conv2d", F.conv2d, lambda d: (_r(1, 2, 6, 6), _r(3, 2, 3, 3), _r(3))),
    ("conv_transpose2d", F.conv_transpose2d, lambda d: (_r(1, 2, 5, 5), _r(2, 3, 3, 3))),
    ("prelu", F.prelu, lambda d: (_r(2, 3, 4), _r(3))),
    ("sdpa", F.scaled_dot_product_attention, lambda d: (_r(1, 2, 4, 8), _r(1, 2, 4, 8), _r(1, 2, 4, 8))),
    # float32 list (low-precision inputs come back float32)
    ("mse_loss", F.mse_loss, lambda d: (_r(N, N, dtype=d), _r(N, N, dtype=d))),
    ("l1_loss", F.l1_loss, lambda d: (_r(N, N, dtype=d), _r(N, N, dtype=d))),
    ("smooth_l1_loss", F.smooth_l1_loss, lambda d: (_r(N, N, dtype=d), _r(N, N, dtype=d))),
    ("huber_loss", F.huber_loss, lambda d: (_r(N, N, dtype=d), _r(N, N, dtype=d))),
    ("cross_entropy", F.cross_entropy, lambda d: (_r(4, N, dtype=d), torch.tensor([1, 0, 7, 3]))),
    ("nll_loss", F.nll_loss, lambda d: (_r(4, N, dtype=d), torch.tensor([1, 0, 7, 3]))),
    (
        "kl_div",
        lambda a, b: F.kl_div(a, b, reduction="batchmean"),
        lambda d: (_r(4, N, dtype=d), torch.softmax(_r(4, N), -1).to(d)),
    ),
    (
        "bce_with_logits",
        F.binary_cross_entropy_with_logits,
        lambda d: (_r(N, dtype=d), torch.rand(N, generator=_GEN).to(d)),
    ),
    (
        "bce",
        F.binary_cross_entropy,
        lambda d: (torch.rand(N, generator=_GEN).to(d), torch.rand(N, generator=_GEN).to(d)),
    ),
    ("prod", torch.prod, lambda d: (_r(N, dtype=d),)),
    ("prod_dim", lambda x: torch.prod(x, 1), lambda d: (_r(3, 4, dtype=d),)),
    ("cdist", torch.cdist, lambda d: (_r(3, 4, dtype=d), _r(5, 4, dtype=d))),
    ("trace", torch.trace, lambda d: (_r(4, 4, dtype=d),)),
    ("fft_rfft", torch.fft.rfft, lambda d: (_r(N, dtype=d),)),
    ("linalg_inv", torch.linalg.inv, lambda d: ((_r(3, 3) + 4 * torch.eye(3)).to(d),)),
    ("linalg_solve", torch.linalg.solve, lambda d: ((_r(3, 3) + 4 * torch.eye(3)).to(d), _r(3, 2, dtype=d))),
    ("avg_pool3d", lambda x: F.avg_pool3d(x, 2), lambda d: (_r(1, 1, 4, 4, 4, dtype=d),)),
    ("reflection_pad1d", lambda x: F.pad(x, (2, 2), mode="reflect"), lambda d: (_r(1, 2, 5, dtype=d),)),
    ("replication_pad2d", lambda x: F.pad(x, (1, 1, 1, 1), mode="replicate"), lambda d: (_r(1, 2, 4, 4, dtype=d),)),
    # promote list: the widest floating type among the arguments
    ("cat", lambda a, b: torch.cat([a, b]), lambda d: (_r(N, dtype=d), _r(N))),
    ("stack", lambda a, b: torch.stack([a, b]), lambda d: (_r(N, dtype=d), _r(N))),
    ("cat_low", lambda a, b: torch.cat([a, b]), lambda d: (_r(N, dtype=d), _r(N, dtype=d))),
    (
        "index_copy",
        lambda a, i, s: a.index_copy(0, i, s),
        lambda d: (_r(4, 3, dtype=d), torch.tensor([0, 2]), _r(2, 3)),
    ),
    # unlisted ops: unchanged dtypes
    ("softmax", lambda x: torch.softmax(x, -1), lambda d: (_r(3, N),)),
    ("add_mixed", torch.add, lambda d: (_r(N), _r(N, dtype=d))),
    ("sum_low", torch.sum, lambda d: (_r(N, dtype=d),)),
]


def _to(x, device):
    return x.to(device) if isinstance(x, torch.Tensor) else x


def _tol(dtype: torch.dtype) -> dict:
    return {torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2), torch.float16: dict(rtol=1e-3, atol=1e-3)}.get(
        dtype, dict(rtol=1e-5, atol=1e-5)
    )


@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "fp16"])
@pytest.mark.parametrize("name,fn,make", CASES, ids=[c[0] for c in CASES])
def test_op_dtype_and_value_match_cpu_autocast(name, fn, make, dtype):
    args = make(dtype)
    with torch.autocast("cpu", dtype=dtype):
        want = fn(*args)
    with torch.autocast("jax", dtype=dtype):
        got = fn(*[_to(a, "jax") for a in args])
    want = want if isinstance(want, torch.Tensor) else want[0]
    got = got if isinstance(got, torch.Tensor) else got[0]
    assert got.device.type == "jax"
    assert got.dtype == want.dtype, (name, got.dtype, want.dtype)
    torch.testing.assert_close(got.cpu(), want, **_tol(want.dtype))


def test_policy_covers_exactly_the_ops_torch_autocasts_on_cpu():
    """Every op with a CPU autocast kernel in this torch has a policy here, and no other but the
    recurrent ops jaxtorch runs whole (CPU torch casts them through their decomposition)."""
    names = torch._C._dispatch_get_all_op_names()
    cpu = {n for n in names if torch._C._dispatch_has_kernel_for_dispatch_key(n, "AutocastCPU")}
    recurrent = {f"aten::{n}" for n in _autocast.RECURRENT_LOWER + _autocast.RECURRENT_LSTM}
    assert not recurrent & cpu
    ours = set(_autocast.policy_of())
    assert ours == cpu | recurrent, (sorted(cpu - ours), sorted(ours - cpu - recurrent))
    jax = {n for n in names if torch._C._dispatch_has_kernel_for_dispatch_key(n, "AutocastPrivateUse1")}
    assert jax == cpu | recurrent


def test_supported_dtypes_and_bad_dtype_warns_and_disables():
    assert torch.jax.get_amp_supported_dtype() == [torch.bfloat16, torch.float16]
    a = torch.randn(2, 2, device="jax")
    with pytest.warns(UserWarning, match="jax Autocast only supports"):
        with torch.autocast("jax", dtype=torch.float64):
            assert a.mm(a).dtype == torch.float32  # disabled, as torch does


def test_nested_disable_and_other_devices_untouched():
    a = torch.randn(3, 3, device="jax")
    c = torch.randn(3, 3)
    with torch.autocast("jax", dtype=torch.bfloat16):
        assert (a @ a).dtype == torch.bfloat16
        assert (c @ c).dtype == torch.float32  # CPU tensors: the jax autocast does not apply
        with torch.autocast("jax", enabled=False):
            assert (a @ a).dtype == torch.float32
        assert torch.is_autocast_enabled("jax") and not torch.is_autocast_enabled("cpu")
    assert (a @ a).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert (a @ a).dtype == torch.float32  # CPU autocast does not touch the jax device


def test_promote_mixing_both_low_dtypes_raises_as_torch():
    a = torch.randn(2, dtype=torch.float16)
    b = torch.randn(2, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch.cat([a, b])
    with pytest.raises(RuntimeError, match="prioritize"):
        with torch.autocast("jax", dtype=torch.bfloat16):
            torch.cat([a.to("jax"), b.to("jax")])


def test_gradients_reach_float32_weights_in_float32():
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)
    jlin = torch.nn.Linear(4, 3).to("jax")
    jlin.load_state_dict(lin.state_dict())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(x)
    with torch.autocast("jax", dtype=torch.bfloat16):
        jy = jlin(x.to("jax"))
    assert jy.dtype == y.dtype == torch.bfloat16
    y.float().square().sum().backward()
    jy.float().square().sum().backward()
    assert jlin.weight.grad.dtype == torch.float32
    torch.testing.assert_close(jlin.weight.grad.cpu(), lin.weight.grad, rtol=1.6e-2, atol=1e-2)


def test_compiled_program_follows_the_autocast_state():
    """A compiled function traced without autocast is not reused under it (and vice versa)."""

    @jaxtorch.jit
    def f(x):
        return torch.mm(x, x)

    x = torch.randn(4, 4, device="jax")
    assert f(x).dtype == torch.float32
    with torch.autocast("jax", dtype=torch.bfloat16):
        assert f(x).dtype == torch.bfloat16
    with torch.autocast("jax", dtype=torch.float16):
        assert f(x).dtype == torch.float16
    assert f(x).dtype == torch.float32
    assert f.compilations == 3


def test_lazy_mode():
    a = torch.randn(4, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = F.mse_loss(a @ a, a)
    with jaxtorch.lazy(), torch.autocast("jax", dtype=torch.bfloat16):
        ja = a.to("jax")
        mm = ja @ ja
        got = F.mse_loss(mm, ja)
        assert mm.dtype == torch.bfloat16 and got.dtype == torch.float32
    torch.testing.assert_close(got.cpu(), want, rtol=1.6e-2, atol=1e-2)


# ---- a tiny Llama train step (forward + backward) ------------------------------------------
@pytest.fixture(scope="module")
def llama_pair():
    torch.manual_seed(0)
    cfg = tiny_llama_config(max_position_embeddings=32, attn_implementation="sdpa")
    cpu = transformers.LlamaForCausalLM(cfg).train()
    jx = transformers.LlamaForCausalLM(cfg).train()
    jx.load_state_dict(cpu.state_dict())
    jaxtorch.enable_globally()  # (HF's factories with device="jax", such as `arange`, need the modes)
    yield cpu, jx.to("jax")
    jaxtorch.disable_globally()


def _step(model, ids, device, dtype):
    model.zero_grad()
    with torch.autocast(device, dtype=dtype):
        out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.detach().cpu(), {n: p.grad.cpu() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=["bf16"])
def test_llama_train_step_matches_cpu_autocast(llama_pair, dtype):
    cpu, jx = llama_pair
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    loss, grads = _step(cpu, ids, "cpu", dtype)
    jloss, jgrads = _step(jx, ids.to("jax"), "jax", dtype)
    tol = _tol(dtype)
    torch.testing.assert_close(jloss, loss, **tol)
    for n, g in grads.items():
        assert jgrads[n].dtype == g.dtype == torch.float32
        scale = g.abs().max().clamp_min(1e-3)  # gradients of bf16/fp16 matmuls: relative to the largest entry
        torch.testing.assert_close(jgrads[n] / scale, g / scale, **tol, msg=n)


def test_autocast_is_thread_local():
    import threading

    a = torch.randn(3, 3, device="jax")
    seen = []
    with torch.autocast("jax", dtype=torch.bfloat16):
        t = threading.Thread(target=lambda: seen.append((a @ a).dtype))
        t.start()
        t.join()
        assert (a @ a).dtype == torch.bfloat16
    assert seen == [torch.float32]
