"""`jaxtorch.from_exported`: a `torch.export.ExportedProgram` as `(params, fn)` (issue 31 item 1).

Every result is compared with the program's own `ep.module()` (or the eager module) on the CPU:
tiny Hugging Face models (BERT, GPT-2, Llama; random weights) exported with a dynamic batch and
sequence length, run under `jax.jit` and through one `jax.export`ed program at several sizes; a
small MLP with BatchNorm in train mode (buffers written, `mutable=True`); gradients against torch's,
`no_grad` regions and `.detach()` included; and every refusal, with its error.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.utils._pytree as torch_pytree
from torch.export import Dim, export

import jaxtorch
from tests._hf_models import TINY_DECODER, tiny_llama

ROOT = Path(__file__).resolve().parents[2]


def _close(out, ref, atol=1e-5):
    """`out` (JAX pytree) equals `ref` (torch pytree) leaf by leaf."""
    leaves = jax.tree_util.tree_leaves(out)
    refs = [r.detach().numpy() for r in torch_pytree.tree_leaves(ref)]
    assert len(leaves) == len(refs)
    for a, r in zip(leaves, refs, strict=True):
        assert a.shape == r.shape
        np.testing.assert_allclose(np.asarray(a), r, atol=atol, rtol=1e-5)


# ---- Hugging Face models, dynamic batch and sequence ---------------------------------------
def _bert():
    import transformers

    cfg = transformers.BertConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64, vocab_size=64
    )
    return transformers.BertModel(cfg)


def _gpt2():
    import transformers

    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=64, use_cache=False)
    return transformers.GPT2LMHeadModel(cfg)  # its lm_head is tied to the token embedding


def _llama():
    return tiny_llama(use_cache=False)


def _inputs(name: str, batch: int, seq: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, TINY_DECODER["vocab_size"], (batch, seq), generator=g)
    if name != "bert":
        return {"input_ids": ids}
    mask = torch.ones(batch, seq, dtype=torch.int64)
    mask[0, seq // 2 :] = 0  # padding in the first row
    return {"input_ids": ids, "attention_mask": mask}


_MODELS = {"bert": _bert, "gpt2": _gpt2, "llama": _llama}


@pytest.fixture(scope="module", params=sorted(_MODELS))
def hf(request):
    """`(name, model, ep, params, fn)`, the model exported once with a dynamic batch and length."""
    pytest.importorskip("transformers")
    name = request.param
    torch.manual_seed(0)
    model = _MODELS[name]().eval()
    batch, seq = Dim("batch", min=1, max=8), Dim("seq", min=2, max=32)
    example = _inputs(name, 2, 8)
    ep = export(model, (), example, dynamic_shapes={k: {0: batch, 1: seq} for k in example})
    params, fn = jaxtorch.from_exported(ep)
    return name, model, ep, params, fn


def _jax(inputs: dict[str, torch.Tensor]) -> dict[str, jax.Array]:
    return {k: jnp.asarray(v.numpy(), jnp.int32) for k, v in inputs.items()}


def test_hf_params_and_state_split_as_extract(hf):
    name, model, _, params, fn = hf
    ref_params, ref_fn = jaxtorch.extract(model)
    assert set(params) == set(ref_params)  # tied weights once, under the same name
    assert set(fn.state) <= set(ref_fn.state)  # (a buffer the forward never reads is not in the program)
    for k, v in params.items():
        np.testing.assert_array_equal(np.asarray(v), np.asarray(ref_params[k]))
    if name == "gpt2":
        assert "transformer.wte.weight" in params and "lm_head.weight" not in params


def test_hf_under_jit_at_several_sizes(hf):
    name, _, ep, params, fn = hf
    run = jax.jit(fn)
    for batch, seq in [(1, 2), (3, 11)]:  # (the largest size: through jax.export below)
        inputs = _inputs(name, batch, seq, seed=batch)
        _close(run(params, **_jax(inputs)), ep.module()(**inputs))


def test_hf_one_jax_export_for_every_size_in_range(hf):
    name, _, ep, params, fn = hf
    specs = fn.kwarg_specs
    assert all(not isinstance(d, int) for s in specs.values() for d in s.shape)  # batch and length symbolic
    exp = jax.export.export(jax.jit(fn))(params, **specs)
    for batch, seq in [(1, 2), (2, 7), (8, 32)]:
        inputs = _inputs(name, batch, seq, seed=seq)
        _close(exp.call(params, **_jax(inputs)), ep.module()(**inputs))
    with pytest.raises(ValueError, match="constraint"):  # the program checks torch's ranges
        exp.call(params, **_jax(_inputs(name, 9, 4)))
    with pytest.raises(jaxtorch.ExportedInputError, match="outside the range"):
        fn(params, **_jax(_inputs(name, 2, 33)))


@pytest.mark.parametrize("hf", ["gpt2"], indirect=True)  # GPT-2: a tied weight's gradient sums both uses
def test_hf_gradient_matches_torch(hf):
    name, model, _, params, fn = hf
    inputs = _inputs(name, 2, 5)
    grads = jax.jit(jax.grad(lambda p: fn(p, **_jax(inputs)).logits.sum()))(params)
    model.zero_grad()
    model(**inputs).logits.sum().backward()
    for k, p in model.named_parameters():
        np.testing.assert_allclose(np.asarray(grads[k]), p.grad.numpy(), atol=2e-4, rtol=1e-4)


# ---- buffers: BatchNorm in train mode --------------------------------------------------------
class _MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 16)
        self.bn = torch.nn.BatchNorm1d(16)
        self.fc2 = torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


@pytest.fixture(scope="module")
def mlp_train():
    torch.manual_seed(0)
    model = _MLP().train()
    ep = export(model, (torch.randn(4, 6),), dynamic_shapes=({0: Dim("batch", min=2, max=32)},))
    params, fn = jaxtorch.from_exported(ep, mutable=True)
    return model, params, fn


def test_batchnorm_train_writes_its_statistics(mlp_train):
    model, params, fn = mlp_train
    assert set(params) == {"fc1.weight", "fc1.bias", "bn.weight", "bn.bias", "fc2.weight", "fc2.bias"}
    assert set(fn.state) == {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked"}
    state = fn.state
    twin = _MLP().train()
    twin.load_state_dict(model.state_dict())
    for step, batch in enumerate([5, 9]):
        x = np.random.default_rng(step).standard_normal((batch, 6)).astype(np.float32)
        out, state = jax.jit(fn)(params, jnp.asarray(x), state=state)
        _close(out, twin(torch.from_numpy(x)))
        for k, v in twin.named_buffers():
            np.testing.assert_allclose(np.asarray(state[k]), v.numpy(), atol=1e-6, rtol=1e-6)
    assert int(state["bn.num_batches_tracked"]) == 2


def test_batchnorm_train_gradient_matches_torch(mlp_train):
    model, params, fn = mlp_train
    x = np.random.default_rng(1).standard_normal((7, 6)).astype(np.float32)
    grads = jax.grad(lambda p: jnp.square(fn(p, jnp.asarray(x))[0]).sum())(params)
    twin = _MLP().train()
    twin.load_state_dict(model.state_dict())
    twin(torch.from_numpy(x)).square().sum().backward()
    for k, p in twin.named_parameters():
        np.testing.assert_allclose(np.asarray(grads[k]), p.grad.numpy(), atol=1e-5, rtol=1e-5)


def test_batchnorm_train_through_jax_export(mlp_train):
    model, params, fn = mlp_train
    exp = jax.export.export(jax.jit(fn))(params, *fn.input_specs, state=fn.state)
    for batch in (2, 13, 32):
        x = np.random.default_rng(batch).standard_normal((batch, 6)).astype(np.float32)
        twin = _MLP().train()
        twin.load_state_dict(model.state_dict())
        out, state = exp.call(params, jnp.asarray(x), state=fn.state)
        _close(out, twin(torch.from_numpy(x)))
        np.testing.assert_allclose(np.asarray(state["bn.running_var"]), twin.bn.running_var.numpy(), rtol=1e-6)


def test_a_written_buffer_that_is_also_returned():
    class Counter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("total", torch.zeros(2))

        def forward(self, x):
            self.total.add_(x)
            return self.total, x * 2  # one graph node: the buffer's new value and a user output

    model = Counter()
    params, fn = jaxtorch.from_exported(export(model, (torch.ones(2),)), mutable=True)
    (total, doubled), state = fn(params, jnp.array([1.0, 2.0]))
    ref_total, ref_doubled = model(torch.tensor([1.0, 2.0]))
    np.testing.assert_array_equal(np.asarray(total), ref_total.numpy())
    np.testing.assert_array_equal(np.asarray(doubled), ref_doubled.numpy())
    np.testing.assert_array_equal(np.asarray(state["total"]), model.total.numpy())


def test_buffer_writes_need_mutable():
    torch.manual_seed(0)
    ep = export(_MLP().train(), (torch.randn(4, 6),))
    with pytest.raises(jaxtorch.ExportedProgramError, match=r"mutable=True.*model\.eval"):
        jaxtorch.from_exported(ep)


# ---- torch's gradient cuts: no_grad regions, detach, writes under no_grad --------------------
class _Cuts(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3))
        self.register_buffer("ema", torch.zeros(3))

    def forward(self, x):
        h = x * self.w
        with torch.no_grad():
            h.mul_(2)  # h has new values and keeps its gradient (torch records no write)
            z = x * self.w * 3  # a constant
            self.ema.mul_(0.5).add_(self.w)  # a buffer: no gradient either
        d = (x * self.w).detach()
        return (h * z).sum() + (d * self.w).sum() + (self.ema * self.w).sum()


def test_no_grad_detach_and_writes_under_no_grad_keep_torchs_gradient():
    torch.manual_seed(0)
    model = _Cuts()
    x = torch.randn(3)
    params, fn = jaxtorch.from_exported(export(model, (x,)), mutable=True)
    twin = _Cuts()
    twin.load_state_dict(model.state_dict())
    out = twin(x)
    out.backward()
    value, state = jax.jit(fn)(params, jnp.asarray(x.numpy()))
    np.testing.assert_allclose(float(value), float(out.detach()), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(state["ema"]), twin.ema.numpy(), rtol=1e-6)
    grads = jax.grad(lambda p: fn(p, jnp.asarray(x.numpy()))[0])(params)
    np.testing.assert_allclose(np.asarray(grads["w"]), twin.w.grad.numpy(), rtol=1e-5)
    # (3 x^2 w + x w + w: a program decomposed without the marks gives 6 x^2 w + 2 x w + 2 w)


class _Frozen(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.lin.bias.requires_grad_(False)
        self.register_buffer("scale", torch.full((4,), 2.0), persistent=False)
        self.offset = torch.arange(4.0)  # a tensor constant (neither parameter nor buffer)

    def forward(self, x, flag=None, n=2):
        return self.lin(x) * self.scale * n + self.offset


def test_frozen_parameters_and_non_persistent_buffers_are_state_constants_are_the_functions():
    torch.manual_seed(0)
    model = _Frozen()
    x = torch.randn(3, 4)
    ep = export(model, (x,), {"n": 2})
    params, fn = jaxtorch.from_exported(ep)
    assert set(params) == {"lin.weight"}
    assert set(fn.state) == {"lin.bias", "scale"}
    _close(jax.jit(lambda p, x: fn(p, x, n=2))(params, jnp.asarray(x.numpy())), model(x, n=2))
    with pytest.raises(jaxtorch.ExportedInputError, match="static_argnames"):
        jax.jit(fn)(params, jnp.asarray(x.numpy()), n=2)  # n traced: not the constant 2
    grads = jax.grad(lambda p: fn(p, jnp.asarray(x.numpy()), n=2).sum())(params)
    model(x, n=2).sum().backward()
    np.testing.assert_allclose(np.asarray(grads["lin.weight"]), model.lin.weight.grad.numpy(), rtol=1e-5)
    with pytest.raises(jaxtorch.ExportedInputError, match="constant"):
        fn(params, jnp.asarray(x.numpy()), n=3)  # the program was specialized on n=2


def test_random_ops_draw_from_rng():
    class Drop(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.dropout(x, 0.5, training=True)

    params, fn = jaxtorch.from_exported(export(Drop(), (torch.ones(64, 64),)))
    with pytest.raises(jaxtorch.JaxtorchError, match="no PRNG key"):
        jax.jit(fn)(params, jnp.ones((64, 64)))
    a = jax.jit(fn)(params, jnp.ones((64, 64)), rng=jax.random.key(0))
    b = jax.jit(fn)(params, jnp.ones((64, 64)), rng=jax.random.key(1))
    assert set(np.unique(np.asarray(a))) == {0.0, 2.0}  # torch's scaling: kept values / (1 - p)
    assert 0.4 < float((a == 0).mean()) < 0.6 and not np.array_equal(a, b)


# ---- refusals ----------------------------------------------------------------------------------
def _program(forward, *args, **kwargs):
    module = type("M", (torch.nn.Module,), {"forward": forward})()
    return export(module, args, kwargs)


def test_refuses_programs_writing_their_inputs_or_parameters():
    def writes_input(self, x):
        x.add_(1)
        return x * 2

    with pytest.raises(jaxtorch.ExportedProgramError, match="writes its input `x`"):
        jaxtorch.from_exported(_program(writes_input, torch.randn(3)))

    class WritesParam(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(3))

        def forward(self, x):
            with torch.no_grad():
                self.w.mul_(0.5)
            return x * self.w

    ep = export(WritesParam(), (torch.randn(3),))
    with pytest.raises(jaxtorch.ExportedProgramError, match="writes its parameter `w`"):
        jaxtorch.from_exported(ep, mutable=True)


def test_refuses_data_dependent_sizes_and_values():
    with pytest.raises(jaxtorch.ExportedProgramError, match="depends on the data"):
        jaxtorch.from_exported(_program(lambda self, x: x[x > 0], torch.randn(5)))
    with pytest.raises(jaxtorch.ExportedProgramError, match="depends on the data"):
        jaxtorch.from_exported(_program(lambda self, x: x * x.max().item(), torch.randn(5)))


_COND_PROGRAM = """
import sys, torch
class M(torch.nn.Module):
    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda x: x + 1, lambda x: x - 1, (x,))
