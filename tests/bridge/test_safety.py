"""Issue 14 items 1, 2, 3, 6: arrays handed to JAX never change, modules are left as found,
`Module.to("jax")` keeps Parameter objects, jaxtorch's arrays are uncommitted like `jnp`'s,
and one input rule (NumPy, torch tensors, float64) at every entry point."""

from __future__ import annotations

import io

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from torch import nn

import jaxtorch
from jaxtorch import StateWriteError
from jaxtorch.bridge.tensor._convert import tensor_to_jax
from tests._dtypes import enable_x64


class ConvBN(nn.Module):
    """Big enough that its weights are shared copy-on-write (not copied): 128*128*3*3 floats."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(128, 128, 3, padding=1)
        self.bn = nn.BatchNorm2d(128)
        self.head = nn.Linear(128, 10)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def _values(params):
    return {k: np.array(v, copy=True) for k, v in params.items()}


def _assert_unchanged(params, before):
    for k, v in before.items():
        np.testing.assert_array_equal(np.asarray(params[k]), v, err_msg=k)


# ---- item 1: arrays handed out never change ------------------------------------------------
@pytest.mark.parametrize("entry", ["extract", "torch_module_to_jax"])
def test_arrays_never_change_whatever_torch_does_to_the_module(entry):
    model = ConvBN()
    if entry == "extract":
        params, _ = jaxtorch.extract(model)
    else:
        params = jaxtorch.torch_module_to_jax(model).params
    # one copy of the weights: the arrays read the module's own memory until torch writes it
    assert params["conv.weight"].unsafe_buffer_pointer() == model.conv.weight.const_data_ptr()
    before = _values(params)
    model.train()(torch.randn(2, 128, 4, 4)).sum().backward()  # BatchNorm statistics, in place
    torch.optim.SGD(model.parameters(), lr=0.5).step()  # every parameter, in place
    with torch.no_grad():
        model.conv.bias.add_(1.0)
    model.load_state_dict(ConvBN().state_dict())  # copy_ into every tensor
    assert not torch.equal(model.conv.weight.detach(), torch.from_numpy(before["conv.weight"]))
    _assert_unchanged(params, before)


def test_jitted_fn_dispatched_before_a_torch_forward_sees_the_original_statistics():
    """The race of issue 14: JAX's dispatch is asynchronous, so the program may read the
    running mean after torch's train-mode forward of the same module updated it in place."""
    bn = nn.BatchNorm1d(1 << 16).train()  # running_mean: 256 KiB, shared copy-on-write
    x = torch.randn(8, 1 << 16) + 3.0
    params, fn = jaxtorch.extract(bn, mutable=True)
    a = jax.random.normal(jax.random.key(0), (256, 256)) / 16

    @jax.jit
    def slow_then_bn(p, x):  # some work before the BatchNorm reads p, so torch's write lands first
        r = jax.lax.fori_loop(0, 60, lambda i, m: jnp.tanh(m @ a), a)
        return fn(p, x + jnp.where(jnp.isnan(r).any(), 1.0, 0.0))

    slow_then_bn(params, jnp.zeros((8, 1 << 16)))  # compiled
    (_, new), _ = slow_then_bn(params, jaxtorch.to_jax(x)), bn(x)  # dispatched, then torch's forward
    batch_mean = x.mean(0).numpy()
    np.testing.assert_allclose(bn.running_mean.numpy(), 0.1 * batch_mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(new["running_mean"]), 0.1 * batch_mean, rtol=1e-5, atol=1e-6)  # not 0.19x
    assert not np.asarray(fn.state["running_mean"]).any()  # still the zeros extract saw


def test_to_jax_is_a_zero_copy_snapshot():
    t = torch.arange(1 << 16, dtype=torch.float32)
    a = jaxtorch.to_jax(t)
    assert a.unsafe_buffer_pointer() == t.const_data_ptr()  # no copy (copy-on-write)
    t.add_(1)
    assert float(a[0]) == 0.0 and float(t[0]) == 1.0  # documented: a snapshot (issue 22)


def test_to_jax_device_and_copy_into_jax_tensor_are_snapshots():
    t = torch.arange(1 << 16, dtype=torch.float32)
    with jaxtorch.default_env():
        moved = t.to("jax")
        dst = torch.zeros(1 << 16, device="jax")
        dst.copy_(t)
    t.add_(1)  # torch semantics: `.to()` and `copy_` made copies
    assert float(moved.jax()[0]) == 0.0 and float(dst.jax()[0]) == 0.0


class SharedTwice(nn.Module):
    """One submodule under two names, as timm's CoaT shares its `cpe` convolutions."""

    def __init__(self):
        super().__init__()
        shared = nn.Linear(4, 4)
        self.a, self.b = shared, shared
        self.bn = nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.bn(self.b(torch.relu(self.a(x)))))


