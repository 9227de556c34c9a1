"""PyTorch's module database (`common_modules.module_db`) run through jaxtorch, three ways.

The measure (issue 13): every ModuleInfo entry, float32, the first 4 sample inputs for each
training flag (both flags where the entry says train and eval differ, else training mode),
compared with eager PyTorch on the CPU:

- jit:         `jax.jit(fn)` of `jaxtorch.extract(module)`'s forward.
- grad:        `jax.jit(jax.grad)` of `sum(out * cotangent)` with respect to `extract`'s
               params (which must be the module's trainable parameters) and float tensor
               inputs, against `torch.autograd.grad`; then 2 `optax.adamw` steps on the params
               as they are, after which every state entry (buffers, frozen parameters) and the
               torch module's tensors must be bit-identical.
- torch_first: `module.to("jax")`, inputs `.to("jax")`, forward, `.cpu()`.

A sample passes when values agree (rtol = atol = 1e-3, 1e-2 for grad, NaN == NaN), shapes
agree and dtypes are of the same kind (`tests/opinfo/harness.py`'s comparison). An entry
passes when all its samples do.

Command line:
    python -m tests.modules.harness --mode all
    python -m tests.modules.harness --mode jit --modules nn.LSTM,nn.GRU
"""

from __future__ import annotations

import argparse
import copy
import sys
import traceback
import warnings
from typing import Any

import jax
import numpy as np
import optax
import torch
import torch.utils._pytree as pytree

import jaxtorch
from jaxtorch import DataDependentError
from tests.opinfo.harness import _compare

MODES = ("jit", "grad", "torch_first")
N_SAMPLES = 4
TOL = {"jit": 1e-3, "grad": 1e-2, "torch_first": 1e-3}
ADAMW_STEPS = 2


def entries() -> dict[str, Any]:
    from torch.testing._internal.common_modules import module_db

    return {m.name: m for m in module_db}


def samples(info, training: bool, requires_grad: bool = False) -> list:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        inputs = info.module_inputs_func(
            info, device="cpu", dtype=torch.float32, requires_grad=requires_grad, training=training
        )
    return [s for s in inputs if s.forward_input is not None][:N_SAMPLES]


def _build(info, sample, training: bool) -> torch.nn.Module:
    """The module of one sample in float32, lazy parameters materialized, in the given mode."""
    torch.manual_seed(0)
    c = sample.constructor_input
    module = info.module_cls(*c.args, **c.kwargs).to(torch.float32)
    module.train(training)
    if info.is_lazy:  # the first forward decides the shapes; run it on a copy of the inputs
        with torch.no_grad():
            args, kwargs = _clone((sample.forward_input.args, sample.forward_input.kwargs))
            module(*args, **kwargs)
    return module


def _clone(tree):
    return pytree.tree_map(lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x, tree)


def _split(sample):
    """Leaves of (args, kwargs), their spec, and the positions of tensors."""
    leaves, spec = pytree.tree_flatten((sample.forward_input.args, dict(sample.forward_input.kwargs)))
    return leaves, spec, [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]


def _call(module, leaves, spec, pos, tensors):
    args, kwargs = _unflatten_args(leaves, spec, pos, tensors)
    return module(*args, **kwargs)


def _float_leaves(out) -> list[int]:
    return [
        i for i, o in enumerate(pytree.tree_leaves(out)) if isinstance(o, torch.Tensor) and o.dtype.is_floating_point
    ]


def _extract(module: torch.nn.Module):
    """`extract`'s params and forward; buffers a train-mode forward writes (BatchNorm statistics)
    come back from the mutable function, which this drops (a non-mutable one refuses the write)."""
    params, fn = jaxtorch.extract(module, mutable=True)

    def forward(p, *args, **kwargs):
        return fn(p, *args, **kwargs)[0]

    forward.state = fn.state  # type: ignore[attr-defined]  # (the snapshot the grad check compares)
    return params, forward


def run_sample(info, sample, training: bool, mode: str) -> None:
    module = _build(info, sample, training)
    leaves, spec, pos = _split(sample)
    tensors = [leaves[p].detach().clone() for p in pos]
    ref_module = copy.deepcopy(module)
    if mode == "jit":
        ref = _call(ref_module, leaves, spec, pos, _clone(tensors))
        params, fn = _extract(module)

        def forward(p, ts):
            args, kwargs = _unflatten_args(leaves, spec, pos, ts)
            return fn(p, *args, **kwargs)

        _compare(ref, jax.jit(forward)(params, [jaxtorch.to_jax(t) for t in tensors]), TOL[mode])
    elif mode == "torch_first":
        ref = _call(ref_module, leaves, spec, pos, _clone(tensors))
        jaxtorch.enable_globally()
        try:
            moved = module.to("jax")
            out = _call(moved, leaves, spec, pos, [t.to("jax") for t in tensors])
            out = pytree.tree_map(lambda x: x.detach().cpu() if isinstance(x, torch.Tensor) else x, out)
        finally:
            jaxtorch.disable_globally()
        _compare(ref, out, TOL[mode])
    else:
        _run_grad(module, ref_module, leaves, spec, pos, tensors)


def _unflatten_args(leaves, spec, pos, tensors):
    full = list(leaves)
    for p, t in zip(pos, tensors):
        full[p] = t
    return pytree.tree_unflatten(full, spec)


