"""Loading onto the jax device (issue 31, item 5): `from_pretrained(path, device_map="jax")`.

A tiny Llama with random weights is saved with `save_pretrained` (one file, and shards) into a
temporary directory; each load onto the jax device (with and without `enable_globally()`,
`"jax"` / `{"": "jax"}`, bfloat16 from the float32 file) must give `JaxTensor` parameters and
buffers on the jax device and the CPU-loaded model's logits and gradients. Factories "like" a
meta tensor (`empty_like`, `new_zeros`, ...) onto the jax device read only its shape and dtype;
every other op given a meta tensor raises `MetaTensorError`. The peak host memory of these loads
is measured by `benchmarks/device_map.py`.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import jaxtorch
from jaxtorch.bridge.tensor._tensor import JaxTensor
from tests._dtypes import enable_x64
from tests._hf_models import tiny_llama
from tests.test_readme import python_blocks

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
IDS = torch.tensor([[1, 5, 9, 2, 33, 7]])


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A tiny float32 Llama saved as one file (`single/`) and as shards (`sharded/`)."""
    transformers.logging.disable_progress_bar()
    torch.manual_seed(0)
    model = tiny_llama(tie_word_embeddings=False)
    d = tmp_path_factory.mktemp("device_map")
    model.save_pretrained(d / "single")
    model.save_pretrained(d / "sharded", max_shard_size="40KB")
    assert (d / "sharded" / "model.safetensors.index.json").exists()
    assert len(list((d / "sharded").glob("*.safetensors"))) > 1
    return d


@pytest.fixture(scope="module")
def reference(saved):
    """The CPU-loaded model: its logits and the gradients of its loss."""
    model = transformers.LlamaForCausalLM.from_pretrained(saved / "single").eval()
    out = model(IDS, labels=IDS)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture(params=[False, True], ids=["plain", "enable_globally"])
def globally(request):
    """Each test with and without `jaxtorch.enable_globally()` (turned off again after it)."""
    if request.param:
        jaxtorch.enable_globally()
    yield request.param
    if request.param:
        jaxtorch.disable_globally()


def _assert_on_jax(model: torch.nn.Module) -> None:
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        assert isinstance(t, JaxTensor) and t.device.type == "jax", f"{name}: {type(t).__name__} on {t.device}"
    assert all(isinstance(p, torch.nn.Parameter) for p in model.parameters())


@pytest.mark.parametrize("checkpoint", ["single", "sharded"])
@pytest.mark.parametrize("device_map", ["jax", {"": "jax"}], ids=["jax", "dict"])
def test_loaded_onto_jax_matches_the_cpu_load(saved, reference, globally, checkpoint, device_map):
    model = transformers.LlamaForCausalLM.from_pretrained(saved / checkpoint, device_map=device_map).eval()
    _assert_on_jax(model)
    out = model(IDS.to("jax"), labels=IDS.to("jax"))
    out.loss.backward()
    logits, grads = reference
    torch.testing.assert_close(out.logits.detach().cpu(), logits)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.cpu(), grads[name], msg=lambda m, name=name: f"{name}: {m}")