def _slots(module):
    return [
        (m, k, v)
        for m in module.modules()
        for k, v in [*m.__dict__.items(), *m._parameters.items(), *m._buffers.items(), *m._modules.items()]
    ]


@pytest.mark.parametrize("how", ["eager", "jit", "grad", "mutable"])
def test_fn_leaves_a_module_with_a_shared_submodule_exactly_as_found(how):
    model = SharedTwice().eval()
    x = torch.randn(3, 4)
    want = model(x).detach().numpy()
    found = _slots(model)
    params, fn = jaxtorch.extract(model, mutable=how == "mutable")
    assert "b.weight" not in params  # the shared submodule's tensors are one entry
    xj = jaxtorch.to_jax(x)
    if how == "eager":
        out = fn(params, xj)
    elif how == "jit":
        out = jax.jit(fn)(params, xj)
    elif how == "grad":
        weights = {k: v for k, v in params.items() if k != "bn.num_batches_tracked"}
        grads = jax.grad(lambda w: fn({**params, **w}, xj).sum())(weights)
        assert set(grads) == set(weights)
        out = fn(params, xj)
    else:
        out, _ = fn(params, xj)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-6)
    after = _slots(model)
    assert len(after) == len(found) and all(a[2] is f[2] for a, f in zip(after, found))  # the same objects
    np.testing.assert_allclose(model(x).detach().numpy(), want, rtol=1e-6)  # plain torch call still works


def test_call_torch_leaves_a_module_as_found_and_never_writes_its_cpu_state():
    model = SharedTwice().train()
    x = jnp.ones((4, 4)) * jnp.arange(4.0)
    found = _slots(model)
    stats = model.bn.running_mean.clone()
    for run in (lambda: jaxtorch.call_torch(model, x), lambda: jax.jit(lambda x: jaxtorch.call_torch(model, x))(x)):
        with pytest.raises(StateWriteError, match=r"extract\(model, mutable=True\)"):
            run()  # eagerly as under jit: a pure function does not write BatchNorm's statistics
    assert torch.equal(model.bn.running_mean, stats)
    assert all(a[2] is f[2] for a, f in zip(_slots(model), found))
    model.eval()
    found = _slots(model)
    out = jaxtorch.call_torch(model, x)
    np.testing.assert_allclose(np.asarray(out), model(torch.from_numpy(np.asarray(x))).detach().numpy(), rtol=1e-5)
    after = _slots(model)
    assert all(a[2] is f[2] for a, f in zip(after, found))


# ---- item 2: Module.to("jax") keeps the Parameter objects ----------------------------------
def _train_two_steps(model, device, hooks_seen):
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)  # built before the move
    model[0].weight.register_hook(lambda g: g * 2)
    model[2].bias.register_post_accumulate_grad_hook(lambda p: hooks_seen.append(device))
    weight = model[0].weight
    model.to(device)
    assert model[0].weight is weight and isinstance(weight, nn.Parameter) and weight.device.type == device
    x = torch.linspace(-1, 1, 24).reshape(6, 4)
    for _ in range(2):
        opt.zero_grad()
        model(x.to(device)).square().mean().backward()
        opt.step()
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def test_optimizer_and_hooks_built_before_to_jax_keep_working(pytorch_first):
    torch.manual_seed(0)
    ref_model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    model.load_state_dict(ref_model.state_dict())
    start = {k: v.clone() for k, v in ref_model.state_dict().items()}
    seen_cpu, seen_jax = [], []
    want = _train_two_steps(ref_model, "cpu", seen_cpu)
    got = _train_two_steps(model, "jax", seen_jax)
    assert len(seen_jax) == len(seen_cpu) == 2
    for k in want:
        assert not torch.equal(got[k], start[k]), k  # the optimizer moved the weights on the jax device
        np.testing.assert_allclose(got[k].numpy(), want[k].numpy(), rtol=1e-5, atol=1e-6, err_msg=k)
    weight = model[0].weight
    model.cpu()  # and back: still the same objects
    assert model[0].weight is weight and type(weight) is nn.Parameter and weight.device.type == "cpu"


def test_move_after_a_cpu_forward_keeps_objects_and_the_old_graph_says_so(pytorch_first):
    model = nn.Linear(4, 2)
    weight = model.weight
    ref = model(torch.randn(3, 4))  # a reference computed on the CPU, graph still alive
    model.to("jax")
    assert model.weight is weight
    with pytest.raises(RuntimeError, match="poisoned by swap_tensors|built before the module moved"):
        ref.sum().backward()
    model(torch.randn(3, 4).to("jax")).sum().backward()
    assert model.weight.grad is not None and model.weight.grad.device.type == "jax"


