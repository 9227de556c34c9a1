"""Gradients at torch's special points (issue 29 item 4): kinks, ties, boundaries, singular points.

Every differentiable float32 OpInfo entry (the grad mode of `tests.opinfo.harness`) runs with
its first sample input SNAPPED to special values, and its gradient is compared with CPU
`torch.autograd.grad` two ways:

- jax:   `jax.grad` through `jaxtorch.call_torch` (JAX-first: the lowerings' JVP rules)
- torch: the tensors on the `jax` device, `loss.backward()` (torch-first: torch autograd calls
         the `*_backward` ops' lowerings)

The snaps, applied to the sample's floating tensors:

- zeros:      every floating tensor becomes zeros (relu, abs, norms, pow and sqrt at 0)
- ties:       every floating tensor is rounded, so equal values appear (max, sort, pooling)
- boundaries: the input's elements cycle through the op's boundary values (`BOUNDARIES`; by
              default 0, +-1, +-3, 6, which are relu6's, hardtanh's, hardswish's kinks); for
              clamp-like ops they cycle through the sample's own bounds

A sample whose CPU reference raises (e.g. a singular matrix) is skipped. Gradients agree at
rtol = atol = 1e-2 with NaN == NaN and inf == inf. An entry passes in a mode when all its snapped
samples do.

Command line (prints failures with reasons, then counts):
    python -m tests.ops._special_grads --ops nn.functional.relu,abs
    python -m tests.ops._special_grads > run.log
    python -m tests.ops._special_grads --expected-from-log run.log   # lines for the expected list
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
from collections.abc import Callable
from unittest import mock

import jax
import torch
import torch.utils._pytree as pytree

import jaxtorch
from tests.opinfo import harness

MODES = ("jax", "torch")
SNAPS = ("zeros", "ties", "boundaries")
N_SAMPLES = 1  # the first sample of each entry: 3 snaps x 2 modes = 6 gradients per entry
TOL = 1e-2
_DEFAULT_BOUNDS = (0.0, 1.0, -1.0, 3.0, -3.0, 6.0)
# entry -> the values its input cycles through in the `boundaries` snap
BOUNDARIES: dict[str, tuple[float, ...]] = {
    "nn.functional.binary_cross_entropy": (0.0, 1.0),
    "nn.functional.binary_cross_entropy_with_logits": (0.0, 1.0),
    "nn.functional.relu6": (0.0, 6.0, 3.0),
    "nn.functional.hardswish": (-3.0, 3.0, 0.0),
    "nn.functional.hardsigmoid": (-3.0, 3.0, 0.0),
}
# entries whose bounds are the sample's other arguments (tensors or numbers)
_BOUNDED_BY_ARGS = ("clamp", "clip", "clamp_min", "clamp_max", "nn.functional.hardtanh", "nn.functional.threshold")


def _cycle(t: torch.Tensor, values: list) -> torch.Tensor:
    """`t`'s shape with its elements cycling through `values` (numbers, or tensors broadcast to t)."""
    n = t.numel()
    out = torch.empty(n, dtype=t.dtype)
    idx = torch.arange(n)
    for k, v in enumerate(values):
        full = torch.broadcast_to(torch.as_tensor(v, dtype=t.dtype), t.shape).reshape(-1)
        sel = idx % len(values) == k
        out[sel] = full[sel]
    return out.reshape(t.shape)


def snap(eid: str, sample, kind: str):
    """(input, args, kwargs) of `sample` with its floating tensors snapped to `kind`'s special values."""
    inp, args, kwargs = sample.input, list(sample.args), dict(sample.kwargs)

    def each(fn: Callable[[torch.Tensor], torch.Tensor]):
        return lambda x: fn(x) if isinstance(x, torch.Tensor) and x.dtype.is_floating_point else x

    if kind == "zeros":
        return pytree.tree_map(each(lambda x: torch.zeros_like(x)), (inp, args, kwargs))
    if kind == "ties":
        return pytree.tree_map(each(lambda x: torch.round(x.detach())), (inp, args, kwargs))
    if not (isinstance(inp, torch.Tensor) and inp.dtype.is_floating_point):
        return inp, args, kwargs
    if eid in _BOUNDED_BY_ARGS or eid.split(".")[0] in _BOUNDED_BY_ARGS:
        bounds = [b for b in pytree.tree_leaves((args, kwargs)) if isinstance(b, (int, float, torch.Tensor))]
        bounds = [b.detach() if isinstance(b, torch.Tensor) else b for b in bounds if not isinstance(b, bool)]
        if bounds:
            return _cycle(inp.detach(), bounds), args, kwargs
    return _cycle(inp.detach(), list(BOUNDARIES.get(eid, _DEFAULT_BOUNDS))), args, kwargs


def _torch_first(op, leaves, spec, pos, k, cots):
    """The gradient w.r.t. tensor `k` with every tensor on the `jax` device and torch autograd."""
    tensors = [leaves[p].detach().clone().to("jax") for p in pos]
    tensors[k].requires_grad_(True)
    full = list(leaves)
    for p, t in zip(pos, tensors):
        full[p] = t
    inp, args, kwargs = pytree.tree_unflatten(full, spec)
    out_leaves = pytree.tree_leaves(op.op(inp, *args, **kwargs))
    outs = [o for o in out_leaves if isinstance(o, torch.Tensor) and o.dtype.is_floating_point and o.requires_grad]
    if len(outs) != len(cots):
        raise AssertionError(f"torch-first: {len(outs)} differentiable outputs vs torch {len(cots)}")
    loss = sum((o * c.to("jax")).sum() for o, c in zip(outs, cots))
    (g,) = torch.autograd.grad(loss, tensors[k], allow_unused=True)
    return jax.numpy.zeros(tensors[k].shape) if g is None else jaxtorch.to_jax(g.detach())


