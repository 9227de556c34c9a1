"""Every interception of a torch or JAX function that `import jaxtorch` installs is still reached.

jaxtorch replaces or registers functions that torch (or JAX) looks up at call time: checkpoint
internals, `Function.apply`, `Module.to`, `torch.Generator`, module backward hooks, kernels at the
`PrivateUse1` / `AutogradPrivateUse1` / `AutocastPrivateUse1` keys, JAX's aval table, an import
hook. A torch release that calls another function instead leaves jaxtorch's replacement in place
but unused, which can be silent (torch 2.14's checkpoint called a renamed generator, and dropout
gradients through a checkpointed region were wrong). Each test here makes the real public call and
proves, with a counter on the replaced function or a result only it can give, that it was reached;
the compatibility job (`.ci/compat`) runs this file on the second supported torch.
"""

from __future__ import annotations

import contextlib
import io
import sys
import warnings

import jax
import jax.numpy as jnp
import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as tc
import torch.utils.hooks as torch_hooks

import jaxtorch
from jaxtorch.bridge.api import _jax_module
from jaxtorch.bridge.core import _registry as registry
from jaxtorch.bridge.core._errors import JaxtorchError, TorchVersionError
from jaxtorch.bridge.dispatch import _autocast, _custom_function, _remat_jax, _remat_torch

aten = torch.ops.aten


@contextlib.contextmanager
def counting(owner, name: str):
    """Wrap `owner.name` (what jaxtorch installed there) with a call counter while the block runs."""
    original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    calls = [0]

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    setattr(owner, name, counted)
    try:
        yield calls
    finally:
        setattr(owner, name, original)


def _kernel_at(op: str, key: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(op, key)


# ---- remat (torch's activation checkpointing) ---------------------------------------------------
class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 8), torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.b(F.dropout(torch.tanh(self.a(x)), 0.5, training=True))


def _dropout_grads(block, x, reentrant: bool | None) -> list[torch.Tensor]:
    jaxtorch.manual_seed(3)
    torch.manual_seed(3)
    y = block(x) if reentrant is None else tc.checkpoint(block, x, use_reentrant=reentrant)
    y.square().sum().backward()
    grads = [p.grad.cpu().clone() for p in block.parameters()]
    block.zero_grad()
    return grads


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_checkpoint_reaches_the_wrapped_recomputation_and_gradients_match(reentrant):
    """torch's public `checkpoint` reaches jaxtorch's entry (`__dynamo_disable`) and the wrapper of
    the generator / `CheckpointFunction` this torch calls; with dropout in the region, the
    gradients equal the unchecked run's exactly (the recomputation replays the forward's keys)."""
    block = _Block().to("jax")
    x = torch.randn(3, 4).to("jax").requires_grad_()  # (torch's reentrant mode needs an input that does)
    want = _dropout_grads(block, x, None)
    before = dict(_remat_torch._REACHED)
    got = _dropout_grads(block, x, reentrant)
    reached = {k: _remat_torch._REACHED[k] - before[k] for k in before}
    assert reached["checkpoint"] == 1
    assert reached["reentrant" if reentrant else "generator"] == 1, reached
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_the_generator_wrapped_is_the_one_torch_calls():
    names = [n for n in _remat_torch.GENERATORS if getattr(getattr(tc, n, None), "_jaxtorch", False)]
    assert len(names) == 1 and not _remat_torch._UNKNOWN
    with counting(tc, names[0]) as calls:
        _dropout_grads(_Block().to("jax"), torch.randn(2, 4).to("jax"), False)
    assert calls[0] == 1


def test_checkpoint_refuses_jax_tensors_when_the_generator_is_unknown(monkeypatch):
    monkeypatch.setattr(_remat_torch, "_UNKNOWN", ["this torch's checkpoint calls none of ..."])
    x = torch.randn(2, 4).to("jax")
    with pytest.raises(TorchVersionError, match="calls none of"):
        tc.checkpoint(torch.tanh, x, use_reentrant=False)
    assert isinstance(TorchVersionError("x"), JaxtorchError)
    torch.testing.assert_close(tc.checkpoint(torch.tanh, x, use_reentrant=True).cpu(), torch.tanh(x.cpu()))


def test_remat_notes_hooks_registered_through_the_public_methods():
    t = torch.ones(2, requires_grad=True) * 2
    _remat_jax._hooks.regions = [False, False]
    try:
        t.register_hook(lambda g: g)
        assert _remat_jax._hooks.regions == [False, True]
        _remat_jax._hooks.regions = [False]
        t.retain_grad()
        assert _remat_jax._hooks.regions == [True]
    finally:
        _remat_jax._hooks.regions = []


# ---- autograd: Function.apply and module backward hooks ----------------------------------------
class _Reverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return -g


