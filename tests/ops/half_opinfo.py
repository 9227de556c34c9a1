"""PyTorch's OpInfo database in float16 and bfloat16 against CPU torch (issue 29 items 0 and 5).

torch's CPU kernels compute a half op in float32 (`opmath_t`) and round once, and accumulate
reductions and products in float32. An entry passes when, on the first `N_SAMPLES` samples it
builds for the dtype, every float output element of `jaxtorch.call_torch(op)` is

- elementwise ops (torch's `UnaryUfuncInfo` and `BinaryUfuncInfo`, plus `ELEMENTWISE`): within
  one rounding step of CPU torch's half result (|got - ref| <= one ulp of the half dtype at
  ref), compared in float64;
- every other op (reductions, products, norms, convolutions, cumulative ops, ...): no worse
  than twice CPU torch's own error against the float64 result of the same op on the same
  (half-valued) inputs, plus one ulp: |got - ref64| <= 2 |torch - ref64| + ulp(ref64).

Equal values (infinities, NaN == NaN) always pass; integer and bool outputs must be equal,
float32 outputs (an explicit `dtype=`) within 1e-3.
Entries torch's CPU kernels do not support in the dtype, and samples torch itself refuses, are
left out. Nondeterministic sampling and sparse entries are left out as in the float32 harness.

The test suite (`test_half_accumulation.py`) checks the first sample of the entries the issue
names (`focus`: reductions, binary ufuncs, products, convolutions, norms, cumulative ops) to stay
fast; the command line checks every entry.

Command line (counts, and the failing entries with their first mismatch):
    python -m tests.ops.half_opinfo                      # every entry, both dtypes
    python -m tests.ops.half_opinfo --focus --samples 1  # what the test suite checks
    python -m tests.ops.half_opinfo --ops sum,mul --dtypes fp16
    python -m tests.ops.half_opinfo --list-failures      # lines for half_expected_failures.txt
"""

from __future__ import annotations

import argparse
import sys
import warnings

import numpy as np
import torch
import torch.utils._pytree as pytree

from tests.opinfo.harness import entries, entry_id

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
N_SAMPLES = 2
_MANT = {torch.float16: (10, -14), torch.bfloat16: (7, -126)}  # (mantissa bits, min normal exponent)

# elementwise OpInfo entries that are neither a UnaryUfuncInfo nor a BinaryUfuncInfo
ELEMENTWISE = frozenset(
    {
        "addcmul",
        "addcdiv",
        "lerp",
        "clamp",
        "where",
        "nn.functional.gelu",
        "nn.functional.silu",
        "nn.functional.mish",
        "nn.functional.elu",
        "nn.functional.celu",
        "nn.functional.selu",
        "nn.functional.hardswish",
        "nn.functional.hardsigmoid",
        "nn.functional.softplus",
        "nn.functional.logsigmoid",
        "nn.functional.leaky_relu",
        "nn.functional.hardtanh",
        "nn.functional.relu6",
        "nn.functional.threshold",
        "nn.functional.tanhshrink",
        "nn.functional.softshrink",
        "nn.functional.hardshrink",
    }
)


# the entries the issue names (sums and means are ReductionOpInfos, scalar arithmetic
# BinaryUfuncInfos): what `focus` keeps for the test suite's fast run
FOCUS = frozenset(
    {
        # products
        "addmm", "addmm.decomposed", "addmv", "addbmm", "baddbmm", "addr", "dot", "vdot", "mv", "mm",
        "bmm", "matmul", "__rmatmul__", "einsum", "inner", "outer", "kron", "tensordot", "linalg.vecdot",
        "linalg.multi_dot", "nn.functional.linear", "nn.functional.bilinear",
        # convolutions
        "nn.functional.conv1d", "nn.functional.conv2d", "nn.functional.conv3d",
        "nn.functional.conv_transpose1d", "nn.functional.conv_transpose2d", "nn.functional.conv_transpose3d",
        # cumulative ops
        "cumsum", "cumprod", "logcumsumexp", "cumulative_trapezoid", "masked.cumsum", "masked.cumprod",
        # norms and statistics
        "norm", "norm.fro", "norm.inf", "linalg.norm", "linalg.vector_norm", "linalg.matrix_norm", "renorm",
        "dist", "nn.functional.pairwise_distance", "var_mean", "var_mean.unbiased",
        "std_mean", "std_mean.unbiased", "logsumexp", "trace",
        # arithmetic with Python scalars
        "addcmul", "addcdiv", "lerp",
    }
)  # fmt: skip


def focus(op) -> bool:
    """Whether the entry is one the issue names: a reduction, a binary ufunc or one of `FOCUS`."""
    from torch.testing._internal.opinfo.core import BinaryUfuncInfo, ReductionOpInfo

    return isinstance(op, (BinaryUfuncInfo, ReductionOpInfo)) or entry_id(op) in FOCUS


def is_elementwise(op) -> bool:
    from torch.testing._internal.opinfo.core import BinaryUfuncInfo, UnaryUfuncInfo

    return isinstance(op, (UnaryUfuncInfo, BinaryUfuncInfo)) or op.name in ELEMENTWISE


