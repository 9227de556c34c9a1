"""`torch._foreach_*` ops on the jax device (bridge/foreach.py): PyTorch's own foreach OpInfo
database against eager CPU torch, in eager and lazy mode, and the optimizer path that uses them."""

from __future__ import annotations

import contextlib

import jax
import pytest
import torch
from torch.testing._internal.common_methods_invocations import (
    foreach_binary_op_db,
    foreach_other_op_db,
    foreach_pointwise_op_db,
    foreach_reduce_op_db,
    foreach_unary_op_db,
)

import jaxtorch
import jaxtorch.xla as xm
from jaxtorch import Float64Error
from jaxtorch.bridge.dispatch import _foreach as foreach

jaxtorch.enable_globally()

OPS = {
    op.name: op
    for op in (
        foreach_unary_op_db
        + foreach_binary_op_db
        + foreach_pointwise_op_db
        + foreach_reduce_op_db
        + foreach_other_op_db
    )
}
# name -> why the jax device's answer differs from CPU torch's (checked both ways)
EXPECTED: dict[str, str] = {}
# float32 defaults of `assert_close` except where the op sums: a 16-term dot product in
# another order differs by a few float32 ulps (the OpInfo suite allows 1e-3 everywhere)
TOLERANCE = {"_foreach_mm": dict(rtol=1e-5, atol=1e-4)}


_WIDE = (torch.float64, torch.complex128)


def _to(x, device):
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, (list, tuple)):
        return type(x)(_to(y, device) for y in x)
    return x


def _run(fn, sample, device, lazy: bool):
    inputs = _to([t.detach().clone() for t in sample.input], device)
    args, kwargs = _to(list(sample.args), device), {k: _to(v, device) for k, v in sample.kwargs.items()}
    if lazy:
        with jaxtorch.lazy():
            out = fn(inputs, *args, **kwargs)
    else:
        out = fn(inputs, *args, **kwargs)
    return _to(out, "cpu"), _to(inputs, "cpu")


def _check(op, lazy: bool) -> None:
    samples = list(op.sample_inputs("cpu", torch.float32, num_input_tensors=[2]))
    assert samples
    for variant in (op.op, op.inplace_variant):
        if variant is None:
            continue
        for s in samples:
            try:
                want = _run(variant, s, "cpu", False)
            except (RuntimeError, TypeError, ValueError):
                continue  # torch refuses this sample for this variant (e.g. an in-place dtype change)
            if s.kwargs.get("dtype") in _WIDE and not jax.config.jax_enable_x64:
                with pytest.raises(Float64Error):  # the documented error, not a silent float32
                    _run(variant, s, "jax", lazy)
                continue
            got = _run(variant, s, "jax", lazy)
            torch.testing.assert_close(
                got,
                want,
                equal_nan=True,
                **TOLERANCE.get(op.name, {}),
                msg=lambda m: f"{op.name} {s.args} {s.kwargs}: {m}",
            )


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
@pytest.mark.parametrize("name", sorted(OPS))
def test_foreach_opinfo(name, lazy):
    if name in EXPECTED:
        with pytest.raises(AssertionError):
            _check(OPS[name], lazy)
        return
    _check(OPS[name], lazy)


def test_expected_names_exist():
    assert set(EXPECTED) <= set(OPS)


def test_common_overloads_are_one_call():
    """The overloads the optimizers use are applied over the whole list in one lowering."""
    aten = torch.ops.aten
    for f in (
        aten._foreach_lerp_.Scalar,
        aten._foreach_mul_.Scalar,
        aten._foreach_addcmul_.Scalar,
        aten._foreach_addcdiv_.ScalarList,
        aten._foreach_sqrt.default,
        aten._foreach_div_.ScalarList,
        aten._foreach_add_.Scalar,
        aten._foreach_add_.List,
        aten._foreach_maximum_.List,
        aten._foreach_copy_.default,
        aten._foreach_zero_.default,
    ):
        assert foreach.lowering_for(f) is not None, f
    # ATen runs these as other ops' kernels: clamp_min, linalg_vector_norm
    assert foreach.per_element(aten._foreach_maximum_.Scalar)[0] is aten.clamp_min.default
    assert foreach.per_element(aten._foreach_norm.Scalar)[0] is aten.linalg_vector_norm.default
    # no per-element op with these argument types (a tensor of scalars): the per-tensor loop keeps them
    assert foreach.lowering_for(aten._foreach_addcmul_.Tensor) is None
    assert foreach.lowering_for(aten._foreach_add.List_out) is None


def _mlp(n_layers: int):
    torch.manual_seed(0)
    layers = []
    for _ in range(n_layers):
        layers += [torch.nn.Linear(8, 8), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def _lazy_adamw_ops(n_layers: int) -> tuple[int, list[float], dict]:
    """Ops recorded by one steady lazy `AdamW.step()` on an MLP, its losses and final weights."""
    model = _mlp(n_layers).to("jax")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)).to("jax")
    losses = []
    with jaxtorch.lazy():
        for _ in range(3):
            opt.zero_grad()
            loss = model(x).square().mean()
            loss.backward()
            xm.mark_step()
            before = jaxtorch.bridge.core._lazy.pending_ops()
            opt.step()
            n = jaxtorch.bridge.core._lazy.pending_ops() - before
            xm.mark_step()
            losses.append(float(loss.cpu()))
    return n, losses, {k: v.cpu() for k, v in model.state_dict().items()}