def test_function_apply_is_jaxtorchs_and_jax_grad_uses_the_backward():
    assert getattr(torch.autograd.Function.__dict__["apply"], "__func__", None) is _custom_function._apply
    grad = jax.grad(lambda a: jaxtorch.call_torch(lambda t: _Reverse.apply(t).sum(), a))(jnp.ones(3))
    assert grad.tolist() == [-1.0, -1.0, -1.0]  # JAX alone would differentiate the forward: +1
    x = torch.ones(3, requires_grad=True)
    _Reverse.apply(x).sum().backward()  # torch's own apply everywhere else
    assert x.grad.tolist() == [-1.0, -1.0, -1.0]


def test_module_backward_hooks_reach_jaxtorchs_apply_on_tensors():
    lin = torch.nn.Linear(3, 2).to("jax")
    seen = []
    lin.register_full_backward_hook(lambda m, gi, go: seen.append(go[0].shape))
    with counting(torch_hooks.BackwardHook, "_apply_on_tensors") as calls:
        lin(torch.ones(4, 3, device="jax", requires_grad=True)).sum().backward()
    assert calls[0] >= 1 and seen == [torch.Size([4, 2])]


def test_tensor_register_hook_is_jaxtorchs():
    from jaxtorch.bridge.dispatch import _hooks

    assert torch.Tensor.register_hook is _hooks._register_hook
    x = torch.ones(2, device="jax", requires_grad=True)
    y = x * 3
    y.register_hook(lambda g: g * 10)
    y.sum().backward()
    assert x.grad.cpu().tolist() == [30.0, 30.0]


# ---- autocast: kernels at AutocastPrivateUse1, from torch's CPU lists ---------------------------
def test_autocast_kernels_are_registered_and_reached():
    policies = _autocast.policy_of()
    assert policies and None not in policies.values()
    for name in policies:
        assert _kernel_at(name, "AutocastPrivateUse1"), name
    a = torch.randn(3, 3, device="jax")
    with torch.autocast("jax", dtype=torch.bfloat16):
        assert a.mm(a).dtype == torch.bfloat16  # "lower"
        assert F.mse_loss(a.bfloat16(), a.bfloat16()).dtype == torch.float32  # "fp32"
        assert torch.cat([a.bfloat16(), a]).dtype == torch.float32  # "promote"