def _reference_with_grad(ref_module, leaves, spec, pos, tensors):
    """(float inputs that require grad, those inputs, torch output). Every float input, unless
    torch refuses one (`soft_margin_loss`'s target): then the first float input only."""
    floats = [k for k, t in enumerate(tensors) if t.dtype.is_floating_point]
    for diff_in in (floats, floats[:1]):
        t_in = [t.detach().clone().requires_grad_(k in diff_in) for k, t in enumerate(tensors)]
        try:
            return diff_in, t_in, _call(ref_module, leaves, spec, pos, t_in)
        except RuntimeError as e:
            if "is not differentiable with respect to argument" not in str(e) or diff_in == floats[:1]:
                raise


def _run_grad(module, ref_module, leaves, spec, pos, tensors) -> None:
    names = [n for n, p in ref_module.named_parameters() if p.requires_grad and p.dtype.is_floating_point]
    diff_in, t_in, ref = _reference_with_grad(ref_module, leaves, spec, pos, tensors)
    ref_leaves = pytree.tree_leaves(ref)
    outs = [i for i in _float_leaves(ref) if ref_leaves[i].requires_grad]
    if not outs:
        return
    gen = torch.Generator().manual_seed(1)
    cots = {i: torch.randn(ref_leaves[i].shape, generator=gen) for i in outs}
    loss = sum((ref_leaves[i] * c).sum() for i, c in cots.items())
    wrt = [dict(ref_module.named_parameters())[n] for n in names] + [t_in[k] for k in diff_in]
    ref_grads = torch.autograd.grad(loss, wrt, allow_unused=True)
    ref_grads = [torch.zeros_like(w) if g is None else g for w, g in zip(wrt, ref_grads)]

    params, fn = _extract(module)
    jcots = {i: jaxtorch.to_jax(c) for i, c in cots.items()}
    arrays = [jaxtorch.to_jax(t) for t in tensors]

    def jloss(diff_params, diff_inputs):
        p = dict(params, **diff_params)
        ts = list(arrays)
        for k, a in zip(diff_in, diff_inputs):
            ts[k] = a
        args, kwargs = _unflatten_args(leaves, spec, pos, ts)
        got = jax.tree_util.tree_leaves(fn(p, *args, **kwargs))
        if len(got) != len(ref_leaves):
            raise AssertionError(f"grad: {len(got)} outputs vs torch {len(ref_leaves)}")
        return sum((got[i] * c).sum() for i, c in jcots.items())

    if set(params) != set(names):
        raise AssertionError(f"grad: extract's params {sorted(params)} are not the trainable parameters {names}")
    grad = jax.jit(jax.grad(jloss, argnums=(0, 1)))
    inputs = [arrays[k] for k in diff_in]
    gp, gi = grad(params, inputs)
    _compare(ref_grads, [gp[n] for n in names] + list(gi), TOL["grad"], where="grad")
    _check_adamw_leaves_state(module, params, fn, lambda p: grad(p, inputs)[0], gp)


def _check_adamw_leaves_state(module, params, fn, grad_of, first_grads) -> None:
    """Issue 22: `params` go to `optax.adamw` as they are, for ADAMW_STEPS steps (the jitted
    gradient is reused: no new compilation); every state entry (buffers, frozen parameters) and
    the torch module's own tensors stay bit-identical."""
    state_before = {k: np.array(v) for k, v in fn.state.items()}
    module_before = {k: t.detach().clone() for k, t in module.state_dict().items()}
    opt = optax.adamw(1e-2)
    opt_state = opt.init(params)
    grads = first_grads
    for i in range(ADAMW_STEPS):
        if i:
            grads = grad_of(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    for k, v in fn.state.items():
        if not (np.array_equal(np.asarray(v), state_before[k], equal_nan=True) and v.dtype == state_before[k].dtype):
            raise AssertionError(f"adamw: state entry {k} changed")
    for k, t in module.state_dict().items():
        if not torch.equal(t, module_before[k]) and not (t.isnan() & module_before[k].isnan()).any():
            raise AssertionError(f"adamw: the torch module's {k} changed")


def run_entry(info, mode: str) -> tuple[bool | None, str]:
    """(passed, reason); passed is None when the entry has nothing to test."""
    n = 0
    for training in (True, False) if info.train_and_eval_differ else (True,):
        for k, sample in enumerate(samples(info, training)):
            where = f"{'train' if training else 'eval'} sample {k}"
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    run_sample(info, sample, training, mode)
            except DataDependentError as e:
                return False, f"data-dependent ({where}): {' '.join(str(e).split())[:300]}"
            except Exception as e:
                msg = " ".join(str(e).split())[:200]
                return False, f"{type(e).__name__} ({where}): {msg}"
            n += 1
    return (True, "") if n else (None, "no samples")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", default="all", choices=MODES + ("all",))
    ap.add_argument("--modules", default="", help="comma-separated entry names (nn.LSTM,...)")
    ap.add_argument("--traceback", action="store_true")
    args = ap.parse_args(argv)
    wanted = [w for w in args.modules.split(",") if w]
    infos = {k: v for k, v in entries().items() if not wanted or k in wanted}
    for mode in MODES if args.mode == "all" else (args.mode,):
        passed = failed = 0
        for name, info in infos.items():
            try:
                ok, reason = run_entry(info, mode)
            except Exception as e:  # pragma: no cover
                ok, reason = False, f"harness error {type(e).__name__}: {e}"
                if args.traceback:
                    traceback.print_exc()
            if ok:
                passed += 1
            elif ok is False:
                failed += 1
                print(f"FAIL {mode} {name}: {reason}", flush=True)
        print(f"{mode}: {passed}/{passed + failed} modules pass", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
