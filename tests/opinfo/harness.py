"""PyTorch's OpInfo database run through jaxtorch: eager, under jax.jit, and under jax.grad.

The measure (issue 3): every OpInfo entry (name + variant) except nondeterministic
sampling ops and sparse ops; dtypes float32, int64 and bool where the entry supports
them; the first 4 sample inputs of each. Reference: eager PyTorch on the CPU.

- eager: `jaxtorch.call_torch(op, *inputs_as_jax_arrays, **kwargs)`
- jit:   the same inside `jax.jit`, tensor inputs traced, everything else static
- grad:  float32 entries that support autograd: `jax.grad` of `sum(out * cotangent)` with
         respect to the first tensor input, against `torch.autograd`

A sample passes when values agree (rtol = atol = 1e-3, 1e-2 for grad, NaN == NaN),
shapes agree and dtypes are of the same kind. An entry passes when all its samples do.

Command line (prints failures with reasons):
    python -m tests.opinfo.harness --mode eager --ops add,mul
    python -m tests.opinfo.harness --mode all --summary
    python -m tests.opinfo.harness --mode all > run.log
    python -m tests.opinfo.harness --expected-from-log run.log   # lines for expected_failures.txt
"""

from __future__ import annotations

import argparse
import sys
import traceback
from typing import Any

import jax
import numpy as np
import torch
import torch.utils._pytree as pytree

import jaxtorch
from jaxtorch import DataDependentError

MODES = ("eager", "jit", "grad")
DTYPES = (torch.float32, torch.int64, torch.bool)
N_SAMPLES = 4
TOL = {"eager": 1e-3, "jit": 1e-3, "grad": 1e-2}

_SKIP_WORDS = (
    "rand",
    "normal",
    "bernoulli",
    "dropout",
    "multinomial",
    "empty",
    "uniform",
    "exponential",
    "cauchy",
    "geometric",
    "log_normal",
    "poisson",
)


def entry_id(op) -> str:
    return op.name + ("." + op.variant_test_name if op.variant_test_name else "")


def is_excluded(op) -> bool:
    """Nondeterministic sampling ops and sparse ops are outside the measure."""
    name = entry_id(op).lower()
    if any(w in name for w in _SKIP_WORDS):
        return True
    if "sparse" in name or name.startswith("to_sparse"):
        return True
    return False


def entries() -> list:
    from torch.testing._internal.common_methods_invocations import op_db

    return [op for op in op_db if not is_excluded(op)]


def entry_by_id() -> dict[str, Any]:
    return {entry_id(op): op for op in entries()}


def _dtypes(op, mode: str):
    supported = op.supported_dtypes("cpu")
    dts = [d for d in DTYPES if d in supported]
    if mode == "grad":
        if not op.supports_autograd:
            return []
        dts = [d for d in dts if d == torch.float32 and d in op.supported_backward_dtypes("cpu")]
    return dts


def _samples(op, dtype, requires_grad=False):
    out = []
    torch.manual_seed(0)
    for s in op.sample_inputs("cpu", dtype, requires_grad=requires_grad):
        out.append(s)
        if len(out) >= N_SAMPLES:
            break
    return out


def _kind(dtype) -> str:
    if dtype == torch.bool or dtype == np.bool_:
        return "bool"
    if isinstance(dtype, torch.dtype):
        if dtype.is_complex:
            return "complex"
        if dtype.is_floating_point:
            return "float"
        return "int"
    dtype = np.dtype(dtype)
    if np.issubdtype(dtype, np.complexfloating):
        return "complex"
    if np.issubdtype(dtype, np.floating) or dtype.name == "bfloat16":
        return "float"
    return "int"


