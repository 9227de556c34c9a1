"""`torch._foreach_*` ops as ONE call over their lists, not one op per tensor.

Optimizers on the `jax` device take torch's foreach path (`torch.optim.AdamW` calls
`torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)` once for all parameters). Running
such an op as its per-tensor op once per list element costs a torch dispatch per tensor;
here the per-element op's JAX lowering is applied over the lists inside one lowering, so
eager mode makes one cached `jax.jit` call and lazy mode records one graph node per
foreach op (AdamW on GPT-2 4x256's 52 parameters: 8 nodes instead of ~420).

The per-element op is found from the schemas: `_foreach_add_.List(Tensor[] self, Tensor[]
other, *, Scalar alpha)` -> `add.Tensor(Tensor self, Tensor other, *, Scalar alpha)`,
`_foreach_addcmul_.ScalarList(..., Scalar[] scalars)` -> `addcmul(..., *, Scalar value)`:
the argument types with each list type replaced by its element type must be a prefix of
the per-element op's (the rest defaulted), or match by name (`_foreach_norm` ->
`linalg_vector_norm`, whose kernel ATen uses too, as `clamp_min` for `_foreach_maximum.Scalar`).
Foreach overloads with no such match, or whose per-element op has no registered lowering,
keep the per-tensor loop, and so does an in-place call whose output list shares a tensor
with another position (`_foreach_copy_([a, b], [b, a])`: the loop's order decides the answer).

Example:
    ```python
    xs = [torch.ones(3, device="jax"), torch.ones(2, device="jax")]
    torch._foreach_mul_(xs, 2.0)       # one jitted call (one node in lazy mode)
    ```
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..._compat import foreach_supported_types
from ..core import _registry as registry

aten = torch.ops.aten

_LIST_OF = {"List[Tensor]": "Tensor", "List[number]": "number"}  # (str of torch's schema types)


# foreach ops whose ATen kernels are another op's (`_foreach_maximum.Scalar` is `clamp_min`)
_SAME_AS = {"maximum": ("clamp_min",), "minimum": ("clamp_max",), "norm": ("linalg_vector_norm",)}
_NO_SOURCE = -1


def _type(arg) -> str:
    return str(arg.type)


def _plan(foreach_args: list, want: list[str], cargs: list) -> list[tuple[int, Any, bool, str]] | None:
    """Per per-element argument, (foreach argument index or _NO_SOURCE, default, keyword-only, name):
    by position when the types are a prefix, else by name; every other argument defaulted."""
    if [_type(a) for a in cargs[: len(want)]] == want:
        source = {j: j for j in range(len(want))}
    else:
        by_name = {a.name: (i, t) for i, (a, t) in enumerate(zip(foreach_args, want))}
        source = {}
        for j, c in enumerate(cargs):
            hit = by_name.get(c.name)
            if hit is not None and hit[1] == _type(c):
                source[j] = hit[0]
        if len(source) != len(want):
            return None
    plan = []
    for j, c in enumerate(cargs):
        if j not in source and not c.has_default_value():
            return None
        plan.append((source.get(j, _NO_SOURCE), c.default_value if j not in source else None, c.kwarg_only, c.name))
    while plan and plan[-1][0] == _NO_SOURCE:  # trailing defaults are left to the lowering
        plan.pop()
    return plan


def per_element(func) -> tuple[Any, list[bool], list] | None:
    """(per-element functional overload, which foreach arguments are lists, the call plan
    (see `_plan`)), or None when no per-element overload matches."""
    schema = func._schema
    name = schema.name.split("::")[1][len("_foreach_") :]
    if schema.overload_name.endswith("out"):
        return None
    base = name[:-1] if name.endswith("_") else name
    args = list(schema.arguments)
    is_list = [_type(a) in _LIST_OF for a in args]
    if not any(_type(a) == "List[Tensor]" for a in args):
        return None
    want = [_LIST_OF.get(_type(a), _type(a)) for a in args]
    for packet_name in (base, *_SAME_AS.get(base, ())):
        packet = getattr(aten, packet_name, None)
        if packet is None:
            continue
        best = None
        for ov in packet.overloads():
            cand = getattr(packet, ov)
            cs = cand._schema
            cargs = list(cs.arguments)
            if ov.endswith("out") or any(a.alias_info is not None and a.alias_info.is_write for a in cargs):
                continue
            if len(cs.returns) != 1 or _type(cs.returns[0]) != "Tensor":
                continue
            plan = _plan(args, want, cargs)
            if plan is not None and (best is None or len(cargs) < len(best[0]._schema.arguments)):
                best = (cand, plan)
        if best is not None:
            return best[0], is_list, best[1]
    return None


def multi_lowering(func, elem_lowering: Callable, is_list: list[bool], plan: list) -> Callable:
    """`f(*args, **kwargs)` with the foreach schema's arguments: the list of per-element
    results of `elem_lowering` (called as `plan` says)."""
    schema_args = list(func._schema.arguments)
    names = [a.name for a in schema_args]
    defaults = [a.default_value if a.has_default_value() else None for a in schema_args]

    def lowering(*args, **kwargs):
        vals = list(args) + [kwargs.get(n, d) for n, d in zip(names[len(args) :], defaults[len(args) :])]
        n = len(next(v for v, lst in zip(vals, is_list) if lst))
        out = []
        for j in range(n):
            per = [v[j] if lst else v for v, lst in zip(vals, is_list)]
            pos, kw = [], {}
            for src, default, kw_only, name in plan:
                v = default if src == _NO_SOURCE else per[src]
                if kw_only:
                    kw[name] = v
                else:
                    pos.append(v)
            out.append(elem_lowering(*pos, **kw))
        return out

    return lowering


def lowering_for(func) -> Callable | None:
    """The one-call lowering of the foreach overload `func`, or None (use the per-tensor loop)."""
    spec = per_element(func)
    if spec is None:
        return None
    elem, is_list, plan = spec
    elem_lowering = registry.lookup(elem)
    if elem_lowering is None:
        return None
    return multi_lowering(func, elem_lowering, is_list, plan)


def lists_of_jax_tensors(args, kwargs, jax_tensor) -> bool:
    """Whether every tensor in the arguments' lists is a `JaxTensor` (CPU lists, such as
    an optimizer's step counters, keep torch's own path)."""
    found = False
    for a in (*args, *kwargs.values()):
        if type(a) is list or type(a) is tuple:
            for b in a:
                if type(b) is jax_tensor:
                    found = True
                elif isinstance(b, torch.Tensor):
                    if not isinstance(b, jax_tensor):
                        return False
                    found = True
        elif isinstance(a, torch.Tensor) and not isinstance(a, jax_tensor):
            return False
    return found


def enable_for_optimizers(tensor_type: type) -> None:
    """Let `torch.optim` take its foreach path for `tensor_type` parameters.

    torch picks foreach by default only for devices in its foreach list (the `jax` device is
    there: PrivateUse1) AND tensor types in `torch.optim.optimizer._foreach_supported_types`
    (`Tensor`, `Parameter`); parameters moved to the jax device are `JaxTensor`s.
    """
    supported = foreach_supported_types()
    if supported is not None and tensor_type not in supported:
        supported.append(tensor_type)


def aliased_across(args, kwargs, root: Callable) -> bool:
    """Whether an in-place foreach call's output list (`args[0]`) holds one tensor (or two views
    of one, by `root`) twice, or one that another argument reads at another position: then
    computing every result before writing any (one call) can differ from torch's loop."""
    out_at: dict[int, int] = {}
    for i, t in enumerate(args[0]):
        k = id(root(t))
        if k in out_at:
            return True
        out_at[k] = i
    for a in (*args[1:], *kwargs.values()):
        if type(a) is list or type(a) is tuple:
            for j, b in enumerate(a):
                if isinstance(b, torch.Tensor) and out_at.get(id(root(b)), j) != j:
                    return True
        elif isinstance(a, torch.Tensor) and id(root(a)) in out_at:
            return True
    return False
