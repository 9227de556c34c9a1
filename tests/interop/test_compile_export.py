"""Torch-first compilation, export, custom ops and named scopes."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import torch

import jaxtorch


def test_compile_module_no_retrace_and_buffers_written_back():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU())
    ref = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU())
    ref.load_state_dict(model.state_dict())
    fast = jaxtorch.compile(model)
    for _ in range(4):
        x = torch.randn(6, 4)
        out = fast(x)
        np.testing.assert_allclose(out.detach().cpu().numpy(), ref(x).detach().numpy(), rtol=1e-5, atol=1e-6)
    assert fast.compilations == 1
    np.testing.assert_allclose(model[1].running_mean.numpy(), ref[1].running_mean.numpy(), rtol=1e-5, atol=1e-7)
    assert int(model[1].num_batches_tracked) == 4
    fast(torch.randn(3, 4))  # a new shape compiles once more
    assert fast.compilations == 2


def test_jit_decorator_static_args():
    @jaxtorch.jit
    def f(a, b, scale=2.0):
        return torch.relu(a @ b) * scale

    a, b = torch.randn(3, 4), torch.randn(4, 2)
    np.testing.assert_allclose(f(a, b).cpu().numpy(), (torch.relu(a @ b) * 2).numpy(), rtol=1e-6)
    f(a, b)
    assert f.compilations == 1
    f(a, b, scale=3.0)
    assert f.compilations == 2


def test_export_reloads_in_a_fresh_process_without_torch(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2)).eval()
    exp = jaxtorch.export(model, torch.randn(3, 4), batch_dim=True)
    path = tmp_path / "model.bin"
    path.write_bytes(exp.serialize())
    x = np.random.default_rng(0).standard_normal((7, 4)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    script = textwrap.dedent(f"""
        import sys, numpy as np, jax
        exp = jax.export.deserialize(open({str(path)!r}, "rb").read())
        y = exp.call(np.load({str(tmp_path / "x.npy")!r}))
        assert "torch" not in sys.modules and "jaxtorch" not in sys.modules
        np.save({str(tmp_path / "y.npy")!r}, np.asarray(y))
    """)
    subprocess.run([sys.executable, "-c", script], check=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    y = np.load(tmp_path / "y.npy")
    np.testing.assert_allclose(y, model(torch.from_numpy(x)).detach().numpy(), rtol=1e-5, atol=1e-6)


def test_export_with_params_passed_in():
    model = torch.nn.Linear(4, 2)
    exp = jaxtorch.export(model, torch.randn(3, 4), embed_params=False)
    params, _ = jaxtorch.extract(model)
    x = torch.randn(3, 4)
    np.testing.assert_allclose(np.asarray(exp.call(params, jaxtorch.to_jax(x))), model(x).detach().numpy(), rtol=1e-6)


def test_register_custom_op_with_custom_vjp():
    lib = torch.library.Library("jaxtorch_interop_test", "DEF")
    lib.define("scaled_sin(Tensor x) -> Tensor")
    lib.impl("scaled_sin", lambda x: torch.sin(x) * 2, "CPU")

    @jax.custom_vjp
    def scaled_sin(x):
        return jnp.sin(x) * 2

    scaled_sin.defvjp(lambda x: (scaled_sin(x), x), lambda x, g: (g * 2 * jnp.cos(x) * 10,))  # marked rule
    jaxtorch.register_op(torch.ops.jaxtorch_interop_test.scaled_sin.default, scaled_sin)
    f = lambda x: torch.ops.jaxtorch_interop_test.scaled_sin(x)
    x = jnp.linspace(0, 1, 5)
    np.testing.assert_allclose(np.asarray(jaxtorch.call_torch(f, x)), 2 * np.sin(np.asarray(x)), rtol=1e-6)
    np.testing.assert_allclose(
        np.asarray(jax.jit(lambda x: jaxtorch.call_torch(f, x))(x)), 2 * np.sin(np.asarray(x)), rtol=1e-6
    )
    g = jax.grad(lambda x: jaxtorch.call_torch(f, x).sum())(x)
    np.testing.assert_allclose(np.asarray(g), 20 * np.cos(np.asarray(x)), rtol=1e-6)  # the user's rule was used


def test_override_builtin_lowering():
    from jaxtorch.bridge.core import _registry as registry

    aten = torch.ops.aten
    original = registry.lookup(aten.tanh.default)
    try:
        jaxtorch.register_op(aten.tanh.default, lambda x: jnp.zeros_like(x) + 42.0)
        assert float(jaxtorch.call_torch(torch.tanh, jnp.ones(2))[0]) == 42.0
    finally:
        jaxtorch.register_op(aten.tanh.default, original)
    assert float(jaxtorch.call_torch(torch.tanh, jnp.zeros(2))[0]) == 0.0


def test_named_scopes_in_hlo():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0)
    params, fn = jaxtorch.extract(GPT2LMHeadModel(cfg).eval())
    text = jax.jit(lambda p, i: fn(p, i).logits).lower(params, jnp.ones((1, 8), jnp.int32)).as_text(debug_info=True)
    assert "GPT2Block/attn/" in text and "aten::" in text


def test_compiled_deterministic_calls_leave_the_global_generator_alone():
    jaxtorch.enable_globally()
    try:
        fast = jaxtorch.compile(torch.nn.Linear(3, 2).to("jax"))
        x = torch.randn(4, 3, device="jax")
        fast(x)  # the first trace may draw once (whether the program is random is not known yet)
        torch.manual_seed(5)
        expected = torch.rand(3, device="jax").cpu()
        torch.manual_seed(5)
        for _ in range(3):
            fast(x)
        assert torch.equal(torch.rand(3, device="jax").cpu(), expected)
        assert fast.compilations == 1
    finally:
        jaxtorch.disable_globally()


def test_jax_export_of_extract_fn_with_symbolic_batch_refuses_naming_batch_dim():
    # issue 30 item 14: was an internal `_make_wrapper_subclass(): ... _DimExpr` TypeError
    import pytest

    model = torch.nn.Linear(3, 2).eval()
    params, fn = jaxtorch.extract(model)
    spec = jax.ShapeDtypeStruct(jax.export.symbolic_shape("b, 3"), jnp.float32)
    with pytest.raises(jaxtorch.JaxtorchError, match=r"batch_dim=True"):
        jax.export.export(jax.jit(fn))(params, spec)
    with pytest.raises(jaxtorch.JaxtorchError, match=r"symbolic shape \('b', '3'\)"):
        jax.export.export(jax.jit(lambda x: jaxtorch.call_torch(model, x)))(spec)
    # the way out it names works, for any batch size
    exp = jaxtorch.export(model, torch.ones(4, 3), batch_dim=True)
    x = np.random.RandomState(0).randn(7, 3).astype(np.float32)
    expected = model(torch.tensor(x)).detach().numpy()
    np.testing.assert_allclose(np.asarray(exp.call(jnp.asarray(x))), expected, rtol=1e-5, atol=1e-6)