def _compare(ref, got, tol: float, where: str = "out") -> None:
    """Raise AssertionError describing the first mismatch between torch `ref` and JAX `got`."""
    ref_leaves, ref_spec = pytree.tree_flatten(ref)
    if isinstance(got, (jax.Array, np.ndarray)) and len(ref_leaves) == 1:
        got_leaves = [got]
    else:
        got_leaves = jax.tree_util.tree_leaves(got, is_leaf=lambda x: x is None)
    if len(ref_leaves) != len(got_leaves):
        raise AssertionError(f"{where}: structure differs ({len(ref_leaves)} vs {len(got_leaves)} leaves)")
    for i, (r, g) in enumerate(zip(ref_leaves, got_leaves)):
        if isinstance(r, torch.Tensor):
            g_arr = np.asarray(g)
            if tuple(r.shape) != tuple(g_arr.shape):
                raise AssertionError(f"{where}[{i}]: shape {tuple(g_arr.shape)} != torch {tuple(r.shape)}")
            if _kind(r.dtype) != _kind(g_arr.dtype):
                raise AssertionError(f"{where}[{i}]: dtype {g_arr.dtype} not of the kind of torch {r.dtype}")
            r_np = r.detach()
            if r_np._is_zerotensor():
                r_np = torch.zeros(r_np.shape, dtype=r_np.dtype)
            r_np = r_np.resolve_conj().resolve_neg().cpu()
            r_np = (r_np.float() if r_np.dtype == torch.bfloat16 else r_np).numpy()
            if r_np.dtype == np.bool_:
                ok = np.array_equal(r_np, g_arr)
            else:
                ok = np.allclose(
                    g_arr.astype(r_np.dtype) if _kind(r.dtype) != "float" else g_arr,
                    r_np,
                    rtol=tol,
                    atol=tol,
                    equal_nan=True,
                )
            if not ok:
                err = np.max(np.abs(np.asarray(g_arr, dtype=np.complex128) - r_np)) if r_np.size else 0
                raise AssertionError(f"{where}[{i}]: values differ (max abs err {err:.3g})")
        elif isinstance(r, (int, float, bool, complex)):
            g_val = np.asarray(g).item() if hasattr(g, "shape") else g
            if not np.allclose(g_val, r, rtol=tol, atol=tol, equal_nan=True):
                raise AssertionError(f"{where}[{i}]: scalar {g_val} != torch {r}")


def _split(sample):
    """Flatten (input, args, kwargs) and return (leaves, spec, tensor positions)."""
    leaves, spec = pytree.tree_flatten((sample.input, list(sample.args), dict(sample.kwargs)))
    pos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    return leaves, spec, pos


def _jax_fn(op, leaves, spec, pos):
    """A function of the tensor leaves (as JAX arrays) that calls the op through jaxtorch."""

    def torch_side(*tensors):
        full = list(leaves)
        for p, t in zip(pos, tensors):
            full[p] = t
        inp, args, kwargs = pytree.tree_unflatten(full, spec)
        return op.op(inp, *args, **kwargs)

    def fn(*arrays):
        return jaxtorch.call_torch(torch_side, *arrays)

    return fn


class ReferenceError_(Exception):
    """The eager PyTorch reference itself raised on this sample (e.g. a CUDA-only op)."""


def _reference(op, inp, args, kwargs):
    try:
        return op.op(inp, *args, **kwargs)
    except Exception as e:
        raise ReferenceError_(f"{type(e).__name__}: {e}") from e


def run_sample(op, sample, mode: str) -> None:
    leaves, spec, pos = _split(sample)
    tensors = [leaves[p] for p in pos]
    arrays = [jaxtorch.to_jax(t.detach().clone()) for t in tensors]
    fn = _jax_fn(op, leaves, spec, pos)
    if mode in ("eager", "jit"):
        ref = _reference(op, sample.input, sample.args, sample.kwargs)
        got = fn(*arrays) if mode == "eager" else jax.jit(fn)(*arrays)
        _compare(ref, got, TOL[mode])
        return
    # grad: w.r.t. the first floating tensor input
    float_pos = [i for i, t in enumerate(tensors) if t.dtype.is_floating_point]
    if not float_pos:
        return
    k = float_pos[0]
    t_leaves = [t.detach().clone() for t in tensors]
    t_leaves[k].requires_grad_(True)
    full = list(leaves)
    for p, t in zip(pos, t_leaves):
        full[p] = t
    inp, args, kwargs = pytree.tree_unflatten(full, spec)
    ref_out = _reference(op, inp, args, kwargs)
    ref_leaves = pytree.tree_leaves(ref_out)
    grad_pos = [
        i
        for i, o in enumerate(ref_leaves)
        if isinstance(o, torch.Tensor) and o.dtype.is_floating_point and o.requires_grad
    ]  # outputs are paired with JAX's by leaf position
    outs = [ref_leaves[i] for i in grad_pos]
    if not outs:
        return
    gen = torch.Generator().manual_seed(1)
    cots = [torch.randn(o.shape, generator=gen) for o in outs]
    loss = sum((o * c).sum() for o, c in zip(outs, cots))
    (ref_grad,) = torch.autograd.grad(loss, t_leaves[k], allow_unused=True)
    if ref_grad is None:
        ref_grad = torch.zeros_like(t_leaves[k])
    got = jax_first_grad(fn, arrays, k, grad_pos, len(ref_leaves), cots)
    _compare(ref_grad, got, TOL["grad"], where="grad")


