"""Interop with JAX, Equinox and Flax (issue 30): JAX transformations of extracted torch code, torch code
around JAX modules (`JaxModule`), round trips between the two, pytrees across the boundary and export.

Each case compares against eager CPU torch (or the JAX library's own answer for its own modules).
"""

from __future__ import annotations

import collections
import dataclasses
import io

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx
from torch import nn

import jaxtorch

from .harness import case, close, equal, refuses, refuses_or


def _x(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.RandomState(seed).randn(*shape).astype(np.float32)


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))


def _torch_grads(model: nn.Module, x: np.ndarray) -> dict[str, torch.Tensor]:
    model.zero_grad()
    model(torch.tensor(x)).square().sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


# ---- JAX transformations of extract's function ----


@case("interop/extract/vmap_over_examples_matches_the_batched_forward")
def _vmap():
    model = _mlp()
    params, fn = jaxtorch.extract(model)
    x = _x(6, 3)
    out = jax.vmap(lambda a: fn(params, a[None])[0])(jnp.asarray(x))
    close(out, model(torch.tensor(x)))


@case("interop/extract/jax_grad_wrt_params_matches_torch")
def _grad_params():
    model = _mlp()
    params, fn = jaxtorch.extract(model)
    x = _x(4, 3)
    g = jax.grad(lambda p: jnp.sum(fn(p, jnp.asarray(x)) ** 2))(params)
    for name, ref in _torch_grads(model, x).items():
        close(g[name], ref)


@case("interop/extract/jax_grad_wrt_inputs_matches_torch")
def _grad_inputs():
    model = _mlp()
    params, fn = jaxtorch.extract(model)
    x = _x(4, 3)
    g = jax.grad(lambda a: jnp.sum(fn(params, a) ** 2))(jnp.asarray(x))
    xt = torch.tensor(x, requires_grad=True)
    model(xt).square().sum().backward()
    close(g, xt.grad)


@case("interop/extract/jvp_matches_torch_forward_mode")
def _jvp():
    model = _mlp()
    params, fn = jaxtorch.extract(model)
    x, v = _x(4, 3), _x(4, 3, seed=1)
    _, tangent = jax.jvp(lambda a: fn(params, a), (jnp.asarray(x),), (jnp.asarray(v),))
    _, ref = torch.func.jvp(lambda a: model(a), (torch.tensor(x),), (torch.tensor(v),))
    close(tangent, ref)


@case("interop/extract/linearize_matches_jvp")
def _linearize():
    model = _mlp()
    params, fn = jaxtorch.extract(model)
    x, v = jnp.asarray(_x(4, 3)), jnp.asarray(_x(4, 3, seed=1))
    out, lin = jax.linearize(lambda a: fn(params, a), x)
    _, tangent = jax.jvp(lambda a: fn(params, a), (x,), (v,))
    close(lin(v), tangent)
    close(out, model(torch.tensor(np.asarray(x))))


@case("interop/extract/checkpoint_keeps_the_gradients")
def _checkpoint():
    model = _mlp()
    params, fn = jaxtorch.extract(model)
    x = _x(4, 3)
    g = jax.grad(lambda p: jnp.sum(jax.checkpoint(fn)(p, jnp.asarray(x)) ** 2))(params)
    for name, ref in _torch_grads(model, x).items():
        close(g[name], ref)


@case("interop/extract/lax_scan_over_a_torch_cell_matches_a_python_loop")
def _scan():
    torch.manual_seed(0)
    cell = nn.GRUCell(3, 4)
    params, fn = jaxtorch.extract(cell)
    xs, h0 = _x(5, 2, 3), np.zeros((2, 4), np.float32)

    def step(h, x):
        h = fn(params, x, h)
        return h, h

    _, hs = jax.lax.scan(step, jnp.asarray(h0), jnp.asarray(xs))
    h, ref = torch.tensor(h0), []
    for x in torch.tensor(xs):
        h = cell(x, h)
        ref.append(h)
    close(hs, torch.stack(ref), atol=1e-5)


@case("interop/extract/hessian_matches_torch")
def _hessian():
    torch.manual_seed(0)
    lin = nn.Linear(3, 1)
    params, fn = jaxtorch.extract(lin)
    x = _x(3)
    h = jax.hessian(lambda a: jnp.tanh(fn(params, a)).sum())(jnp.asarray(x))
    ref = torch.autograd.functional.hessian(lambda a: torch.tanh(lin(a)).sum(), torch.tensor(x))
    close(h, ref, atol=1e-5)