def test_bfloat16_from_a_float32_file(saved, globally):
    cpu = transformers.LlamaForCausalLM.from_pretrained(saved / "single", dtype=torch.bfloat16).eval()
    model = transformers.LlamaForCausalLM.from_pretrained(
        saved / "single", device_map="jax", dtype=torch.bfloat16
    ).eval()
    _assert_on_jax(model)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    for (name, p), q in zip(model.named_parameters(), cpu.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
    for (name, b), c in zip(model.named_buffers(), cpu.buffers()):  # rotary inv_freq, computed on each device
        torch.testing.assert_close(b.cpu(), c, msg=lambda m, n=name: f"{n}: {m}")
    moved = copy.deepcopy(cpu).to("jax")  # the same weights, loaded on the CPU first: the same program
    torch.testing.assert_close(model(IDS.to("jax")).logits.cpu(), moved(IDS.to("jax")).logits.cpu(), rtol=0, atol=0)


@pytest.fixture(scope="module")
def saved_float64(tmp_path_factory) -> Path:
    """The tiny Llama saved in float64."""
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("device_map_float64")
    tiny_llama(tie_word_embeddings=False).double().save_pretrained(d)
    return d


def test_a_float64_file_raises_float64_error_without_x64(saved_float64, globally):
    """A float64 checkpoint loaded onto the jax device is float64 data: `Float64Error`, never float32."""
    for dtype in ("auto", torch.float64):
        with pytest.raises(jaxtorch.Float64Error, match="jax_enable_x64"):
            transformers.LlamaForCausalLM.from_pretrained(saved_float64, device_map="jax", dtype=dtype)


def test_a_float64_file_with_x64_is_float64(saved_float64):
    cpu = transformers.LlamaForCausalLM.from_pretrained(saved_float64, dtype="auto").eval()
    with enable_x64():
        model = transformers.LlamaForCausalLM.from_pretrained(saved_float64, device_map="jax", dtype="auto").eval()
        _assert_on_jax(model)
        assert {p.dtype for p in model.parameters()} == {torch.float64}
        logits = model(IDS.to("jax")).logits.cpu()
    torch.testing.assert_close(logits, cpu(IDS).logits)


# ---- factories like a meta tensor, and every other op on one ----------------------------------
_META = dict(size=(2, 3), dtype=torch.bfloat16)
_LIKES = {
    "empty_like": lambda t, **d: torch.empty_like(t, **d),
    "zeros_like": lambda t, **d: torch.zeros_like(t, **d),
    "ones_like_float32": lambda t, **d: torch.ones_like(t, dtype=torch.float32, **d),
    "full_like": lambda t, **d: torch.full_like(t, 2.5, **d),
    "rand_like": lambda t, **d: torch.rand_like(t, **d),
    "randn_like": lambda t, **d: torch.randn_like(t, **d),
    "randint_like": lambda t, **d: torch.randint_like(t, 10, **d),
    "randint_like_low": lambda t, **d: torch.randint_like(t, 3, 10, **d),
    "new_empty": lambda t, **d: t.new_empty((4,), **d),
    "new_zeros": lambda t, **d: t.new_zeros((4, 1), **d),
    "new_ones_int": lambda t, **d: t.new_ones((4,), dtype=torch.int32, **d),
    "new_full": lambda t, **d: t.new_full((4,), 7, **d),
    "new_empty_strided": lambda t, **d: t.new_empty_strided((2, 2), (2, 1), **d),
}
_DETERMINISTIC = {"zeros_like", "ones_like_float32", "full_like", "new_zeros", "new_ones_int", "new_full"}


@pytest.mark.parametrize("name", list(_LIKES))
def test_a_factory_like_a_meta_tensor_reads_only_its_shape_and_dtype(name, globally):
    like = _LIKES[name]
    meta = torch.empty(*_META["size"], dtype=_META["dtype"], device="meta")
    out = like(meta, device="jax")
    expected = like(torch.zeros(*_META["size"], dtype=_META["dtype"]))  # CPU torch, from a tensor with data
    assert isinstance(out, JaxTensor) and out.device.type == "jax"
    assert (out.shape, out.dtype) == (expected.shape, expected.dtype)
    if name in _DETERMINISTIC:
        torch.testing.assert_close(out.cpu(), expected, rtol=0, atol=0)
    elif name.startswith("rand"):
        values = out.cpu().float()
        low, high = {"rand_like": (0, 1), "randint_like": (0, 9), "randint_like_low": (3, 9)}.get(name, (-10, 10))
        assert bool((values >= low).all() and (values <= high).all()), values


def test_to_empty_of_a_meta_module_onto_jax(globally):
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    model.to_empty(device="jax")
    _assert_on_jax(model)
    assert [tuple(p.shape) for p in model.parameters()] == [(4, 3), (4,), (4,), (4,)]


_REFUSED = {
    "to_jax": lambda meta, x: meta.to("jax"),
    "module_to_jax": lambda meta, x: torch.nn.Linear(3, 2, device="meta").to("jax"),
    "add": lambda meta, x: x + meta,
    "mul_meta_first": lambda meta, x: meta * x,
    "copy_": lambda meta, x: x.copy_(meta),
    "matmul": lambda meta, x: x @ meta.T,
    "call_torch": lambda meta, x: jaxtorch.call_torch(lambda y: y + meta, x.jax()),
    "cat_in_call_torch": lambda meta, x: jaxtorch.call_torch(lambda y: torch.cat([y, meta]), x.jax()),
}


@pytest.mark.parametrize("case", list(_REFUSED))
def test_any_other_op_on_a_meta_tensor_raises_meta_tensor_error(case, globally):
    meta = torch.empty(2, 3, device="meta")
    x = torch.ones(2, 3).to("jax")
    with pytest.raises(jaxtorch.MetaTensorError) as e:
        _REFUSED[case](meta, x)
    message = str(e.value)
    assert "meta device" in message and "aten::" in message  # the op
    for way_out in ("to_empty(device='jax')", "jaxtorch.load_into", "device_map='jax'"):
        assert way_out in message
    assert isinstance(e.value, NotImplementedError)  # as torch's own "Cannot copy out of meta tensor"


def test_converting_a_meta_tensor_raises_meta_tensor_error():
    with pytest.raises(jaxtorch.MetaTensorError, match=r"conversion to a jax.Array.*meta device.*to_empty"):
        jaxtorch.to_jax(torch.empty(2, device="meta"))


def test_the_docs_example_runs_as_written(tmp_path):
    blocks = [code for _, code in python_blocks((ROOT / "docs" / "api" / "loading.md").read_text())]
    assert blocks
    for code in blocks:
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr[-3000:]
        assert not any(p.name.endswith(".safetensors") for p in tmp_path.rglob("*")), "the example wrote weights here"


@pytest.mark.parametrize(
    "source, target", [(torch.float32, torch.bfloat16), (torch.float64, torch.float32), (torch.float32, torch.float16)]
)
def test_a_move_with_a_cast_rounds_as_torch(source, target, globally):
    """`cpu_t.to("jax", dtype)` (a loader's `tensor.to(device=, dtype=)`) casts as CPU torch does,
    special values included; float64 sources too (cast on the host, never held by JAX)."""
    x = torch.randn(64, generator=torch.Generator().manual_seed(0), dtype=source) * 1e3
    x = torch.cat([x, torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, -0.0, 1e-40, 7e4], dtype=source)])
    out = x.to("jax", target)
    assert isinstance(out, JaxTensor) and out.dtype == target
    torch.testing.assert_close(out.cpu(), x.to(target), rtol=0, atol=0, equal_nan=True)