def jax_first_grad(fn, arrays: list, k: int, grad_pos: list[int], n_outs: int, cots: list):
    """`jax.grad` w.r.t. `arrays[k]` of `sum(out[i] * cot)` over the outputs `grad_pos` of `fn(*arrays)`,
    whose outputs are paired with torch's `n_outs` by leaf position."""
    jcots = [jaxtorch.to_jax(c) for c in cots]

    def jloss(x):
        arrs = list(arrays)
        arrs[k] = x
        out = fn(*arrs)
        all_out = [out] if isinstance(out, jax.Array) else jax.tree_util.tree_leaves(out)
        if len(all_out) != n_outs:
            raise AssertionError(f"grad: {len(all_out)} outputs vs torch {n_outs}")
        return sum((all_out[i] * c).sum() for i, c in zip(grad_pos, jcots))

    return jax.grad(jloss)(arrays[k])


def run_entry(op, mode: str) -> tuple[bool | None, str]:
    """(passed, reason). passed is None when the entry has nothing to test in this mode."""
    dts = _dtypes(op, mode)
    if not dts:
        return None, "not applicable"
    n = 0
    for dtype in dts:
        try:
            samples = _samples(op, dtype, requires_grad=(mode == "grad"))
        except Exception as e:  # pragma: no cover - OpInfo's own failure
            return None, f"sample generation failed: {e}"
        for s in samples:
            n += 1
            try:
                run_sample(op, s, mode)
            except ReferenceError_:
                n -= 1  # nothing to compare against
                continue
            except DataDependentError as e:
                return False, f"data-dependent ({dtype}): {str(e).splitlines()[0][:160]}"
            except Exception as e:
                msg = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
                return False, f"{type(e).__name__} ({dtype}): {msg}"
    if n == 0:
        return None, "no samples"
    return True, ""


def _short(reason: str) -> str:
    """One line, no jaxtorch boilerplate: the part of a failure message that says why."""
    reason = reason.replace("jaxtorch has no JAX lowering for the op", "no lowering for")
    reason = reason.split(". Register one")[0].split(" so it cannot be traced")[0]
    return " ".join(reason.split())[:150]


def expected_from_log(text: str) -> list[str]:
    """`FAIL mode entry: reason` lines of a harness run -> expected-failures lines."""
    lines = []
    for line in text.splitlines():
        if line.startswith("FAIL "):
            _, mode, rest = line.split(" ", 2)
            entry, _, reason = rest.partition(": ")
            lines.append(f"{mode} {entry}: {_short(reason)}")
    return sorted(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", default="eager", choices=MODES + ("all",))
    ap.add_argument("--ops", default="", help="comma-separated entry ids or prefixes (name or name.variant)")
    ap.add_argument("--summary", action="store_true", help="print only counts")
    ap.add_argument("--traceback", action="store_true")
    ap.add_argument(
        "--expected-from-log",
        metavar="LOG",
        help="print expected-failures lines from the output of a previous run, and exit",
    )
    args = ap.parse_args(argv)
    if args.expected_from_log:
        with open(args.expected_from_log) as f:
            print("\n".join(expected_from_log(f.read())))
        return 0
    modes = MODES if args.mode == "all" else (args.mode,)
    wanted = [w for w in args.ops.split(",") if w]
    ops = [
        op
        for op in entries()
        if not wanted or any(entry_id(op) == w or entry_id(op).startswith(w + ".") or op.name == w for w in wanted)
    ]
    for mode in modes:
        passed = failed = na = 0
        for op in ops:
            try:
                ok, reason = run_entry(op, mode)
            except Exception as e:
                ok, reason = False, f"harness error {type(e).__name__}: {e}"
                if args.traceback:
                    traceback.print_exc()
            if ok is None:
                na += 1
            elif ok:
                passed += 1
            else:
                failed += 1
                if not args.summary:
                    print(f"FAIL {mode} {entry_id(op)}: {reason}", flush=True)
        total = passed + failed
        print(
            f"{mode}: {passed}/{total} entries pass ({100 * passed / max(total, 1):.1f}%), {na} not applicable",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
