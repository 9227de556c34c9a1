"""Shared test set-up: one device per test process (multi-device tests spawn subprocesses), and the test tiers.

Tiers (see CONTRIBUTING.md). Every `slow` mark of the suite is put here, by `pytest_collection_modifyitems`,
never by decorators in the test files:

- the full suite, `python -m pytest -n 2 -q`, runs everything (CI);
- the fast tier, `python -m pytest -n 2 -q -m "not slow"`, runs a fixed sample: every test file keeps at least
  one test, each parametrised test keeps a deterministic 1 in N of its cases (N from `_EVERY`), heavy tests
  (`_HEAVY`) are left to the full suite, and the OpInfo / ModuleInfo harnesses check one sample input per
  entry instead of four (entries listed as expected failures keep all theirs, so the two-way check holds).

The full suite runs the files with the longest tests first (`_LONG_FIRST`), so that `pytest-xdist`'s workers
do not end with one of them alone on the clock.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import zlib

import pytest
import torch

# A parametrised test keeps 1 case in N in the fast tier: N by file (the longest key that starts the node id),
# `_EVERY_DEFAULT` elsewhere.
_EVERY: dict[str, int] = {
    "tests/test_opinfo.py": 40,
    "tests/modules/test_module_db.py": 20,
    "tests/grads/test_module_db.py": 12,
    "tests/ops/test_half_accumulation.py": 25,
    "tests/bridge/test_write_rule.py": 60,
    "tests/adversarial/test_contracts.py": 24,
    "tests/bridge/test_dtype_identity.py": 20,
    "tests/bridge/test_factories_plain.py": 60,  # a fresh Python process per case
}
_EVERY_DEFAULT = 12
# The same for tests without parameters, in the files where they are heavy; 1 (all kept) elsewhere.
_EVERY_PLAIN: dict[str, int] = {
    f"tests/{name}.py": 3
    for name in (
        "bridge/test_api",
        "bridge/test_remat",
        "bridge/test_device_guard",
        "bridge/test_errors",
        "bridge/test_foreach",
        "bridge/test_generators",
        "bridge/test_lazy",
        "bridge/test_safety",
        "bridge/test_scopes",
        "interop/test_compile_autograd",
        "interop/test_compile_closures",
        "interop/test_compile_export",
        "interop/test_compile_state",
        "interop/test_compile_train_step",
        "interop/test_hf_caches",
        "interop/test_jax_in_torch",
        "interop/test_torch_in_jax",
        "ops/test_linalg",
        "ops/test_losses_extra",
        "ops/test_nn",
        "ops/test_reductions",
        "ops/test_resampling",
        "ops/test_rnn",
        "ops/test_segment_hash_hist_split",
        "ops/test_shape_indexing",
        "ops/test_special_grads",
        "train/test_step",
        "train/test_step_memory",
    )
}

# Node-id prefixes of heavy tests (whole models, subprocesses, builds): in the full suite only, except that a
# file all of whose tests are heavy still runs its first one in the fast tier.
_HEAVY: tuple[str, ...] = (
    "tests/test_models.py",
    "tests/grads/test_hf_models.py",
    "tests/test_notebooks.py::test_notebook_runs",
    "tests/test_docs.py::test_strict_build",
    "tests/test_packaging.py::test_the_wheel_is_pure_python",
    "tests/train/test_peft.py",
    "tests/train/test_sharding.py::test_on_eight_devices",
    "tests/train/test_sharding.py::test_llama_tensor_parallel",
    "tests/test_readme.py::test_readme_block_runs_as_written",
    "tests/train/test_load.py::test_two_processes_each_read_their_half",
    "tests/train/test_load.py::test_tensor_parallel_on_8_devices",
    "tests/train/test_load.py::test_sharding_rule_that_does_not_divide",
    "tests/bridge/test_device_guard.py::test_first_import_compiles_once_under_concurrent_imports",
    "tests/bridge/test_device_guard.py::test_without_a_compiler",
    "tests/ops/test_rnn.py::test_pytorch_first",
    "tests/bridge/test_remat.py::test_hf_remat",
)

# Files whose single tests are the longest of the suite, run first in any run (their order among themselves
# and the order within each file are kept).
_LONG_FIRST: tuple[str, ...] = (
    "tests/test_notebooks.py",
    "tests/test_docs.py",
    "tests/train/test_distributed.py",
    "tests/test_models.py",
    "tests/grads/test_hf_models.py",
    "tests/train/test_peft.py",
    "tests/train/test_sharding.py",
    "tests/test_packaging.py",
    "tests/train/test_example.py",
    "tests/test_readme.py",
    "tests/train/test_load.py",
)

# Sample inputs per entry in the fast tier (the full suite checks 4): test file -> N_SAMPLES of its `harness`.
_FAST_SAMPLES: dict[str, int] = {"tests/test_opinfo.py": 1, "tests/modules/test_module_db.py": 1}
# The same in the full suite, where it checks fewer than its harness's 4 (CI time): the OpInfo sweep's first two
# samples per entry and dtype cost 69 % of its four (measured on 24 entries: 45.6 s against 65.9 s of CPU).
_FULL_SAMPLES: dict[str, int] = {"tests/test_opinfo.py": 2}


def _every(nodeid: str) -> int:
    """The N of "1 in N" for `nodeid`: from `_EVERY` for a parametrised case, `_EVERY_PLAIN` for a test without
    parameters, by the longest key that starts `nodeid`; else the table's default.

    Example: `_every("tests/test_opinfo.py::test_opinfo[jit-add]") == 40`."""
    table, default = (_EVERY, _EVERY_DEFAULT) if "[" in nodeid else (_EVERY_PLAIN, 1)
    hits = [k for k in table if nodeid.startswith(k)]
    return table[max(hits, key=len)] if hits else default


def in_fast_tier(nodeid: str) -> bool:
    """Whether the fast tier keeps `nodeid` (before the rule that every file keeps one test).

    A test is kept when the CRC-32 of its node id is 0 modulo its N (`_every`): deterministic, and a test added
    or removed does not move the others in or out. Example: `in_fast_tier("tests/test_architecture.py::test_x")`
    is True (N is 1 there)."""
    if nodeid.startswith(_HEAVY):
        return False
    return zlib.crc32(nodeid.encode()) % _every(nodeid) == 0


def _file(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(config, items):
    """Mark `slow` what the fast tier leaves out, and put the files with the longest tests first."""
    kept_files = {_file(item.nodeid) for item in items if in_fast_tier(item.nodeid)}
    first: dict[str, pytest.Item] = {}
    for item in items:
        first.setdefault(_file(item.nodeid), item)
    for item in items:
        path = _file(item.nodeid)
        stands_for_file = path not in kept_files and first[path] is item  # a file of heavy tests only
        if not in_fast_tier(item.nodeid) and not stands_for_file:
            item.add_marker(pytest.mark.slow)
    rank = {p: i for i, p in enumerate(_LONG_FIRST)}
    items.sort(key=lambda it: rank.get(_file(it.nodeid), len(rank)))  # stable: the rest keep their order


def _is_fast_tier(config) -> bool:
    """Whether this run is the fast tier: its `-m` expression says `not slow` (`-m "not slow"`,
    `-m "not slow and not gpu"`). Selecting tests by `-k` or by path leaves them as the full suite runs them."""
    return "not slow" in " ".join((config.option.markexpr or "").split())


@pytest.fixture(autouse=True)
def _fast_samples(request, monkeypatch):
    """In the fast tier (`_FAST_SAMPLES`) and for the OpInfo sweep in the full suite (`_FULL_SAMPLES`), the
    OpInfo / ModuleInfo harnesses check fewer sample inputs per entry, except for the entries their test file
    lists as expected failures (those must still fail, on the sample that fails)."""
    table = _FAST_SAMPLES if _is_fast_tier(request.config) else _FULL_SAMPLES
    n = table.get(_file(request.node.nodeid))
    params = getattr(request.node, "callspec", None)
    if n is None or params is None:
        return
    module = request.node.module
    key = (params.params["mode"], params.params.get("eid", params.params.get("name")))
    if key not in module.EXPECTED:
        monkeypatch.setattr(module.harness, "N_SAMPLES", n)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