torch.export.save(torch.export.export(M(), (torch.randn(4),)), sys.argv[1])
"""


def test_refuses_higher_order_ops(tmp_path):
    # exported in a fresh process: in torch 2.13, once a torch.cond has run under a dispatch mode in a
    # process (tests/interop/test_control_flow.py does), dynamo refuses to export a torch.cond there
    path = tmp_path / "cond.pt2"
    subprocess.run([sys.executable, "-c", _COND_PROGRAM, str(path)], check=True, timeout=600)
    with pytest.raises(jaxtorch.ExportedProgramError, match="higher-order ops.*`cond`"):
        jaxtorch.from_exported(torch.export.load(path))


@torch.library.custom_op("jaxtorch_test_exported::first", mutates_args=())
def _first(x: torch.Tensor) -> torch.Tensor:
    return x + 1


@torch.library.custom_op("jaxtorch_test_exported::second", mutates_args=())
def _second(x: torch.Tensor) -> torch.Tensor:
    return x * 2


_first.register_fake(lambda x: torch.empty_like(x))
_second.register_fake(lambda x: torch.empty_like(x))


def test_names_every_op_without_a_lowering_at_once():
    ep = _program(lambda self, x: _second(_first(x)), torch.randn(3))
    with pytest.raises(jaxtorch.UnsupportedOpError) as info:
        jaxtorch.from_exported(ep)
    message = str(info.value)
    assert "2 op(s)" in message and "jaxtorch_test_exported.first" in message
    assert "jaxtorch_test_exported.second" in message


def test_refuses_what_is_not_an_exported_program():
    with pytest.raises(jaxtorch.ExportedProgramError, match="torch.export.export"):
        jaxtorch.from_exported(torch.nn.Linear(2, 2))


@pytest.fixture(scope="module")
def linear():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    ep = export(model, (torch.randn(3, 4),), dynamic_shapes=({0: Dim("b", min=2, max=16)},))
    return jaxtorch.from_exported(ep)


@pytest.mark.parametrize(
    "x, match",
    [
        (jnp.ones((3, 4), jnp.int32), "dtype int32; the program takes float32"),
        (jnp.ones((3, 4, 1)), "shape"),
        (jnp.ones((3, 5)), "fixed size 4"),
        (jnp.ones((1, 4)), r"outside the range \[2, 16\]"),
        (jnp.ones((17, 4)), r"outside the range \[2, 16\]"),
    ],
)
def test_refuses_arguments_that_do_not_fit(linear, x, match):
    params, fn = linear
    with pytest.raises(jaxtorch.ExportedInputError, match=match):
        fn(params, x)


def test_refuses_other_structures_foreign_symbolic_sizes_and_params(linear):
    params, fn = linear
    x = jnp.ones((3, 4))
    with pytest.raises(jaxtorch.ExportedInputError, match="structure"):
        fn(params, x, x)
    with pytest.raises(jaxtorch.ExportedInputError, match="keyword arguments"):
        fn(params, x, bias=x)
    (b,) = jax.export.symbolic_shape("b")
    with pytest.raises(jaxtorch.ExportedInputError, match="fn.input_specs"):
        jax.export.export(jax.jit(fn))(params, jax.ShapeDtypeStruct((b, 4), jnp.float32))
    with pytest.raises(jaxtorch.ParamsError, match="missing"):
        fn({"weight": params["weight"]}, x)
    assert fn(params, x).shape == (3, 2)


def test_docs_example_runs():
    source = (ROOT / "docs" / "api" / "exported.md").read_text()
    code = re.search(r"```python\n(.*?)```", source, re.S).group(1)
    exec(compile(code, "docs/api/exported.md", "exec"), {})


@pytest.mark.parametrize("bounds", [(0, None, 1), (1, None, 3), (None, 0, -2), (2, "2n", 1)])
def test_arange_of_symbolic_sizes_matches_numpy(bounds):
    from jaxtorch.ops.creation import arange

    def ends(n):
        start, end, step = bounds
        return (n if start is None else start), ({None: n, "2n": 2 * n}.get(end, end)), step

    exp = jax.export.export(jax.jit(lambda x: arange(*ends(x.shape[0]))))(
        jax.ShapeDtypeStruct(jax.export.symbolic_shape("n, 1", constraints=["n >= 3"]), jnp.float32)
    )
    for n in (3, 8):
        start, end, step = ends(n)
        np.testing.assert_array_equal(np.asarray(exp.call(jnp.ones((n, 1)))), np.arange(start, end, step))