@pytest.fixture
def pytorch_first():
    jaxtorch.enable_globally()
    yield
    jaxtorch.disable_globally()


# ---- item 3: uncommitted arrays, one compilation ---------------------------------------------
def test_arrays_are_uncommitted_unless_a_device_was_asked_for():
    t = torch.ones(3, 4)
    params, _ = jaxtorch.extract(nn.Linear(4, 2))
    assert not jaxtorch.to_jax(t).committed
    assert not any(v.committed for v in params.values())
    assert not jaxtorch.torch_module_to_jax(nn.Linear(4, 2)).params["weight"].committed
    with jaxtorch.default_env():
        assert not t.to("jax").jax().committed  # torch names JAX's default placement jax:0
        assert not torch.zeros(3, device="jax").jax().committed
    assert tensor_to_jax(t, jax.devices()[0]).committed


class Classifier(eqx.Module):
    backbone: jaxtorch.TorchModule
    head: eqx.nn.Linear

    def __call__(self, x):
        return jax.vmap(self.head)(jax.lax.stop_gradient(self.backbone(x)))


def test_equinox_and_optax_step_with_a_frozen_torch_cnn_compiles_once():
    cnn = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten()
    ).eval()
    model = Classifier(jaxtorch.torch_module_to_jax(cnn), eqx.nn.Linear(8, 2, key=jax.random.key(1)))
    x, y = jax.random.normal(jax.random.key(0), (4, 3, 8, 8)), jnp.array([0, 1, 0, 1])
    opt = optax.adam(1e-2)
    state = opt.init(eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(model, state, x, y):
        loss = lambda m: optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()
        value, grads = eqx.filter_value_and_grad(loss)(model)
        updates, state = opt.update(grads, state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), state, value

    compiled = []

    def listen(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration" and "step" in str(kw.get("fun_name")):
            compiled.append(kw["fun_name"])

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        losses = []
        for _ in range(3):
            model, state, value = step(model, state, x, y)
            losses.append(float(value))
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert compiled == ["jit(step)"], compiled
    assert losses[-1] < losses[0]


# ---- item 6: one input rule at every entry point ---------------------------------------------
def _entry_points():
    torch.manual_seed(0)
    model = nn.Linear(4, 2).eval()
    params, fn = jaxtorch.extract(model)
    wrapped = jaxtorch.torch_module_to_jax(model)
    return model, {
        "extract": lambda x: fn(params, x),
        "call_torch": lambda x: jaxtorch.call_torch(model, x),
        "TorchModule": lambda x: wrapped(x),
    }


@pytest.mark.parametrize("name", ["extract", "call_torch", "TorchModule"])
def test_jax_first_entry_points_take_numpy_and_torch_tensors_with_and_without_jit(name):
    model, entries = _entry_points()
    run = entries[name]
    data = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    want = model(torch.from_numpy(data)).detach().numpy()
    np.testing.assert_allclose(np.asarray(run(data)), want, rtol=1e-6)  # NumPy: as jax.jit takes it
    np.testing.assert_allclose(np.asarray(jax.jit(run)(data)), want, rtol=1e-6)
    t = torch.from_numpy(data.copy())  # torch tensors: converted as `to_jax` converts them (issue 22)
    np.testing.assert_allclose(np.asarray(run(t)), want, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(jax.jit(run)(t)), want, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(jax.jit(run)(jaxtorch.to_jax(t))), want, rtol=1e-6)


def test_torch_first_jit_takes_what_eager_torch_takes():
    f = lambda x: torch.relu(x) * 2
    fast = jaxtorch.jit(f)
    t = torch.linspace(-1, 1, 5)
    np.testing.assert_array_equal(fast(t).cpu().numpy(), f(t).numpy())  # CPU tensors: both
    for run in (f, fast):  # NumPy: neither, with torch's own "must be Tensor"
        with pytest.raises(TypeError, match="must be Tensor"):
            run(t.numpy())


# ---- item 6: float64, one rule ----------------------------------------------------------------
_ASKS_FOR_FLOAT64 = {
    "factory": lambda x: torch.randn(3, dtype=torch.float64, device="jax"),
    "to": lambda x: x.to(torch.float64),
    "double": lambda x: x.double(),
    "reduction dtype": lambda x: x.sum(dtype=torch.float64),
    "cpu data": lambda x: torch.ones(3, dtype=torch.float64).to("jax"),
    "default dtype": lambda x: _with_default_double(lambda: torch.zeros(2, device="jax")),
}


def _with_default_double(make):
    torch.set_default_dtype(torch.float64)
    try:
        return make()
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("how", sorted(_ASKS_FOR_FLOAT64))
def test_float64_without_x64_raises_everywhere(how, pytorch_first):
    f = _ASKS_FOR_FLOAT64[how]
    x = torch.ones(3, device="jax")
    with pytest.raises(jaxtorch.Float64Error, match="jax_enable_x64"):
        f(x)  # PyTorch-first, eagerly
    with pytest.raises(jaxtorch.Float64Error, match="jax_enable_x64"):
        jaxtorch.jit(f)(x)
    with pytest.raises(jaxtorch.Float64Error, match="jax_enable_x64"):
        jax.jit(lambda a: jaxtorch.call_torch(f, a))(jnp.ones(3))


def test_float64_with_x64_is_float64_everywhere(pytorch_first):
    with enable_x64():
        x = torch.ones(3, device="jax")
        for how, f in _ASKS_FOR_FLOAT64.items():
            assert f(x).dtype == torch.float64, how
            assert jaxtorch.jit(f)(x).dtype == torch.float64, how


def test_torch_internal_float64_scalars_still_work():
    """torch's C++ makes 0-dim float64 tolerances (`matrix_rank`): scalars enter as float32."""
    a = np.random.default_rng(0).normal(size=(5, 3)).astype(np.float32)
    assert int(jaxtorch.call_torch(torch.linalg.matrix_rank, a)) == int(torch.linalg.matrix_rank(torch.from_numpy(a)))
    out = jaxtorch.call_torch(lambda t: t * torch.tensor(0.5, dtype=torch.float64), jnp.ones(2))
    assert out.dtype == jnp.float32 and out.tolist() == [0.5, 0.5]  # torch's promotion: float32 too


def _load_onto(t: torch.Tensor, device: str) -> torch.Tensor:
    buf = io.BytesIO()
    torch.save(t, buf)
    buf.seek(0)
    return torch.load(buf, map_location=device)


# explicit moves of 0-dim (and 1-element) wide CPU tensors onto `device`: data, not torch's scalars
_MOVES_0D = {
    "to": lambda d: torch.tensor(1.1, dtype=torch.float64).to(d),
    "to_complex128": lambda d: torch.tensor(1.1 + 2j, dtype=torch.complex128).to(d),
    "to_device_dtype": lambda d: torch.tensor(1.1).to(device=d, dtype=torch.float64),
    "to_1_element": lambda d: torch.tensor([1.1], dtype=torch.float64).to(d),
    "load_map_location": lambda d: _load_onto(torch.tensor(1.1, dtype=torch.float64), d),
}


@pytest.mark.parametrize("env", ["plain", "enable_globally"])
@pytest.mark.parametrize("how", sorted(_MOVES_0D))
def test_an_explicit_move_of_a_0d_float64_raises_without_x64(how, env):
    """`.to("jax")` of a 0-dim float64 CPU tensor raised nothing and gave float32 (the scalar rule
    of torch's internal constants); an explicit move is data, as `torch.load(map_location="jax")` says."""
    if env == "enable_globally":
        jaxtorch.enable_globally()
    try:
        with pytest.raises(jaxtorch.Float64Error, match="jax_enable_x64"):
            _MOVES_0D[how]("jax")
    finally:
        if env == "enable_globally":
            jaxtorch.disable_globally()


@pytest.mark.parametrize("how", sorted(_MOVES_0D))
def test_an_explicit_move_of_a_0d_float64_with_x64_keeps_it(how):
    with enable_x64():
        out = _MOVES_0D[how]("jax")
        back = out.cpu()
    expected = _MOVES_0D[how]("cpu")
    assert out.device.type == "jax" and out.dtype == expected.dtype, (out.device, out.dtype)
    torch.testing.assert_close(back, expected, rtol=0, atol=0)


def test_a_0d_float64_moved_with_a_narrower_dtype_is_cast_by_torch():
    """Asking for float32 is not asking for float64: torch's cast on the host, no error."""
    x = torch.tensor(1.1, dtype=torch.float64)
    out = x.to(device="jax", dtype=torch.float32)
    assert out.dtype == torch.float32 and out.cpu().item() == x.float().item()


def test_to_torch_is_a_copy():
    """A torch write to what `to_torch` returns never reaches the JAX array (it shared the
    array's memory through DLPack before, so `t.add_(1)` changed an immutable jax.Array)."""
    a = jnp.arange(100_000, dtype=jnp.float32)
    t = jaxtorch.to_torch(a)
    t.add_(1)
    assert float(a[0]) == 0.0 and float(t[0]) == 1.0
    tree = jaxtorch.to_torch({"w": a})
    tree["w"].mul_(0)
    assert float(a[1]) == 1.0