def run_sample(op, eid: str, sample, kind: str, mode: str) -> None:
    """Raise AssertionError when `mode`'s gradient at the snapped sample differs from CPU torch's."""
    inp, args, kwargs = snap(eid, sample, kind)
    leaves, spec = pytree.tree_flatten((inp, args, kwargs))
    pos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    tensors = [leaves[p].detach().clone() for p in pos]
    float_pos = [i for i, t in enumerate(tensors) if t.dtype.is_floating_point]
    if not float_pos:
        return
    k = float_pos[0]
    t_leaves = [t.clone() for t in tensors]
    t_leaves[k].requires_grad_(True)
    full = list(leaves)
    for p, t in zip(pos, t_leaves):
        full[p] = t
    r_inp, r_args, r_kwargs = pytree.tree_unflatten(full, spec)
    ref_leaves = pytree.tree_leaves(harness._reference(op, r_inp, r_args, r_kwargs))
    grad_pos = [
        i
        for i, o in enumerate(ref_leaves)
        if isinstance(o, torch.Tensor) and o.dtype.is_floating_point and o.requires_grad
    ]
    outs = [ref_leaves[i] for i in grad_pos]
    if not outs:
        return
    gen = torch.Generator().manual_seed(1)
    cots = [torch.randn(o.shape, generator=gen) for o in outs]
    try:
        (ref,) = torch.autograd.grad(sum((o * c).sum() for o, c in zip(outs, cots)), t_leaves[k], allow_unused=True)
    except Exception as e:  # torch's own backward refuses this point
        raise harness.ReferenceError_(str(e)) from e
    ref = torch.zeros_like(t_leaves[k]) if ref is None else ref
    if mode == "torch":
        got = _torch_first(op, leaves, spec, pos, k, cots)
    else:
        arrays = [jaxtorch.to_jax(t) for t in tensors]
        fn = harness._jax_fn(op, leaves, spec, pos)
        got = harness.jax_first_grad(fn, arrays, k, grad_pos, len(ref_leaves), cots)
    harness._compare(ref, got, TOL, where=f"{kind} grad")


@functools.cache
def grad_entries() -> dict:
    """Every OpInfo entry that the harness's grad mode checks (float32, supports autograd)."""
    return {eid: op for eid, op in harness.entry_by_id().items() if harness._dtypes(op, "grad")}


@functools.cache
def samples(eid: str) -> tuple:
    """The entry's first float32 samples, generated once for both modes. OpInfo names the calling
    test by walking the stack (`inspect.stack`, half the time of a cheap entry); that label is only
    used in its error messages, so it is skipped here."""
    from torch.testing._internal import common_utils
    from torch.testing._internal.opinfo import core

    with contextlib.ExitStack() as stack:
        for module in (common_utils, core):
            if hasattr(module, "extract_test_fn"):
                stack.enter_context(mock.patch.object(module, "extract_test_fn", lambda: None))
        return tuple(harness._samples(grad_entries()[eid], torch.float32)[:N_SAMPLES])


def run_entry(op, mode: str) -> tuple[bool | None, str]:
    """(passed, reason) over the snapped samples; passed is None when nothing could be compared."""
    eid = harness.entry_id(op)
    try:
        entry_samples = samples(eid)
    except Exception as e:  # pragma: no cover - OpInfo's own failure
        return None, f"sample generation failed: {e}"
    n = 0
    for kind in SNAPS:
        for s in entry_samples:
            try:
                run_sample(op, eid, s, kind, mode)
                n += 1
            except harness.ReferenceError_:
                continue
            except Exception as e:
                msg = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
                return False, f"{kind}: {type(e).__name__}: {msg}"
    return (True, "") if n else (None, "no sample has a CPU reference")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", default="all", choices=MODES + ("all",))
    ap.add_argument("--ops", default="", help="comma-separated entry ids or names")
    ap.add_argument("--shard", default="0/1", help="i/n: run every n-th entry starting at i")
    ap.add_argument("--expected-from-log", metavar="LOG")
    args = ap.parse_args(argv)
    if args.expected_from_log:
        with open(args.expected_from_log) as f:
            lines = [ln[5:] for ln in f.read().splitlines() if ln.startswith("FAIL ")]
        print("\n".join(sorted(lines)))
        return 0
    wanted = [w for w in args.ops.split(",") if w]
    ops = {e: op for e, op in grad_entries().items() if not wanted or e in wanted or op.name in wanted}
    i, n = (int(v) for v in args.shard.split("/"))
    ops = {e: op for k, (e, op) in enumerate(ops.items()) if k % n == i}
    modes = MODES if args.mode == "all" else (args.mode,)
    counts = {m: [0, 0, 0] for m in modes}  # passed, failed, not applicable
    for eid, op in ops.items():
        for mode in modes:
            try:
                ok, reason = run_entry(op, mode)
            except Exception as e:
                ok, reason = False, f"harness error {type(e).__name__}: {e}"
            counts[mode][0 if ok else 2 if ok is None else 1] += 1
            if ok is False:
                print(f"FAIL {mode} {eid}: {' '.join(reason.split())[:200]}", flush=True)
        samples.cache_clear()
    for mode, (passed, failed, na) in counts.items():
        print(f"{mode}: {passed}/{passed + failed} entries agree with CPU torch, {na} not applicable", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