@case("interop/extract/jit_retraces_for_a_new_shape")
def _retrace():
    model = _mlp()
    params, fn = jaxtorch.extract(model)
    f = jax.jit(fn)
    for n in (2, 5):
        x = _x(n, 3, seed=n)
        close(f(params, jnp.asarray(x)), model(torch.tensor(x)))


@case("interop/extract/shard_map_over_the_batch_matches_torch")
def _shard_map():
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    model = _mlp()
    params, fn = jaxtorch.extract(model)
    mesh = Mesh(np.array(jax.devices()), ("d",))
    n = 2 * len(jax.devices())
    x = _x(n, 3)
    f = jax.shard_map(lambda p, a: fn(p, a), mesh=mesh, in_specs=(P(), P("d")), out_specs=P("d"))
    close(f(params, jnp.asarray(x)), model(torch.tensor(x)))


# ---- pytrees across call_torch ----


_Pair = collections.namedtuple("_Pair", ["a", "b"])


@dataclasses.dataclass
class _Out:
    total: torch.Tensor
    scale: float


@case("interop/call_torch/namedtuple_in_and_out")
def _namedtuple():
    x, y = _x(3), _x(3, seed=1)
    out = jaxtorch.call_torch(lambda p: _Pair(p.a + p.b, p.a * p.b), _Pair(jnp.asarray(x), jnp.asarray(y)))
    assert isinstance(out, _Pair), type(out)
    close(out.a, torch.tensor(x) + torch.tensor(y))
    close(out.b, torch.tensor(x) * torch.tensor(y))


@case("interop/call_torch/none_leaves_pass_through")
def _none():
    x = _x(3)
    out = jaxtorch.call_torch(lambda d: {"y": d["x"] * 2, "mask": d["mask"]}, {"x": jnp.asarray(x), "mask": None})
    assert out["mask"] is None
    close(out["y"], torch.tensor(x) * 2)


@case("interop/call_torch/dataclass_output")
def _dataclass():
    x = _x(3)
    out = jaxtorch.call_torch(lambda a: _Out(a.sum(), 0.5), jnp.asarray(x))
    assert isinstance(out, _Out) and out.scale == 0.5, out
    close(out.total, torch.tensor(x).sum())


@case("interop/call_torch/complex_arithmetic_matches_torch")
def _complex():
    z = (_x(4) + 1j * _x(4, seed=1)).astype(np.complex64)
    out = jaxtorch.call_torch(lambda a: (a * a.conj() + a.exp()).abs(), jnp.asarray(z))
    zt = torch.tensor(z)
    close(out, (zt * zt.conj() + zt.exp()).abs())


@case("interop/call_torch/bf16_stays_bf16")
def _bf16():
    x = _x(8)
    out = jaxtorch.call_torch(lambda a: a * 3 + 1, jnp.asarray(x, jnp.bfloat16))
    assert out.dtype == jnp.bfloat16, out.dtype
    ref = torch.tensor(x).bfloat16() * 3 + 1
    equal(jaxtorch.to_torch(out), ref)


@case("interop/call_torch/grad_through_a_dict_input")
def _dict_grad():
    x, w = _x(3), _x(3, seed=1)
    g = jax.grad(lambda d: jaxtorch.call_torch(lambda t: (t["x"] * t["w"]).sin().sum(), d))(
        {"x": jnp.asarray(x), "w": jnp.asarray(w)}
    )
    xt, wt = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    (xt * wt).sin().sum().backward()
    close(g["x"], xt.grad)
    close(g["w"], wt.grad)


# ---- JaxModule inside torch ----


def _nnx_linear_as_torch(lin: nnx.Linear) -> nn.Linear:
    ref = nn.Linear(*lin.kernel.shape)
    with torch.no_grad():
        ref.weight.copy_(torch.tensor(np.asarray(lin.kernel[...]).T))
        ref.bias.copy_(torch.tensor(np.asarray(lin.bias[...])))
    return ref


@case("interop/jax_module/inside_a_torch_sequential_grads_match_torch")
def _in_sequential():
    torch.manual_seed(0)
    first = nn.Linear(3, 4)
    lin = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    model = nn.Sequential(first, nn.ReLU(), jaxtorch.JaxModule(lin))
    ref_first = nn.Linear(3, 4)
    ref_first.load_state_dict(first.state_dict())
    ref = nn.Sequential(ref_first, nn.ReLU(), _nnx_linear_as_torch(lin))
    x = _x(5, 3)
    model(torch.tensor(x)).square().sum().backward()
    ref(torch.tensor(x)).square().sum().backward()
    close(first.weight.grad, ref_first.weight.grad)
    close(model[2].kernel_value.grad, ref[2].weight.grad.T)


