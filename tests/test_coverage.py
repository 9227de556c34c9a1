"""The coverage tool: classification of ops, the command line, and `check(model, ...)`."""

from __future__ import annotations

import io
import subprocess
import sys

import jax.numpy as jnp
import pytest
import torch

import jaxtorch
import jaxtorch.coverage as cov
from jaxtorch.bridge.core import _registry as registry
from jaxtorch.bridge.dispatch import _interpreter as interpreter

aten = torch.ops.aten

# Custom ops to control every case: one with no kernel jaxtorch knows ("missing"), one whose
# CompositeImplicitAutograd kernel decomposes into it, and one that decomposes into plain aten ops.
_lib = torch.library.Library("jaxtorch_covtest", "DEF")
_lib.define("missing(Tensor x) -> Tensor")
_lib.define("via_missing(Tensor x) -> Tensor")
_lib.define("via_aten(Tensor x) -> Tensor")
_lib.define("table_decomp(Tensor x) -> Tensor")
_lib.impl("missing", lambda x: x * 2, "CompositeExplicitAutograd")
_lib.impl("missing", lambda x: torch.empty_like(x), "Meta")
_lib.impl("via_missing", lambda x: torch.ops.jaxtorch_covtest.missing(x) + 1, "CompositeImplicitAutograd")
_lib.impl("via_aten", lambda x: torch.sin(x) * 3, "CompositeImplicitAutograd")
_lib.impl("table_decomp", lambda x: x * 2 + 1, "CompositeExplicitAutograd")
_lib.impl("table_decomp", lambda x: torch.empty_like(x), "Meta")
OPS = torch.ops.jaxtorch_covtest


def test_how_classifies_like_the_interpreter():
    assert cov.how(aten.add.Tensor) == cov.LOWERED
    assert cov.how(aten.add_.Tensor) == cov.LOWERED  # through the functional sibling
    assert cov.how(aten.add.out) == cov.LOWERED
    assert cov.how(aten._to_copy.default) == cov.LOWERED  # the bridge's own op
    assert cov.how(aten.copy.default) == cov.LOWERED  # the functional copy_
    assert cov.how(OPS.missing.default) == cov.MISSING
    assert cov.how(OPS.via_aten.default) == cov.DECOMPOSED
    assert cov.family(aten.arange.start_step) == "creation"
    assert cov.family(aten.normal_.default) == "random"
    assert cov.family(aten._to_copy.default) == "bridge"


def test_registering_a_lowering_changes_the_classification():
    try:
        registry.register(OPS.missing.default)(lambda x: x * 2)
        assert cov.how(OPS.missing.default) == cov.LOWERED
        assert cov.family(OPS.missing.default) == "tests.test_coverage"
    finally:
        registry.unregister(OPS.missing.default)
        interpreter.invalidate_cache()
    assert cov.how(OPS.missing.default) == cov.MISSING


def test_every_decomposed_or_missing_classification_agrees_with_the_runner():
    # Missing ops build the interpreter's `unsupported` runner; lowered ones never do.
    for op in cov.universe("all"):
        runner = interpreter._runner(op)
        unsupported = runner.__name__ == "unsupported"
        assert unsupported == (cov.how(op) == cov.MISSING), op


def test_universe_core_contains_core_ir_and_decomposed_ops():
    ops = set(cov.universe("core"))
    assert aten.add.Tensor in ops and aten.convolution.default in ops  # core-tagged
    assert aten.addcmul.default in ops  # a core_aten_decompositions() key
    assert all(op.namespace == "aten" for op in ops)
    assert not any("cudnn" in cov.op_name(op) for op in ops)
    assert len(cov.universe("all")) > len(ops)


def test_report_counts_add_up():
    rep = cov.report("core", progress=False)
    total = len(cov.universe("core"))
    assert len(rep.lowered) + len(rep.decomposed) + len(rep.missing) == total
    assert rep.families["creation"] >= 30 and rep.families["random"] >= 30
    text = rep.format(list_decomposed=True)
    assert "Universe 'core'" in text and "creation" in text and "Covered only via PyTorch decompositions" in text
    for name in rep.missing:
        assert name in text
    assert rep.missing == []  # every core ATen op has a lowering or a decomposition


def test_public_universe_counts_every_op_a_user_calls_by_name():
    # issue 30 item 6: torch.select_copy & co. were missing while the core-only report said 0 missing
    ops = set(cov.universe("public"))
    assert cov.universe() == cov.universe("public") and cov.report(progress=False).universe == "public"
    assert set(cov.universe("core")) < ops <= set(cov.universe("all"))
    assert aten.histc.default in ops and aten.gelu.out in ops and aten.special_erfcx.default in ops
    assert not any(cov.op_name(op).startswith(("aten::crow_indices", "aten::q_scale")) for op in ops)
    copies = [aten.select_copy.int, aten.slice_copy.Tensor, aten.split_copy.Tensor, aten.detach_copy.default]
    copies += [aten.view_as_real_copy.default, aten.select_copy.int_out, aten.split_copy.Tensor_out]
    for op in copies:
        assert op in ops and cov.how(op) == cov.LOWERED, op
        assert cov.family(op) == "shape", op


