"""Op coverage: which ATen ops jaxtorch lowers, which it runs through PyTorch's own
decompositions, and which it cannot run.

An op overload is, exactly as the interpreter decides (both read its route,
`jaxtorch.bridge.dispatch._routing.route(op).kind`):
- **lowered**: it has a registered lowering (`jaxtorch.bridge.core._registry`), or it is an
  in-place / `out=` variant of a lowered functional op, or the bridge handles it itself
  (`_to_copy`, `copy_`, `detach`, ...);
- **decomposed**: no lowering, but PyTorch has a decomposition for it
  (`torch._decomp.decomposition_table` or a `CompositeImplicitAutograd` kernel); it runs
  if every op the decomposition calls runs;
- **missing**: neither: calling it raises `UnsupportedOpError`.

The universe of `python -m jaxtorch.coverage` (the denominator) is, by default, the
*public* universe: every op a user can call. It is the *core* universe (`--universe core`:
every ATen overload tagged `torch.Tag.core`, the Core ATen IR that `torch.export` lowers to,
plus every key of `torch._decomp.core_aten_decompositions()`) together with every overload
(functional, in-place and `out=`) of each ATen op that a public name calls: `torch.X`,
`torch.Tensor.X`, `torch.nn.functional.X` (and the `torch._C._nn` functions it calls),
`torch.special.X`, `torch.linalg.X`, `torch.fft.X` (so `torch.select_copy` counts, which the
core list lacks). `--universe all` widens it to every `aten::` overload registered in the
dispatcher. Every universe leaves out backend-specific ops (cudnn, miopen, mkldnn, mps,
quantized, sparse, nested, ...).

Command line:
    python -m jaxtorch.coverage                    # counts per family, missing public ops
    python -m jaxtorch.coverage --universe core    # the Core ATen IR only
    python -m jaxtorch.coverage --list-decomposed  # also list decomposition-only ops
    python -m jaxtorch.coverage --universe all

**Example:** before running a model,
    ```python
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.GELU(), torch.nn.Flatten())
    problems = jaxtorch.coverage.check(model, torch.ones(1, 3, 8, 8))   # [] when everything runs
    assert problems == []
    ```
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import sys
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .._compat import (
    OpOverload,
    OpOverloadPacket,
    TorchDispatchMode,
    all_op_names,
    core_aten_decompositions,
    torch_nn_functions,
    torch_pytree,
)

with warnings.catch_warnings():  # tqdm.auto warns in Jupyter when ipywidgets is missing; it falls back fine
    warnings.simplefilter("ignore")
    from tqdm.auto import tqdm

from ..bridge.core import _registry as registry
from ..bridge.core._dtypes import to_torch_dtype
from ..bridge.dispatch._routing import SPECIAL_OPS, Kind, decomposition, mutated_args, route

aten = torch.ops.aten
LOWERED, DECOMPOSED, MISSING = "lowered", "decomposed", "missing"
_VERDICT = {  # route kind -> what coverage calls it
    Kind.SPECIAL: LOWERED,
    Kind.FOREACH: LOWERED,
    Kind.VIEW: LOWERED,
    Kind.MUTATING: LOWERED,
    Kind.FUNCTIONAL: LOWERED,
    Kind.VIA_SIBLING: LOWERED,
    Kind.DECOMPOSED: DECOMPOSED,
    Kind.FOREACH_LOOP: DECOMPOSED,
    Kind.SIBLING_DECOMPOSED: DECOMPOSED,
    Kind.UNSUPPORTED: MISSING,
}
_BACKEND_WORDS = (
    "cudnn",
    "miopen",
    "mkldnn",
    "mps",
    "quantize",
    "quantized",
    "sparse",
    "nested",
    "fbgemm",
    "cufft",
    "cudnn",
    "_cslt",
    "vulkan",
    "xnnpack",
    "onednn",
    "_efficientzerotensor",
    "_test_",
    "_fused_moving_avg",
    "_sparse",
    "to_padded_tensor",
    "coalesce",
    "_mkl",
)
# Ops that exist only for sparse or quantized layouts (their names do not say so)
_LAYOUT_ONLY = {
    "indices",
    "values",
    "crow_indices",
    "col_indices",
    "ccol_indices",
    "row_indices",
    "_indices",
    "_values",
    "_nnz",
    "dense_dim",
    "_to_dense",
    "hspmm",
    "int_repr",
    "q_scale",
    "q_zero_point",
    "qscheme",
    "q_per_channel_axis",
    "q_per_channel_scales",
    "q_per_channel_zero_points",
}
_PROGRESS_MIN = 64  # show a progress bar from this many ops on


def _progress_shown(n: int) -> bool:
    """Progress bars for long loops, on a terminal or in a notebook only (in a pipe or a log file
    tqdm's redraws pile up on one line that shows the first count until the loop ends)."""
    return n >= _PROGRESS_MIN and (sys.stderr.isatty() or "ipykernel" in sys.modules)


# ---- classification (read from the routing table the interpreter builds from) -----------------
def op_name(op: OpOverload) -> str:
    """`"aten::add.Tensor"`, `"aten::zeros.default"`: the overload's full name.

    **Arguments:**
    - `op`: an ATen (or custom) `OpOverload`.

    **Returns:** a str.

    **Example:**
        ```python
        assert jaxtorch.coverage.op_name(torch.ops.aten.add.Tensor) == "aten::add.Tensor"
        ```
    """
    return f"{op._schema.name}.{op._overloadname}"


def how(op: OpOverload) -> str:
    """How jaxtorch runs `op`: `"lowered"`, `"decomposed"` or `"missing"` (from its route's kind).

    **Arguments:**
    - `op`: an ATen (or custom) `OpOverload`.

    **Returns:** `"lowered"`, `"decomposed"` or `"missing"`.

    **Example:**
        ```python
        assert jaxtorch.coverage.how(torch.ops.aten.add_.Tensor) == "lowered"   # through aten.add.Tensor
        ```
    """
    return _VERDICT[route(op).kind]


def family(op: OpOverload) -> str:
    """The `jaxtorch.ops` module that lowers `op` (`"bridge"` for the bridge's own ops, `""` if none).

    **Arguments:**
    - `op`: an ATen (or custom) `OpOverload`.

    **Returns:** a str: the family's module name.

    **Example:**
        ```python
        assert jaxtorch.coverage.family(torch.ops.aten.mm.default) == "linalg"
        ```
    """
    r = route(op)
    for cand in (op, r.sibling, r.element):
        if cand is None:
            continue
        if cand in SPECIAL_OPS:
            return "bridge"
        fn = registry.lookup(cand)
        if fn is not None:
            module = getattr(fn, "__module__", None) or "?"
            return module.rsplit(".", 1)[-1] if module.startswith("jaxtorch.ops.") else module
    return ""


# ---- the universe ------------------------------------------------------------------------------
def _overload(name: str):
    """`"aten::add.Tensor"` -> `torch.ops.aten.add.Tensor` (None if it cannot be resolved)."""
    ns, _, rest = name.partition("::")
    base, _, ov = rest.partition(".")
    try:
        return getattr(getattr(getattr(torch.ops, ns), base), ov or "default")
    except (AttributeError, RuntimeError):
        return None


def _is_backend_specific(op) -> bool:
    name = op_name(op).lower()
    base = op._schema.name.split("::")[1].removesuffix("_copy")
    return base in _LAYOUT_ONLY or any(w in name for w in _BACKEND_WORDS)


# torch's Python namespaces that call `aten::<prefix><name>` for their function `<name>`
_PUBLIC_NAMESPACES = (
    ("", torch),
    ("", torch.Tensor),
    ("", torch.nn.functional),
    ("", torch_nn_functions),  # what torch.nn.functional calls (gelu, linear, upsample_*, *_loss, ...)
    ("special_", torch.special),
    ("linalg_", torch.linalg),
    ("fft_", torch.fft),
)


def _is_public(base: str) -> bool:
    """Whether a user reaches `aten::base` by a public call: `torch.base`, `Tensor.base`,
    `F.base`, `torch.special/linalg/fft.name` (in-place `base_` through `base`'s namespace)."""
    for prefix, namespace in _PUBLIC_NAMESPACES:
        if base.startswith(prefix):
            name = base[len(prefix) :]
            if callable(getattr(namespace, name, None)):
                return True
    return False


def _public_ops() -> list[OpOverload]:
    """Every `aten::` overload (out= and in-place ones included) whose op a user calls by name."""
    out = []
    for name in all_op_names():
        if name.startswith("aten::") and _is_public(name[len("aten::") :].partition(".")[0]):
            op = _overload(name)
            if op is not None and not _is_backend_specific(op):
                out.append(op)
    return out


def universe(kind: str = "public") -> list[OpOverload]:
    """The ATen overloads coverage is measured against (see the module docstring).

    **Arguments:**
    - `kind`: `"public"` (the default: the `"core"` ops plus every overload of an op a user
      calls by name: `torch.X`, `Tensor.X`, `torch.nn.functional.X`, `torch.special`/`linalg`/`fft`,
      e.g. `select_copy`, `histc`, `gelu.out`), `"core"` (core-tagged ops plus
      `core_aten_decompositions()` keys) or `"all"` (every registered `aten::` overload except
      backend-specific ones).

    **Returns:** the overloads, sorted by name.

    **Example:**
        ```python
        ops = jaxtorch.coverage.universe("core")
        assert torch.ops.aten.add.Tensor in ops
        ```
    """
    ops: set = set()
    if kind == "public":
        return sorted(set(universe("core")) | set(_public_ops()), key=lambda o: o.name())
    if kind == "all":
        names = [n for n in all_op_names() if n.startswith("aten::")]
        ops = {op for op in map(_overload, names) if op is not None}
    elif kind == "core":
        ops = {op for op in core_aten_decompositions() if isinstance(op, OpOverload)}
        for name in all_op_names():
            if name.startswith("aten::"):
                op = _overload(name)
                if op is not None and torch.Tag.core in op.tags:
                    ops.add(op)
    else:
        raise ValueError(f"unknown universe {kind!r}; use 'public', 'core' or 'all'")
    ops = {op for op in ops if op.namespace == "aten" and not _is_backend_specific(op)}
    return sorted(ops, key=lambda o: o.name())


@dataclasses.dataclass
class Report:
    """What `report` measured: per-family lowering counts and the universe's split.

    **Arguments:**
    - `families`: lowering counts by `jaxtorch.ops` family.
    - `universe`: the universe measured (`"public"`, `"core"`, `"all"`).
    - `lowered`, `decomposed`, `missing`: the universe's overloads by how they run (full names).

    **Returns:** the record; `.format(list_decomposed=False, list_missing=True)` prints it as the command line does.

    **Example:**
        ```python
        rep = jaxtorch.coverage.report("core", progress=False)
        assert isinstance(rep, jaxtorch.coverage.Report) and "aten::mm.default" in rep.lowered
        ```
    """

    families: dict[str, int]  # jaxtorch.ops module -> number of lowered overloads (all registered)
    universe: str
    lowered: list[str]
    decomposed: list[str]
    missing: list[str]

    def format(self, list_decomposed: bool = False, list_missing: bool = True) -> str:
        total = len(self.lowered) + len(self.decomposed) + len(self.missing)
        lines = [
            "Lowerings registered, by family (ATen overloads; in-place/out= variants derived from them not counted):"
        ]
        for fam, n in sorted(self.families.items(), key=lambda kv: (-kv[1], kv[0])):
            lines.append(f"  {fam:<14} {n:5d}")
        lines.append(f"  {'total':<14} {sum(self.families.values()):5d}")
        lines.append("")
        lines.append(f"Universe '{self.universe}': {total} ATen overloads")

        def pct(n):
            return f"{n:5d} ({100.0 * n / max(total, 1):5.1f}%)"

        lines.append(f"  lowered (directly or via the functional op)  {pct(len(self.lowered))}")
        lines.append(f"  only via PyTorch decompositions               {pct(len(self.decomposed))}")
        lines.append(f"  no lowering and no decomposition              {pct(len(self.missing))}")
        if list_decomposed:
            lines += ["", "Covered only via PyTorch decompositions:"] + [f"  {n}" for n in self.decomposed]
        if list_missing:
            lines += ["", "No lowering and no decomposition:"] + [f"  {n}" for n in self.missing]
        return "\n".join(lines)


def _registered_overloads() -> Iterable[OpOverload]:
    for key in registry.registered_ops():
        if isinstance(key, OpOverloadPacket):
            for ov in key.overloads():
                op = getattr(key, ov)
                if registry.lookup(op) is not None and not mutated_args(op):
                    yield op
        elif isinstance(key, OpOverload):
            yield key


def report(kind: str = "public", progress: bool = True) -> Report:
    """Measure coverage over `universe(kind)`; see `Report.format` for the printed form.

    **Arguments:**
    - `kind`: the universe (`"public"`, `"core"` or `"all"`: see `universe`).
    - `progress`: show a progress bar while ops are classified.

    **Returns:** a `Report`.

    **Example:**
        ```python
        rep = jaxtorch.coverage.report("core", progress=False)
        print(rep.format(list_missing=False))
        ```
    """
    families: collections.Counter = collections.Counter()
    for op in set(_registered_overloads()):
        families[family(op) or "?"] += 1
    split: dict[str, list[str]] = {LOWERED: [], DECOMPOSED: [], MISSING: []}
    ops = universe(kind)
    for op in tqdm(ops, desc="classifying ops", disable=not (progress and _progress_shown(len(ops))), leave=False):
        split[how(op)].append(op_name(op))
    return Report(dict(families), kind, split[LOWERED], split[DECOMPOSED], split[MISSING])


# ---- check(model, ...) ------------------------------------------------------------------------
class _Recorder(TorchDispatchMode):
    """Records every ATen op (with its first arguments) that reaches the dispatcher."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[Any, tuple] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in self.calls:
            self.calls[func] = (_to_meta_tree(args), _to_meta_tree(kwargs))
        return func(*args, **kwargs)


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    m = torch.empty(tuple(t.shape), dtype=t.dtype, device="meta")
    return m.requires_grad_(t.requires_grad) if m.is_floating_point() or m.is_complex() else m


def _to_meta_tree(tree):
    return torch_pytree.tree_map(lambda x: _meta_like(x) if isinstance(x, torch.Tensor) else x, tree)


def _leaf_to(x, device: str):
    """A jax array, `JaxTensor` or torch tensor as a fresh tensor on `device` ('meta' or 'cpu')."""
    import jax

    from ..bridge.tensor._convert import to_torch
    from ..bridge.tensor._tensor import JaxTensor

    if isinstance(x, jax.Array):
        if device == "meta":
            return torch.empty(tuple(x.shape), dtype=to_torch_dtype(x.dtype), device="meta")
        return to_torch(x)
    if isinstance(x, torch.Tensor):
        if device == "meta":
            t = torch.empty(tuple(x.shape), dtype=x.dtype, device="meta")
        else:
            t = x.cpu().detach().clone() if isinstance(x, JaxTensor) or x.device.type != "cpu" else x.detach().clone()
        return t.requires_grad_(x.requires_grad) if t.is_floating_point() or t.is_complex() else t
    return x


def _inputs_to(tree, device: str):
    from ..bridge.tensor._convert import tree_map

    return tree_map(lambda x: _leaf_to(x, device), tree)


def _run_recorded(model, args, kwargs, device: str, backward: bool) -> dict:
    """Run `model` once on `device` with its state and inputs copied there; return recorded ops."""
    args, kwargs = _inputs_to((args, kwargs), device)
    call: Callable
    if isinstance(model, torch.nn.Module):
        state = {}
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            c = _leaf_to(t, device)
            if backward and isinstance(t, torch.nn.Parameter) and t.requires_grad:
                c.requires_grad_(True)
            state[name] = c

        def call():
            return torch.func.functional_call(model, state, tuple(args), kwargs, tie_weights=True, strict=False)
    else:

        def call():
            return model(*args, **kwargs)

    rec = _Recorder()
    with torch.set_grad_enabled(backward), rec:
        out = call()
        if backward:
            leaves = [t for t in torch_pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
            if leaves:
                torch.autograd.backward([t.sum() for t in leaves])
    return rec.calls


def _run_decomposition(op, args, kwargs) -> dict:
    r = route(op)
    decomp = r.decomposition
    if decomp is None:  # via the functional sibling: drop out= arguments
        decomp = decomposition(r.sibling) if r.sibling is not None else None
        names = {m[1] for m in r.mutated}
        kwargs = {k: v for k, v in kwargs.items() if k not in names}
        if not op._schema.name.endswith("_"):
            n_pos = len([a for a in r.sibling._schema.arguments if not a.kwarg_only])
            args = args[:n_pos]
    assert decomp is not None  # only DECOMPOSED ops get here: they have one
    rec = _Recorder()
    with rec:
        decomp(*args, **kwargs)
    return rec.calls


class _Checker:
    """Decides, per op, whether jaxtorch can run it; follows decompositions recursively."""

    def __init__(self, jit: bool):
        self.jit = jit
        self.memo: dict[Any, str | None] = {}

    def problem(self, op, args, kwargs, depth: int = 0) -> str | None:
        if op in self.memo:
            return self.memo[op]
        self.memo[op] = None  # cycles: assume fine while in progress
        result = self._problem(op, args, kwargs, depth)
        self.memo[op] = result
        return result

    def _problem(self, op, args, kwargs, depth: int) -> str | None:
        kind = how(op)
        if kind == LOWERED:
            r = route(op)
            if self.jit and (
                r.data_dependent or (r.sibling is not None and registry.is_flagged(r.sibling, registry.DATA_DEPENDENT))
            ):
                return "output shape depends on data: runs eagerly, raises DataDependentError under jax.jit"
            return None
        if kind == MISSING:
            return "no lowering and no decomposition"
        if depth > 8:
            return None
        try:
            inner = _run_decomposition(op, args, kwargs)
        except Exception:  # cannot trace it on meta tensors: trust the decomposition
            return None
        for sub, (a, k) in inner.items():
            if sub is op:
                continue
            why = self.problem(sub, a, k, depth + 1)
            if why is not None:
                return f"its decomposition calls {op_name(sub)} ({why})"
        return None


def check(model, *example_args, backward: bool = False, jit: bool = False, **kwargs) -> list[str]:
    """List the ATen ops `model(*example_args, **kwargs)` uses that jaxtorch cannot run.

    Runs the model once on the `meta` device (no real compute; its state and inputs are
    copied as meta tensors, the model itself is not changed), or on the CPU if a meta run
    fails (e.g. the forward calls `.item()`), recording every ATen op. An op is fine if it
    has a lowering, or a PyTorch decomposition whose ops are all fine (checked
    recursively on the recorded arguments).

    **Arguments:**
    - `model`: a `torch.nn.Module` (on any device) or any callable written with torch.
    - `example_args`, `kwargs`: example inputs: jax arrays, torch tensors (CPU or `jax`), or
      other values, as the model takes them.
    - `backward`: also run `backward()` on the outputs and check the backward ops.
    - `jit`: also list ops that run eagerly but cannot run under `jax.jit` (their output
      shape depends on data, e.g. `nonzero`).

    **Returns:** sorted strings `"aten::op.overload: reason"`; empty when jaxtorch runs it all.

    **Example:**
        ```python
        assert jaxtorch.coverage.check(torch.nn.Linear(3, 2), torch.ones(1, 3)) == []
        ```
    """
    try:
        calls = _run_recorded(model, example_args, kwargs, "meta", backward)
    except Exception:
        calls = _run_recorded(model, example_args, kwargs, "cpu", backward)
    checker = _Checker(jit)
    problems = []
    items = list(calls.items())
    for op, (a, k) in tqdm(items, desc="checking ops", disable=not _progress_shown(len(items)), leave=False):
        why = checker.problem(op, a, k)
        if why is not None:
            problems.append(f"{op_name(op)}: {why}")
    return sorted(problems)


# ---- command line -------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """The command line, `python -m jaxtorch.coverage [--universe public|core|all] [--family NAME] ...`.

    **Arguments:**
    - `argv`: the arguments (default: `sys.argv[1:]`); `--help` lists them.

    **Returns:** the exit status (0); the report is printed.

    **Example:**
        ```python
        assert jaxtorch.coverage.main(["--family", "linalg"]) == 0   # the overloads jaxtorch.ops.linalg lowers
        ```
    """
    ap = argparse.ArgumentParser(
        prog="python -m jaxtorch.coverage", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--universe",
        choices=("public", "core", "all"),
        default="public",
        help="public: the core ops plus every overload of an op callable by name as torch.X, Tensor.X, "
        "torch.nn.functional.X, torch.special/linalg/fft.X (default); core: core-tagged ATen ops + "
        "core_aten_decompositions() keys; all: every aten overload except backend-specific ones",
    )
    ap.add_argument("--list-decomposed", action="store_true", help="list ops covered only via decompositions")
    ap.add_argument("--no-list-missing", action="store_true", help="print counts only")
    ap.add_argument("--family", default=None, help="list the overloads lowered by this jaxtorch.ops module")
    ns = ap.parse_args(argv)
    if ns.family:
        names = sorted({op_name(op) for op in _registered_overloads() if family(op) == ns.family})
        print("\n".join(names) if names else f"no lowerings in family {ns.family!r}")
        return 0
    rep = report(ns.universe)
    print(rep.format(list_decomposed=ns.list_decomposed, list_missing=not ns.no_list_missing))
    return 0
