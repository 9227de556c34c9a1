"""Saving and loading jax-device tensors: `torch.save`/`torch.load`, safetensors, Hugging Face.

A saved jax tensor is a CPU tensor in the file (torch's own rebuild functions): it loads in a
process without jaxtorch (`weights_only=True`), `torch.load` gives CPU tensors, and
`map_location="jax"` gives jax tensors.
"""

from __future__ import annotations

import copy
import io
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch
import transformers
from safetensors.torch import load_file, load_model, save_file, save_model

import jaxtorch
from jaxtorch.bridge.tensor._tensor import JaxTensor

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.int8, torch.bool]


def _sample(dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.rand(3, 4, generator=g) > 0.5
    if dtype.is_floating_point:
        return torch.randn(3, 4, generator=g).to(dtype)
    return torch.randint(-100, 100, (3, 4), generator=g).to(dtype)


def _saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_torch_save_load_round_trip(dtype):
    jt = _sample(dtype).to("jax")
    dtype = jt.dtype  # (what the jax tensor claims is what is saved)
    cpu = _sample(dtype).to(dtype)
    data = _saved({"t": jt, "view": jt[1:, ::2]})
    plain = torch.load(io.BytesIO(data), weights_only=True)
    assert plain["t"].device.type == "cpu" and type(plain["t"]) is torch.Tensor
    assert plain["t"].dtype == dtype and torch.equal(plain["t"], cpu)
    assert torch.equal(plain["view"], cpu[1:, ::2])
    on_jax = torch.load(io.BytesIO(data), map_location="jax", weights_only=True)
    assert isinstance(on_jax["t"], JaxTensor) and on_jax["t"].device.type == "jax"
    assert on_jax["t"].dtype == dtype and torch.equal(on_jax["t"].cpu(), cpu)
    assert torch.equal(on_jax["view"].cpu(), cpu[1:, ::2])
    assert (on_jax["t"] + on_jax["t"]).device.type == "jax"  # a working jax tensor


def test_state_dict_loads_in_a_process_without_jaxtorch(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)).to("jax")
    path = tmp_path / "sd.pt"
    torch.save(model.state_dict(), path)
    want = {k: v.cpu() for k, v in model.state_dict().items()}
    torch.save(want, tmp_path / "want.pt")
    script = textwrap.dedent(
        f"""
        import sys, torch
        for kw in ({{"map_location": "cpu"}}, {{}}):
            sd = torch.load({str(path)!r}, weights_only=True, **kw)
            want = torch.load({str(tmp_path / "want.pt")!r}, weights_only=True)
            assert list(sd) == list(want), (list(sd), list(want))
            for k in sd:
                assert type(sd[k]) is torch.Tensor and sd[k].device.type == "cpu", k
                assert sd[k].dtype == want[k].dtype and torch.equal(sd[k], want[k]), k
        assert "jaxtorch" not in sys.modules and "jax" not in sys.modules
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_load_state_dict_into_jax_model_both_ways():
    torch.manual_seed(0)
    src = torch.nn.Linear(3, 4).to("jax")
    data = _saved(src.state_dict())
    for kw in ({}, {"map_location": "jax"}):
        dst = torch.nn.Linear(3, 4).to("jax")
        dst.load_state_dict(torch.load(io.BytesIO(data), weights_only=True, **kw))
        assert dst.weight.device.type == "jax"
        assert torch.equal(dst.weight.cpu(), src.weight.cpu()) and torch.equal(dst.bias.cpu(), src.bias.cpu())


def test_parameters_keep_requires_grad_and_aliases_share_one_record():
    p = torch.nn.Parameter(torch.randn(2, 2).to("jax"))
    data = _saved({"a": p, "b": p})
    out = torch.load(io.BytesIO(data), map_location="jax", weights_only=True)
    assert isinstance(out["a"], torch.nn.Parameter) and out["a"].requires_grad
    assert out["a"] is out["b"]  # one object saved once, loaded once
    assert torch.equal(out["a"].detach().cpu(), p.detach().cpu())


def test_plain_pickle_gives_cpu_values_and_tolist_works():
    t = torch.arange(6.0).reshape(2, 3).to("jax")
    back = pickle.loads(pickle.dumps(t))
    assert back.device.type == "cpu" and back.tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    back = torch.load(io.BytesIO(_saved(t)), weights_only=False)
    assert back.device.type == "cpu" and back.tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]


def test_saving_a_traced_tensor_raises():
    @jaxtorch.jit
    def f(x):
        torch.save(x * 2, io.BytesIO())
        return x

    with pytest.raises(Exception, match="(?i)trace|concrete|data-dependent"):
        f(torch.ones(2, device="jax"))


def test_storage_queries_are_honest():
    a = torch.randn(4, 5).to("jax")
    b = torch.randn(4, 5).to("jax")
    s = a.untyped_storage()
    assert s.nbytes() == 4 * 5 * 4  # the data's size (not a 2**40 placeholder)
    assert a.data_ptr() != 0 and a.data_ptr() == s.data_ptr()
    assert a.detach().data_ptr() == a.data_ptr()  # aliases share their root's identity
    assert a.detach().untyped_storage().data_ptr() == s.data_ptr()
    assert b.data_ptr() != a.data_ptr()  # distinct arrays, distinct identities
    assert a.untyped_storage().data_ptr() == s.data_ptr()  # stable
    assert torch.empty(0, device="jax").data_ptr() == 0
    c = copy.deepcopy(a)  # deepcopy clones (a new root), as for any wrapper tensor
    assert isinstance(c, JaxTensor) and torch.equal(c.cpu(), a.cpu()) and c.data_ptr() != a.data_ptr()


def test_deepcopy_of_module_is_independent_with_parameters_as_cpu_torch():
    cpu = torch.nn.Linear(2, 2)
    m = copy.deepcopy(cpu).to("jax")
    for module, x in ((cpu, torch.ones(1, 2)), (m, torch.ones(1, 2, device="jax"))):
        module(x).sum().backward()
    cpu2, m2 = copy.deepcopy(cpu), copy.deepcopy(m)
    # `Parameter.__deepcopy__`: a new Parameter, same requires_grad, no grad (torch's rule)
    assert isinstance(m2.weight, torch.nn.Parameter) and m2.weight.requires_grad
    assert (m2.weight.grad is None) == (cpu2.weight.grad is None)
    with torch.no_grad():
        m2.weight.add_(1)
    assert not torch.equal(m2.weight.cpu(), m.weight.cpu())


# ---- safetensors ----------------------------------------------------------------------------
def test_safetensors_save_file_load_file(tmp_path):
    tensors = {str(d): _sample(d).to("jax") for d in DTYPES}
    save_file(tensors, tmp_path / "t.safetensors")
    back = load_file(tmp_path / "t.safetensors")
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v.cpu()), k


def test_safetensors_refuses_shared_tensors_as_on_cpu(tmp_path):
    w = torch.randn(3, 3)
    with pytest.raises(RuntimeError, match="share memory"):
        save_file({"a": w, "b": w}, tmp_path / "cpu.safetensors")
    jw = w.to("jax")
    with pytest.raises(RuntimeError, match="share memory"):
        save_file({"a": jw, "b": jw.detach()}, tmp_path / "jax.safetensors")


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(5, 3)
        self.head = torch.nn.Linear(3, 5, bias=False)
        self.head.weight = self.emb.weight


def test_safetensors_save_model_load_model_with_tied_weights(tmp_path):
    torch.manual_seed(0)
    m = Tied().to("jax")
    save_model(m, tmp_path / "m.safetensors")
    m2 = Tied().to("jax")
    missing, unexpected = load_model(m2, tmp_path / "m.safetensors")
    assert not unexpected
    assert torch.equal(m2.emb.weight.cpu(), m.emb.weight.cpu()) and m2.head.weight is m2.emb.weight


# ---- Hugging Face ---------------------------------------------------------------------------
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_save_pretrained_from_pretrained_round_trip(tmp_path, tie):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        num_hidden_layers=1,
        hidden_size=16,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=32,
        vocab_size=32,
        tie_word_embeddings=tie,
    )
    model = transformers.LlamaForCausalLM(cfg).to("jax")
    with torch.no_grad():  # a weight changed on the jax device must be what is saved
        model.model.norm.weight.add_(0.5)
    model.save_pretrained(tmp_path)
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    want = {k: v.cpu() for k, v in model.state_dict().items()}
    got = back.state_dict()
    assert set(got) == set(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    if tie:
        assert back.lm_head.weight is back.model.embed_tokens.weight


def test_map_location_jax_for_a_cpu_file_with_shared_storage_and_other_values():
    base = torch.arange(12.0).reshape(3, 4)
    data = _saved({"base": base, "row": base[1], "cols": base[:, 1:3], "meta": {"step": 3, "name": "x"}})
    for where in ("jax", torch.device("jax"), "jax:0"):
        out = torch.load(io.BytesIO(data), map_location=where, weights_only=True)
        assert out["meta"] == {"step": 3, "name": "x"}
        for k, want in (("base", base), ("row", base[1]), ("cols", base[:, 1:3])):
            assert isinstance(out[k], JaxTensor) and torch.equal(out[k].cpu(), want), (where, k)