def test_autocast_policies_are_torchs_cpu_policies():
    """The probe reads each op's policy from CPU autocast; spot checks against CPU torch itself."""
    a = torch.randn(3, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert a.mm(a).dtype == torch.bfloat16
        assert torch.linalg.inv(a.bfloat16()).dtype == torch.float32
    assert _autocast.probe_cpu_policy(aten.mm.default) == "lower"
    assert _autocast.probe_cpu_policy(aten.linalg_inv.default) == "fp32"
    assert _autocast.probe_cpu_policy(aten.cat.default) == "promote"
    assert _autocast.probe_cpu_policy(aten.add.Tensor) is None  # no CPU autocast kernel: no cast


def test_an_unknown_autocast_policy_raises_instead_of_guessing():
    kernel = _autocast._kernel(aten.mm.default, None)
    with torch.autocast("jax", dtype=torch.bfloat16):
        with pytest.raises(TorchVersionError, match="policy jaxtorch could not"):
            kernel(torch.ones(2, 2, device="jax"), torch.ones(2, 2, device="jax"))


# ---- the jax backend's kernels (PrivateUse1 / AutogradPrivateUse1) -----------------------------
def test_backend_kernels_are_registered_and_reached():
    for op in ("aten::_copy_from", "aten::empty.memory_format", "aten::empty_strided"):
        assert _kernel_at(op, "PrivateUse1"), op
    assert torch.empty(2, 3, device="jax").shape == (2, 3)
    assert torch.empty_strided((2, 3), (3, 1), device="jax").device.type == "jax"
    x = torch.arange(4.0)
    assert torch.equal(x.to("jax").cpu(), x)


def test_whole_ops_reach_their_lowering_undecomposed():
    """`keep_whole` ops (PrivateUse1 + AutogradPrivateUse1 kernels) arrive whole at the interpreter."""
    op = aten.rms_norm.default
    assert _kernel_at("aten::rms_norm", "PrivateUse1") and _kernel_at("aten::rms_norm", "AutogradPrivateUse1")
    original = registry.lookup(op)
    calls = [0]

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    registry.register_op(op, counted)
    try:
        x = torch.randn(2, 4)
        got = F.rms_norm(x.to("jax"), (4,))
    finally:
        registry.register_op(op, original)
    assert calls[0] == 1
    torch.testing.assert_close(got.cpu(), F.rms_norm(x, (4,)))


def test_batch_norm_and_rrelu_autograd_kernels_are_reached():
    for op in ("aten::native_batch_norm", "aten::_native_batch_norm_legit"):
        assert _kernel_at(op, "AutogradPrivateUse1"), op
    for op in ("aten::rrelu_with_noise", "aten::rrelu_with_noise_"):
        assert _kernel_at(op, "AutogradPrivateUse1"), op
    torch.manual_seed(0)
    bn_cpu = torch.nn.BatchNorm1d(3)
    bn = torch.nn.BatchNorm1d(3).to("jax")
    x = torch.randn(5, 3)
    xj = x.to("jax").requires_grad_()
    bn(xj).square().sum().backward()
    bn_cpu(x).sum()
    torch.testing.assert_close(bn.running_mean.cpu(), bn_cpu.running_mean)  # written by the kernel
    assert xj.grad is not None
    xr = (-torch.rand(6) - 0.5).to("jax").requires_grad_()
    y = F.rrelu(xr, training=True)
    y.sum().backward()
    torch.testing.assert_close(xr.grad.cpu(), (y / xr).detach().cpu())  # the gradient is the noise drawn


# ---- module moves, generators, serialization, optimizers ---------------------------------------
def test_module_to_keeps_parameter_objects():
    assert getattr(torch.nn.Module.to, "_jaxtorch", False)
    lin = torch.nn.Linear(2, 2)
    before = list(lin.parameters())
    lin.to("jax")
    assert all(a is b for a, b in zip(lin.parameters(), before))
    assert lin.weight.device.type == "jax"
    lin.cpu()
    assert all(a is b for a, b in zip(lin.parameters(), before)) and lin.weight.device.type == "cpu"


def test_torch_generator_takes_the_jax_device():
    g = torch.Generator(device="jax").manual_seed(0)
    a = torch.rand(3, device="jax", generator=g)
    b = torch.rand(3, device="jax", generator=torch.Generator(device="jax").manual_seed(0))
    assert torch.equal(a.cpu(), b.cpu())
    assert type(torch.Generator()) is torch._C.Generator  # the CPU generator is torch's own


def test_torch_load_map_location_jax():
    buf = io.BytesIO()
    torch.save({"w": torch.arange(3.0)}, buf)
    buf.seek(0)
    w = torch.load(buf, map_location="jax")["w"]
    assert w.device.type == "jax" and w.cpu().tolist() == [0.0, 1.0, 2.0]


def test_optimizers_take_their_foreach_path_for_jax_parameters():
    import torch.optim.optimizer as optimizer

    p = torch.nn.Parameter(torch.ones(2)).to("jax")
    assert type(p) in optimizer._foreach_supported_types
    assert optimizer._default_to_fused_or_foreach([p], differentiable=False, use_fused=False) == (False, True)


# ---- JAX: torch tensors as JAX inputs; import hook; flax detection -------------------------------
def test_jax_takes_torch_tensors_as_inputs():
    from jaxtorch.bridge.tensor import _convert

    assert _convert.TENSORS_ARE_JAX_INPUTS
    assert jax.jit(lambda a: a * 2)(torch.ones(3)).tolist() == [2.0, 2.0, 2.0]


def test_hugging_face_caches_are_pytrees_once_imported():
    cache_utils = pytest.importorskip("transformers.cache_utils")
    from jaxtorch.bridge.core import _pytrees

    assert not any(isinstance(f, _pytrees._AfterImport) for f in sys.meta_path)  # it ran and left
    assert cache_utils.DynamicCache in _pytrees._registered
    cache = cache_utils.DynamicCache()
    assert all(leaf is not cache for leaf in jax.tree_util.tree_leaves(cache))  # a node, not a leaf


def test_is_nnx_does_not_import_flax(monkeypatch):
    import equinox as eqx

    monkeypatch.delitem(sys.modules, "flax.nnx", raising=False)
    assert not _jax_module._is_nnx(eqx.nn.Linear(2, 2, key=jax.random.key(0)))
    assert "flax.nnx" not in sys.modules
    monkeypatch.setitem(sys.modules, "flax.nnx", object())  # a Flax that failed half-way: no Module
    assert not _jax_module._is_nnx(object())


# ---- ops that exist only in some torch releases --------------------------------------------------
def test_versioned_ops_register_only_what_this_torch_has():
    for name in registry.VERSIONED_OPS:
        base, _, overload = name.partition(".")
        op = getattr(getattr(aten, base, None), overload, None)
        assert registry.versioned(name) == ((op,) if op is not None else ())
    with pytest.raises(KeyError, match="VERSIONED_OPS"):
        registry.versioned("add.Tensor")
    if hasattr(aten, "cholesky"):  # torch 2.13
        a = torch.tensor([[4.0, 2.0], [2.0, 3.0]])
        assert registry.lookup(aten.cholesky.default) is not None
        with warnings.catch_warnings():  # torch's deprecation warning (once per process)
            warnings.simplefilter("ignore")
            got, want = torch.cholesky(a.to("jax")).cpu(), torch.cholesky(a)
        torch.testing.assert_close(got, want)
