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

Equal values (infinities, NaN == NaN) always pass; integer and bool outputs must be equal.
Entries torch's CPU kernels do not support in the dtype, and samples torch itself refuses, are
left out. Nondeterministic sampling and sparse entries are left out as in the float32 harness.

Command line (counts, and the failing entries with their first mismatch):
    python -m tests.ops.half_opinfo                      # every entry, both dtypes
    python -m tests.ops.half_opinfo --ops sum,mul --dtypes fp16
    python -m tests.ops.half_opinfo --list-failures      # lines for half_expected_failures.txt
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import torch
import torch.utils._pytree as pytree

import jaxtorch  # noqa: F401  (registers the "jax" device)
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
        if not r.is_floating_point() or r.dtype not in _MANT:
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


def check_entry(op, dtype: torch.dtype) -> str | None:
    """None when every checked sample of the entry is within the rule, else why not."""
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
        if n >= N_SAMPLES:
            break
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", default="", help="comma-separated entry ids")
    ap.add_argument("--dtypes", default="fp16,bf16")
    ap.add_argument("--list-failures", action="store_true", help="print 'dtype entry: reason' lines only")
    args = ap.parse_args(argv)
    wanted = {w for w in args.ops.split(",") if w}
    for tag in args.dtypes.split(","):
        dtype = DTYPES[tag]
        ops = half_entries(dtype, wanted)
        failed = 0
        for op in ops:
            why = check_entry(op, dtype)
            if why is not None:
                failed += 1
                print(f"{tag} {entry_id(op)}: {why}", flush=True)
        if not args.list_failures:
            print(f"# {tag}: {len(ops)} entries checked, {failed} outside the rule", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