def test_adamw_takes_the_foreach_path_and_matches_cpu():
    from torch.optim.optimizer import _default_to_fused_or_foreach

    p = torch.nn.Linear(2, 2).to("jax").weight
    assert _default_to_fused_or_foreach([p], differentiable=False) == (False, True)
    ops2, losses, weights = _lazy_adamw_ops(2)
    ops6, _, _ = _lazy_adamw_ops(6)
    assert ops2 == ops6 and ops2 < 20, (ops2, ops6)  # one node per foreach op, whatever the parameter count
    model = _mlp(2)  # the same loop in eager CPU torch (single-tensor AdamW)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    want = []
    for _ in range(3):
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        want.append(float(loss))
    assert losses == pytest.approx(want, rel=1e-5, abs=1e-6)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(weights[k], v, rtol=1e-5, atol=1e-6)


_O = torch.optim
OPTIMIZERS = {
    "Adam-amsgrad-wd": lambda p, **k: _O.Adam(p, lr=1e-2, amsgrad=True, weight_decay=0.1, **k),
    "AdamW-maximize": lambda p, **k: _O.AdamW(p, lr=1e-2, maximize=True, **k),
    "SGD-momentum-wd": lambda p, **k: _O.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01, dampening=0.1, **k),
    "RMSprop-centered": lambda p, **k: _O.RMSprop(p, lr=1e-2, momentum=0.5, centered=True, **k),
    "Adagrad": lambda p, **k: _O.Adagrad(p, lr=1e-1, lr_decay=0.01, weight_decay=0.01, **k),
    "Adadelta": lambda p, **k: _O.Adadelta(p, lr=1.0, weight_decay=0.01, **k),
    "NAdam-decoupled": lambda p, **k: _O.NAdam(p, lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True, **k),
    "RAdam": lambda p, **k: _O.RAdam(p, lr=1e-2, **k),
    "Adamax": lambda p, **k: _O.Adamax(p, lr=1e-2, **k),
    "ASGD": lambda p, **k: _O.ASGD(p, lr=1e-2, t0=2, **k),
    "Rprop": lambda p, **k: _O.Rprop(p, lr=1e-2, **k),
}


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_torch_optimizers_foreach_path_matches_cpu(name, lazy):
    """Every torch.optim optimizer with a foreach path, on the jax device (where it takes that
    path by default), against CPU torch's foreach path: 6 steps, the same parameters."""
    make = OPTIMIZERS[name]
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))
    model.load_state_dict(ref.state_dict())
    model.to("jax")
    ropt, opt = make(ref.parameters(), foreach=True), make(model.parameters())
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(1))
    xj = x.to("jax")
    for _ in range(6):
        ropt.zero_grad()
        ref(x).square().mean().backward()
        ropt.step()
        with jaxtorch.lazy() if lazy else contextlib.nullcontext():
            opt.zero_grad()
            model(xj).square().mean().backward()
            opt.step()
    torch.manual_seed(0)
    start = torch.nn.Linear(5, 7).weight  # (the initial first-layer weight)
    assert not torch.allclose(ref[0].weight, start)  # the steps moved the parameters
    for a, b in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(b.cpu(), a.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_in_place_calls_whose_lists_alias_keep_torchs_loop_order(lazy):
    """`_foreach_copy_([a, b], [b, a])` copies in order (both end as b); a one-call update
    would swap them. Also a list holding one tensor twice, and a scalar tensor that is an output."""

    def run(device):
        a, b = torch.tensor([1.0, 2.0]).to(device), torch.tensor([3.0, 4.0]).to(device)
        c = torch.tensor(2.0).to(device)
        with jaxtorch.lazy() if lazy and device == "jax" else contextlib.nullcontext():
            torch._foreach_copy_([a, b], [b, a])
            torch._foreach_add_([a, a], [b, b])
            torch._foreach_mul_([c, b], c)
        return [t.cpu() for t in (a, b, c)]

    for got, want in zip(run("jax"), run("cpu")):
        assert torch.equal(got, want), (got, want)
    aten = torch.ops.aten
    x, y = torch.ones(2).to("jax"), torch.ones(2).to("jax")
    from jaxtorch.bridge.dispatch._interpreter import _root

    assert foreach.aliased_across(([x, y], [y, x]), {}, _root)
    assert foreach.aliased_across(([x, x[:1]], [y, y]), {}, _root)  # two views of one root
    assert not foreach.aliased_across(([x, y], [x, y]), {}, _root)  # each element reads itself: fine
    assert foreach.lowering_for(aten._foreach_copy_.default) is not None