@case("interop/jax_module/grad_wrt_input_matches_jax_grad")
def _jm_input_grad():
    lin = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    m = jaxtorch.JaxModule(lin)
    x = _x(4, 3)
    xt = torch.tensor(x, requires_grad=True)
    m(xt).tanh().sum().backward()
    close(xt.grad, jax.grad(lambda a: jnp.tanh(lin(a)).sum())(jnp.asarray(x)))


@case("interop/jax_module/bf16_params_give_bf16_like_nnx")
def _jm_bf16():
    lin = nnx.Linear(4, 3, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    m = jaxtorch.JaxModule(lin)
    assert all(p.dtype == torch.bfloat16 for p in m.parameters())
    x = _x(2, 4)
    out = m(torch.tensor(x).bfloat16())
    assert out.dtype == torch.bfloat16, out.dtype
    equal(out, jaxtorch.to_torch(lin(jnp.asarray(x, jnp.bfloat16))))


@case("interop/jax_module/load_state_dict_into_a_fresh_one")
def _jm_state_dict():
    a = jaxtorch.JaxModule(nnx.BatchNorm(3, rngs=nnx.Rngs(0)))
    a(torch.tensor(_x(6, 3)))  # running statistics move
    b = jaxtorch.JaxModule(nnx.BatchNorm(3, rngs=nnx.Rngs(0)))
    b.load_state_dict(a.state_dict())
    a.eval()
    b.eval()
    x = torch.tensor(_x(2, 3, seed=1))
    equal(b(x), a(x))


@case("interop/jax_module/to_jax_module_carries_trained_params_and_stats")
def _jm_to_jax():
    m = jaxtorch.JaxModule(nnx.Sequential(nnx.Linear(3, 3, rngs=nnx.Rngs(0)), nnx.BatchNorm(3, rngs=nnx.Rngs(1))))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for i in range(2):
        opt.zero_grad()
        m(torch.tensor(_x(8, 3, seed=i))).square().mean().backward()
        opt.step()
    back = m.to_jax_module()
    back.eval()
    m.eval()
    x = _x(2, 3, seed=5)
    close(back(jnp.asarray(x)), m(torch.tensor(x)))


@case("interop/jax_module/no_grad_call_updates_batch_stats_like_nnx")
def _jm_no_grad():
    ref = nnx.BatchNorm(3, rngs=nnx.Rngs(0))
    m = jaxtorch.JaxModule(nnx.BatchNorm(3, rngs=nnx.Rngs(0)))
    x = _x(6, 3)
    with torch.no_grad():
        m(torch.tensor(x))
    ref(jnp.asarray(x))
    close(m.mean_value, ref.mean[...])


@case("interop/jax_module/dropout_draws_come_from_the_nnx_rngs")
def _jm_dropout_rngs():
    a = jaxtorch.JaxModule(nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=7)))
    b = jaxtorch.JaxModule(nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=7)))
    x = torch.ones(32)
    torch.manual_seed(0)
    first = a(x)
    torch.manual_seed(1)
    equal(b(x), first)  # the same nnx stream, the same mask (as calling nnx directly)
    assert not torch.equal(a(x), first)  # and the next call draws afresh


@case("interop/jax_module/eqx_dropout_without_a_key_in_train_mode_refuses")
def _jm_eqx_nokey():
    m = jaxtorch.JaxModule(eqx.nn.Dropout(0.5))
    refuses(lambda: m(torch.ones(4)), "an Equinox Dropout in train mode ran without a key", "key")


@case("interop/jax_module/eqx_batchnorm_refused_naming_state")
def _jm_eqx_bn():
    bn = eqx.nn.BatchNorm(3, axis_name="b")
    refuses(lambda: jaxtorch.JaxModule(bn), "an Equinox BatchNorm was wrapped, its state lost", "eqx.nn.State")


@case("interop/jax_module/complex_params_get_complex_grads")
def _jm_complex():
    class Scale(eqx.Module):
        w: jax.Array

        def __call__(self, z):
            return jnp.abs(z * self.w) ** 2

    w0 = (_x(3) + 1j * _x(3, seed=1)).astype(np.complex64)
    z = (_x(3, seed=2) + 1j * _x(3, seed=3)).astype(np.complex64)
    m = jaxtorch.JaxModule(Scale(jnp.asarray(w0)))
    m(torch.tensor(z)).sum().backward()
    wt = torch.tensor(w0, requires_grad=True)
    (torch.tensor(z) * wt).abs().square().sum().backward()
    close(m.w.grad, wt.grad, atol=1e-5)