def ulp(ref: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """One unit in the last place of the half `dtype` at the (float64) values `ref`."""
    mant, emin = _MANT[dtype]
    _, e = np.frexp(np.where(np.isfinite(ref), ref, 1.0))
    return np.ldexp(1.0, np.maximum(e - 1, emin) - mant)


def _np(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().resolve_conj().resolve_neg()
        return (x.double() if x.is_floating_point() else x).numpy()
    return np.asarray(x, dtype=np.float64 if np.asarray(x).dtype.name == "bfloat16" else None)


def _leaves(out) -> list:
    return [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]


def _call(op, sample, convert):
    leaves, spec = pytree.tree_flatten((sample.input, list(sample.args), dict(sample.kwargs)))
    leaves = [convert(x) if isinstance(x, torch.Tensor) else x for x in leaves]
    inp, args, kwargs = pytree.tree_unflatten(leaves, spec)
    return op.op(inp, *args, **kwargs)


def _to64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().double() if t.dtype in (torch.float16, torch.bfloat16) else t.detach()


def check_sample(op, sample, dtype: torch.dtype) -> str | None:
    """None when jaxtorch's result of `sample` is within the rule, else the first mismatch."""
    try:
        ref = _leaves(_call(op, sample, lambda t: t.detach()))
    except Exception:
        return None  # torch refuses the sample: nothing to compare
    elementwise = is_elementwise(op)
    ref64 = None
    if not elementwise:
        try:
            ref64 = _leaves(_call(op, sample, _to64))
        except Exception:
            elementwise = True  # no float64 kernel: compare with torch's half result
    with torch.no_grad():
        got = _leaves(_call(op, sample, lambda t: t.detach().clone().to("jax")))
    if len(got) != len(ref):
        return f"{len(got)} outputs, torch {len(ref)}"
    for i, (r, g) in enumerate(zip(ref, got)):
        if tuple(r.shape) != tuple(g.shape):
            return f"out[{i}]: shape {tuple(g.shape)} != torch {tuple(r.shape)}"
        rn, gn = _np(r), _np(g.cpu())
        if r.is_floating_point() and r.dtype not in _MANT:  # a float32 result (an explicit dtype=)
            if not np.allclose(gn, rn, rtol=1e-3, atol=1e-3, equal_nan=True):
                return f"out[{i}]: {r.dtype} values differ"
            continue
        if not r.is_floating_point():
            if not np.array_equal(rn, gn, equal_nan=rn.dtype.kind in "fc"):
                return f"out[{i}]: {r.dtype} values differ"
            continue
        same = (rn == gn) | (np.isnan(rn) & np.isnan(gn))
        if elementwise or ref64 is None:
            err = np.abs(gn - rn)
            bound = ulp(rn, r.dtype)
        else:
            r64 = _np(ref64[i])
            err = np.abs(gn - r64)
            bound = 2 * np.abs(rn - r64) + ulp(r64, r.dtype)
        bad = ~same & ~(err <= bound)
        if bad.any():
            k = int(np.flatnonzero(bad.reshape(-1))[0])
            return (
                f"out[{i}]: {int(bad.sum())} of {bad.size} elements outside the rule "
                f"(first: got {gn.reshape(-1)[k]!r}, torch {rn.reshape(-1)[k]!r})"
            )
    return None


def half_entries(dtype: torch.dtype, wanted=()) -> list:
    """The OpInfo entries whose CPU kernels support `dtype` (optionally only the `wanted` ids)."""
    ops = [op for op in entries() if dtype in op.supported_dtypes("cpu")]
    if wanted:
        ops = [op for op in ops if entry_id(op) in wanted or op.name in wanted]
    return ops


def check_entry(op, dtype: torch.dtype, samples: int = N_SAMPLES) -> str | None:
    """None when the first `samples` samples of the entry are within the rule, else why not."""
    torch.manual_seed(0)
    n = 0
    for sample in op.sample_inputs("cpu", dtype):
        try:
            why = check_sample(op, sample, dtype)
        except Exception as e:
            msg = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
            return f"{type(e).__name__}: {msg}"
        if why is not None:
            return why
        n += 1
        if n >= samples:
            break
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", default="", help="comma-separated entry ids")
    ap.add_argument("--dtypes", default="fp16,bf16")
    ap.add_argument("--list-failures", action="store_true", help="print 'dtype entry: reason' lines only")
    ap.add_argument("--samples", type=int, default=N_SAMPLES, help="samples per entry")
    ap.add_argument("--focus", action="store_true", help="only the entries the test suite checks (`focus`)")
    args = ap.parse_args(argv)
    wanted = {w for w in args.ops.split(",") if w}
    warnings.simplefilter("ignore")
    for tag in args.dtypes.split(","):
        dtype = DTYPES[tag]
        ops = [op for op in half_entries(dtype, wanted) if focus(op) or not args.focus]
        failed = 0
        for op in ops:
            why = check_entry(op, dtype, args.samples)
            if why is not None:
                failed += 1
                print(f"{tag} {entry_id(op)}: {why}", flush=True)
        if not args.list_failures:
            print(f"# {tag}: {len(ops)} entries checked, {failed} outside the rule", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
