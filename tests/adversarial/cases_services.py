"""Services torch code calls (issue 23 items 3-5): autocast, remat (activation checkpointing), saving."""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import jaxtorch

from .harness import case, close, equal, refuses_or

AUTOCAST_OPS = {
    "mm": lambda a, b: torch.mm(a, b),
    "matmul": lambda a, b: a @ b,
    "linear": lambda a, b: F.linear(a, b),
    "addmm": lambda a, b: torch.addmm(a[:, :1].expand(4, 4).contiguous(), a, b.t()),
    "bmm": lambda a, b: torch.bmm(a[None], b.t()[None]),
    "softmax": lambda a, b: torch.softmax(a, -1),
    "log_softmax": lambda a, b: F.log_softmax(a, -1),
    "layer_norm": lambda a, b: F.layer_norm(a, (4,)),
    "add": lambda a, b: a + b,
    "sum": lambda a, b: a.sum(),
    "exp": lambda a, b: a.exp(),
    "mm_then_add": lambda a, b: torch.mm(a, b.t()) + a,
    "cat_mixed": lambda a, b: torch.cat([torch.mm(a, b.t()), a]),
    "mse_loss": lambda a, b: F.mse_loss(a, b),
}

for _dtype_name, _dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
    for _name, _op in AUTOCAST_OPS.items():

        @case(f"autocast/{_dtype_name}/{_name}")
        def _autocast(op=_op, dtype=_dtype):
            torch.manual_seed(0)
            a, b = torch.randn(4, 4), torch.randn(4, 4)
            with torch.autocast("cpu", dtype=dtype):
                expected = op(a, b)
            with jaxtorch.default_env():
                ja, jb = a.to("jax"), b.to("jax")
                with torch.autocast("jax", dtype=dtype):
                    got = op(ja, jb)
                assert got.dtype == expected.dtype, (got.dtype, expected.dtype)
                got = got.cpu()
            close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


for _reentrant in (True, False):

    @case(f"remat/eager/reentrant={_reentrant}")
    def _ckpt(use_reentrant=_reentrant):
        torch.manual_seed(0)
        block = _Block()
        x = torch.randn(3, 4, requires_grad=True)
        block(x).sum().backward()
        expected = [p.grad.clone() for p in block.parameters()]
        block.zero_grad()
        with jaxtorch.default_env():
            block.to("jax")
            xj = x.detach().to("jax").requires_grad_(True)
            checkpoint(block, xj, use_reentrant=use_reentrant).sum().backward()
            got = [p.grad.cpu() for p in block.parameters()]
            block.to("cpu")
        for g, e in zip(got, expected):
            close(g, e)

    @case(f"remat/jaxtorch_jit/reentrant={_reentrant}")
    def _ckpt_jit(use_reentrant=_reentrant):
        torch.manual_seed(0)
        block = _Block()
        x = torch.randn(3, 4, requires_grad=True)  # (reentrant remat needs an input that requires grad)
        expected = torch.autograd.grad(block(x).sum(), list(block.parameters()))

        @jaxtorch.jit
        def f(x):
            return checkpoint(block, x, use_reentrant=use_reentrant).sum()

        block.zero_grad()
        f(x).backward()
        for p, e in zip(block.parameters(), expected):
            close(p.grad, e)


def _jax_state_dict():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    cpu = {k: v.clone() for k, v in m.state_dict().items()}
    with jaxtorch.default_env():
        m.to("jax")
    return m, cpu


@case("saving/torch_save_load_without_jaxtorch")
def _save_subprocess(tmp=None):
    import tempfile

    m, cpu = _jax_state_dict()
    with tempfile.TemporaryDirectory() as d:
        path = f"{d}/sd.pt"
        torch.save(m.state_dict(), path)
        code = textwrap.dedent(f"""
            import sys, torch
            sd = torch.load({path!r}, map_location="cpu", weights_only=True)
            assert "jaxtorch" not in sys.modules
            torch.save({{k: v.clone() for k, v in sd.items()}}, {path!r} + ".cpu")
        """)
        subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=120)
        back = torch.load(path + ".cpu", weights_only=True)
    assert set(back) == set(cpu)
    for k in cpu:
        equal(back[k], cpu[k])


@case("saving/torch_load_map_location_jax")
def _save_jax():
    m, cpu = _jax_state_dict()
    buf = io.BytesIO()
    torch.save(m.state_dict(), buf)
    buf.seek(0)
    with jaxtorch.default_env():
        sd = torch.load(buf, map_location="jax", weights_only=True)
        assert all(v.device.type == "jax" for v in sd.values())
        back = {k: v.cpu() for k, v in sd.items()}
    for k in cpu:
        equal(back[k], cpu[k])


@case("saving/safetensors_save_file")
def _safetensors():
    import tempfile

    from safetensors.torch import load_file, save_file

    m, cpu = _jax_state_dict()
    with tempfile.TemporaryDirectory() as d:
        save_file(dict(m.state_dict()), f"{d}/m.safetensors")
        back = load_file(f"{d}/m.safetensors")
    for k in cpu:
        equal(back[k], cpu[k])


@case("saving/data_ptr_honest")
def _data_ptr():
    with jaxtorch.default_env():
        t = torch.ones(4, device="jax")

        def check():
            assert t.untyped_storage().nbytes() == 16, t.untyped_storage().nbytes()
            assert t.data_ptr() != 0

        refuses_or(check, "data_ptr", "storage", "jax")


@case("saving/int32_buffer_dtype_survives_save")
def _int32_save():
    m = nn.Module()
    m.register_buffer("ids", torch.arange(3, dtype=torch.int32))
    with jaxtorch.default_env():
        m.to("jax")
    buf = io.BytesIO()
    torch.save(m.state_dict(), buf)
    buf.seek(0)
    back = torch.load(buf, map_location="cpu", weights_only=True)
    equal(back["ids"], torch.arange(3, dtype=torch.int32))