# ---- round trips ----


@case("interop/round_trip/torch_to_eqx_to_torch_matches_the_original")
def _torch_eqx_torch():
    model = _mlp()
    back = jaxtorch.JaxModule(jaxtorch.torch_module_to_jax(model))
    x = _x(4, 3)
    close(back(torch.tensor(x)), model(torch.tensor(x)))
    back(torch.tensor(x)).square().sum().backward()
    ref = _torch_grads(model, x)
    grads = {n: p.grad for n, p in back.named_parameters()}
    assert grads.keys() == {"params_" + n.replace(".", "_") for n in ref}, grads.keys()
    for name, r in ref.items():
        close(grads["params_" + name.replace(".", "_")], r)


@case("interop/round_trip/torch_module_as_an_equinox_field")
def _field():
    class Head(eqx.Module):
        body: jaxtorch.TorchModule
        out: eqx.nn.Linear

        def __call__(self, x):
            return jax.vmap(self.out)(self.body(x))

    model = _mlp()
    out = eqx.nn.Linear(2, 1, key=jax.random.key(0))
    head = Head(jaxtorch.torch_module_to_jax(model), out)
    x = _x(4, 3)
    g = eqx.filter_grad(lambda h: jnp.sum(h(jnp.asarray(x)) ** 2))(head)
    ref_out = nn.Linear(2, 1)
    with torch.no_grad():
        ref_out.weight.copy_(torch.tensor(np.asarray(out.weight)))
        ref_out.bias.copy_(torch.tensor(np.asarray(out.bias)))
    ref = nn.Sequential(model, ref_out)
    ref_grads = _torch_grads(ref, x)
    close(g.out.weight, ref_grads["1.weight"])
    close(g.body.params["0.weight"], ref_grads["0.0.weight"])


@case("interop/round_trip/jax_module_inside_extract")
def _jm_in_extract():
    lin = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    model = nn.Sequential(jaxtorch.JaxModule(lin), nn.Tanh())
    params, fn = jaxtorch.extract(model)
    x = _x(4, 3)
    out = jax.jit(fn)(params, jnp.asarray(x))
    close(out, jnp.tanh(lin(jnp.asarray(x))))
    g = jax.grad(lambda p: fn(p, jnp.asarray(x)).sum())(params)
    ref = jax.grad(lambda k: jnp.tanh(jnp.asarray(x) @ k + lin.bias[...]).sum())(lin.kernel[...])
    close(g["0.kernel_value"], ref)


@case("interop/round_trip/filter_jit_of_torch_module_to_jax")
def _filter_jit():
    model = _mlp()
    m = jaxtorch.torch_module_to_jax(model)
    x = _x(4, 3)
    close(eqx.filter_jit(lambda mod, a: mod(a))(m, jnp.asarray(x)), model(torch.tensor(x)))


# ---- call_jax inside torch autograd ----


@case("interop/call_jax/double_backward_matches_torch")
def _double_backward():
    x = _x(4)
    xt = torch.tensor(x, device="jax", requires_grad=True)
    (g,) = torch.autograd.grad(jaxtorch.call_jax(lambda a: jnp.sum(jnp.sin(a) ** 3), xt), xt, create_graph=True)
    (gg,) = torch.autograd.grad(g.sum(), xt)
    ref = torch.tensor(x, requires_grad=True)
    (rg,) = torch.autograd.grad(ref.sin().pow(3).sum(), ref, create_graph=True)
    (rgg,) = torch.autograd.grad(rg.sum(), ref)
    close(gg, rgg, atol=1e-5)


# ---- export ----


@case("interop/export/serialize_round_trip_matches_torch")
def _export_roundtrip():
    model = _mlp().eval()
    x = _x(4, 3)
    blob = jaxtorch.export(model, torch.tensor(x)).serialize()
    out = jax.export.deserialize(blob).call(jnp.asarray(x))
    close(out, model(torch.tensor(x)))


@case("interop/export/params_passed_in_follow_new_weights")
def _export_params():
    model = _mlp().eval()
    x = _x(4, 3)
    exp = jaxtorch.export(model, torch.tensor(x), embed_params=False)
    params, _ = jaxtorch.extract(model)
    params = {k: v * 2 for k, v in params.items()}
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(2)
    close(exp.call(params, jnp.asarray(x)), model(torch.tensor(x)))