def test_command_line_entry_point():
    out = subprocess.run(
        [sys.executable, "-m", "jaxtorch.coverage", "--no-list-missing"], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert "Warning" not in out.stderr, out.stderr  # runpy's RuntimeWarning about sys.modules
    assert "classifying ops" not in out.stderr, out.stderr  # no progress bar into a pipe
    assert "Lowerings registered, by family" in out.stdout
    assert "creation" in out.stdout and "random" in out.stdout
    assert "no lowering and no decomposition" in out.stdout


def test_progress_bars_only_on_terminals_and_notebooks(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.delitem(sys.modules, "ipykernel", raising=False)
    monkeypatch.setattr(sys, "stderr", Terminal())
    assert cov._progress_shown(1000) and not cov._progress_shown(3)
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # a pipe or a log file
    assert not cov._progress_shown(1000)


def test_main_family_listing(capsys):
    assert cov.main(["--family", "creation"]) == 0
    listed = capsys.readouterr().out.split()
    assert "aten::arange.start_step" in listed and "aten::eye.m" in listed


# ---- check ------------------------------------------------------------------------------------
class _CNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.bn = torch.nn.BatchNorm2d(4)
        self.drop = torch.nn.Dropout(0.2)
        self.fc = torch.nn.Linear(4 * 6 * 6, 5)

    def forward(self, x):
        return self.fc(self.drop(torch.relu(self.bn(self.conv(x)))).flatten(1))


def test_check_supported_models_are_clean():
    assert cov.check(torch.nn.Linear(3, 2), torch.ones(1, 3)) == []
    assert cov.check(_CNN(), jnp.ones((2, 3, 8, 8)), backward=True) == []


def test_check_does_not_change_the_model():
    m = _CNN().train()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    cov.check(m, torch.randn(2, 3, 8, 8), backward=True)
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in m.parameters())


def test_check_lists_missing_ops_and_decompositions_into_them():
    assert cov.check(lambda x: OPS.missing(x) + 1, torch.ones(3)) == [
        "jaxtorch_covtest::missing.default: no lowering and no decomposition"
    ]
    assert cov.check(lambda x: OPS.via_aten(x), torch.ones(3)) == []
    # CompositeImplicit ops decompose before the dispatcher, as in jaxtorch: the inner op is reported.
    assert cov.check(lambda x: OPS.via_missing(x), torch.ones(3)) == [
        "jaxtorch_covtest::missing.default: no lowering and no decomposition"
    ]


def test_check_follows_decompositions_recursively():
    from torch._decomp import decomposition_table

    op = OPS.table_decomp.default
    try:
        decomposition_table[op] = lambda x: OPS.missing(x) + 1
        interpreter.invalidate_cache()
        assert cov.how(op) == cov.DECOMPOSED
        assert cov.check(lambda x: OPS.table_decomp(x), torch.ones(3)) == [
            "jaxtorch_covtest::table_decomp.default: its decomposition calls jaxtorch_covtest::missing.default "
            "(no lowering and no decomposition)"
        ]
        with pytest.raises(jaxtorch.UnsupportedOpError, match="missing"):
            jaxtorch.call_torch(lambda x: OPS.table_decomp(x), jnp.ones(3))
        decomposition_table[op] = lambda x: torch.sin(x) + 1
        interpreter.invalidate_cache()
        assert cov.check(lambda x: OPS.table_decomp(x), torch.ones(3)) == []
    finally:
        decomposition_table.pop(op, None)
        interpreter.invalidate_cache()
    assert cov.how(op) == cov.MISSING


def test_check_agrees_with_running_cdist():
    # aten.cdist's CPU path calls _cdist_forward; whatever jaxtorch lowers, the verdict must agree with running it.
    problems = cov.check(
        lambda a, b: torch.cdist(a, b, compute_mode="donot_use_mm_for_euclid_dist"), torch.ones(3, 2), torch.ones(4, 2)
    )
    try:
        jaxtorch.call_torch(
            lambda a, b: torch.cdist(a, b, compute_mode="donot_use_mm_for_euclid_dist"),
            jnp.ones((3, 2)),
            jnp.ones((4, 2)),
        )
        runs = True
    except jaxtorch.UnsupportedOpError:
        runs = False
    assert runs == (problems == []), problems


def test_check_falls_back_to_cpu_for_data_dependent_python():
    def f(x):
        return x * 2 if x.sum().item() > 0 else OPS.missing(x)

    assert cov.check(f, torch.ones(3)) == []  # .item() fails on meta; the CPU run takes the first branch
    assert cov.check(f, -torch.ones(3)) == ["jaxtorch_covtest::missing.default: no lowering and no decomposition"]


def test_check_jit_flags_data_dependent_ops():
    # (nonzero is not flagged: it also runs under jit when its input is a constant)
    assert cov.check(lambda x: torch.unique(x), torch.ones(3)) == []
    problems = cov.check(lambda x: torch.unique(x), torch.ones(3), jit=True)
    assert len(problems) == 1 and problems[0].startswith("aten::_unique2.default: output shape depends on data")


def test_check_model_on_the_jax_device():
    with jaxtorch.default_env():
        m = torch.nn.Linear(3, 2).to("jax")
        x = torch.ones(4, 3, device="jax")
        assert cov.check(m, x, backward=True) == []
        assert isinstance(m.weight, jaxtorch.JaxTensor)  # still on jax, untouched


@pytest.mark.parametrize("backward", [False, True])
def test_check_records_backward_ops_only_when_asked(backward):
    seen = []
    real = cov._Checker.problem

    def spy(self, op, args, kwargs, depth=0):
        seen.append(cov.op_name(op))
        return real(self, op, args, kwargs, depth)

    cov._Checker.problem = spy
    try:
        cov.check(torch.nn.Linear(3, 2), torch.ones(1, 3), backward=backward)
    finally:
        cov._Checker.problem = real
    assert "aten::addmm.default" in seen
    assert ("aten::mm.default" in seen) == backward  # mm appears only in Linear's backward