@case("interop/export/symbolic_batch_of_extract_fn_refuses_clearly")
def _export_symbolic():
    params, fn = jaxtorch.extract(_mlp().eval())
    spec = jax.ShapeDtypeStruct(jax.export.symbolic_shape("b, 3"), jnp.float32)

    def check():
        exp = jax.export.export(jax.jit(fn))(params, spec)
        assert str(exp.out_avals[0].shape[0]) == "b", exp.out_avals

    refuses_or(check, "batch_dim=True")


@case("interop/export/batch_dim_any_batch_size_and_serialized")
def _export_batch_dim():
    model = _mlp().eval()
    exp = jax.export.deserialize(jaxtorch.export(model, torch.ones(2, 3), batch_dim=True).serialize())
    for n in (1, 7):
        x = _x(n, 3, seed=n)
        close(exp.call(jnp.asarray(x)), model(torch.tensor(x)))


@case("interop/jax_module/torch_save_of_a_model_holding_one")
def _jm_save_in_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), jaxtorch.JaxModule(eqx.nn.Linear(3, 2, key=jax.random.key(0))))
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    torch.manual_seed(1)
    other = nn.Sequential(nn.Linear(3, 3), jaxtorch.JaxModule(eqx.nn.Linear(3, 2, key=jax.random.key(1))))
    other.load_state_dict(torch.load(buf))
    x = torch.tensor(_x(3))
    equal(other(x), model(x))


@case("interop/jax_module/jit_step_draws_fresh_dropout_like_eager")
def _jm_jit_dropout():
    mods = [jaxtorch.JaxModule(nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=2))) for _ in range(2)]
    jitted = jaxtorch.jit(lambda m, x: m(x) * 1)
    x = torch.ones(16, device="jax")
    outs = [jitted(mods[0], x) for _ in range(2)]
    refs = [mods[1](x) * 1 for _ in range(2)]
    assert not torch.equal(outs[0], outs[1]), "the compiled call reused its mask"
    for o, r in zip(outs, refs):
        equal(o, r)


@case("interop/jax_module/deepcopy_continues_the_same_random_stream")
def _jm_copy_stream():
    import copy

    a = jaxtorch.JaxModule(nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=4)))
    x = torch.ones(16)
    a(x)
    b = copy.deepcopy(a)
    equal(b(x), a(x))  # same state, same next draw
    equal(b(x), a(x))


@case("interop/jax_module/compiled_train_forward_updates_batch_stats")
def _jm_compile_bn():
    mods = [jaxtorch.JaxModule(nnx.BatchNorm(3, rngs=nnx.Rngs(0))) for _ in range(2)]
    compiled = jaxtorch.compile(mods[0])
    for i in range(2):
        x = torch.tensor(_x(5, 3, seed=i), device="jax")
        close(compiled(x), mods[1](x))
    close(mods[0].mean_value, mods[1].mean_value)
    close(mods[0].var_value, mods[1].var_value)


@case("interop/jax_module/eval_then_train_switches_nnx_modes")
def _jm_modes():
    ref = nnx.BatchNorm(3, rngs=nnx.Rngs(0))
    m = jaxtorch.JaxModule(nnx.BatchNorm(3, rngs=nnx.Rngs(0)))
    x = _x(4, 3)
    m.eval()
    ref.eval()
    close(m(torch.tensor(x)), ref(jnp.asarray(x)))
    m.train()
    ref.train()
    close(m(torch.tensor(x)), ref(jnp.asarray(x)))
    close(m.mean_value, ref.mean[...])


@case("interop/jax_module/make_train_step_matches_eager_torch_training")
def _jm_train_step():
    import optax

    import jaxtorch.train as train

    def net() -> jaxtorch.JaxModule:
        return jaxtorch.JaxModule(
            nnx.Sequential(nnx.Linear(4, 3, rngs=nnx.Rngs(0)), nnx.BatchNorm(3, rngs=nnx.Rngs(1)))
        )

    model, ref = net(), net()
    init, step = train.make_train_step(model, lambda o, y: jnp.mean(o**2), optax.sgd(0.1))
    state = init()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for i in range(2):
        x = _x(8, 4, seed=i)
        state, loss = step(state, jnp.asarray(x), jnp.zeros(()))
        opt.zero_grad()
        ref_loss = ref(torch.tensor(x)).square().mean()
        ref_loss.backward()
        opt.step()
        close(loss, ref_loss)
    close(state.model_state["layers_1_mean_value"], ref.layers_1_mean_value)
