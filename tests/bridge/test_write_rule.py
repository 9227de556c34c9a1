"""One rule for writes to torch state inside JAX-first functions (issue 22, item 4).

Inside `call_torch`, `extract`'s function and `TorchModule`, an op writing a plain torch
tensor raises `StateWriteError` naming it, eagerly and under `jax.jit` (never a write done
once at trace time). The ops are drawn from the route table, so every in-place / `out=` /
foreach overload jaxtorch runs is covered, new ones included. Module buffers a non-mutable
function binds are read-only; `extract(model, mutable=True)` carries their new values.
The PyTorch-first paths (`enable_globally`, `.to("jax")`), where CPU writes are torch's
own business, are unaffected.
"""

from __future__ import annotations

import copy
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxtorch
from jaxtorch import StateWriteError
from jaxtorch.bridge.dispatch._routing import Kind, route

aten = torch.ops.aten

# ---- every in-place op of the route table, with arguments synthesized from its schema ----------
_VALUES = {
    "Tensor": lambda: torch.ones(3),
    "List[Tensor]": lambda: [torch.ones(3)],
    "number": lambda: 1.0,
    "int": lambda: 0,
    "float": lambda: 0.5,
    "bool": lambda: True,
    "List[int]": lambda: [0],
    "str": lambda: "none",
}


def _mutating_ops() -> list:
    """Every aten overload that writes an argument and that jaxtorch runs (not `unsupported`)."""
    found = []
    for name in sorted(torch._C._dispatch_get_all_op_names()):
        if not name.startswith("aten::"):
            continue
        base, _, overload = name[len("aten::") :].partition(".")
        op = getattr(getattr(aten, base, None), overload or "default", None)
        if op is None:
            continue
        r = route(op)
        if r.mutated and r.kind is not Kind.UNSUPPORTED:
            found.append(op)
    return found


def _arguments(op) -> tuple[list, dict] | None:
    """Plain CPU tensors and simple values for `op`'s required arguments (None: a type not synthesized)."""
    mutated = {m[1] for m in route(op).mutated}
    args, kwargs = [], {}
    for a in op._schema.arguments:
        if a.name not in mutated and (a.has_default_value() or str(a.type).startswith("Optional")):
            continue
        make = _VALUES.get(str(a.type))
        if make is None:
            return None
        if a.kwarg_only:
            kwargs[a.name] = make()
        else:
            args.append(make())
    return args, kwargs


_OPS = [op for op in _mutating_ops() if _arguments(op) is not None]
# Autograd metadata, not data: torch changes no value (`requires_grad_`, `detach_`). And `set_data`,
# which torch handles above every mode when called as an op: `t.data = v`, the way code reaches it, is
# refused by the function mode (`.data =` in `test_named_writes_raise_naming_the_tensor`).
_NOT_SEEN = {aten.requires_grad_.default, aten.detach_.default, aten.set_data.default}


def test_the_route_table_gives_hundreds_of_mutating_ops():
    names = {op.name() for op in _OPS}
    assert len(_OPS) > 500
    for want in (
        "aten::add_.Tensor",
        "aten::fill_.Scalar",
        "aten::normal_",
        "aten::_foreach_add_.Scalar",
        "aten::add.out",
    ):
        assert want in names


def _plain_torch_outcome(op, args, kwargs) -> type[BaseException] | None:
    try:
        op(*args, **kwargs)
    except Exception as e:  # (synthesized arguments an op refuses: its own error)
        return type(e)
    return None


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("op", _OPS, ids=lambda op: op.name().removeprefix("aten::"))
def test_every_mutating_op_on_a_cpu_tensor_raises(op, jit):
    made = _arguments(op)
    assert made is not None
    args, kwargs = made
    before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]

    def body(x):
        op(*args, **kwargs)
        return x

    def run(x):
        return jaxtorch.call_torch(body, x)

    try:
        (jax.jit(run) if jit else run)(jnp.ones(3))
    except StateWriteError as e:
        assert "shape (3,)" in str(e) and "mutable=True" in str(e)
        for a, b in zip(args, before):  # nothing was written
            if isinstance(a, torch.Tensor):
                assert torch.equal(a, b)
        return
    except Exception as e:
        # arguments the op itself refuses (checked before anything is written): plain torch refuses them too
        assert _plain_torch_outcome(op, *_arguments(op)) is type(e), f"{op}: {type(e).__name__}: {e}"  # type: ignore[misc]
        return
    assert op in _NOT_SEEN, f"{op} wrote a CPU tensor inside call_torch without StateWriteError"


# ---- the named cases of the issue ----------------------------------------------------------
_CASES = {
    "add_(1)": lambda counter, x: counter.add_(1),
    "add_(tensor)": lambda counter, x: counter.add_(x),
    "add_(cpu tensor)": lambda counter, x: counter.add_(torch.ones(3, device="cpu")),
    "+=": lambda counter, x: counter.__iadd__(1),
    "fill_": lambda counter, x: counter.fill_(2),
    "zero_": lambda counter, x: counter.zero_(),
    "setitem": lambda counter, x: counter.__setitem__(0, 5.0),
    "copy_": lambda counter, x: counter.copy_(x),
    "clamp_": lambda counter, x: counter.clamp_(0, 1),
    "exp_": lambda counter, x: counter.exp_(),
    "normal_": lambda counter, x: counter.normal_(),
    "uniform_": lambda counter, x: counter.uniform_(),
    "bernoulli_": lambda counter, x: counter.bernoulli_(0.5),
    "foreach": lambda counter, x: torch._foreach_add_([counter], 1.0),
    "foreach list": lambda counter, x: torch._foreach_mul_([counter], [x]),
    "out=": lambda counter, x: torch.add(x, 1, out=counter),
    "out= cpu": lambda counter, x: torch.add(torch.ones(3, device="cpu"), 1, out=counter),
    "view write": lambda counter, x: counter[1:].mul_(2),
    "squeeze_": lambda counter, x: counter.unsqueeze_(0),
    ".data =": lambda counter, x: setattr(counter, "data", torch.ones(3, device="cpu")),
    "relu inplace": lambda counter, x: torch.nn.functional.relu(counter, inplace=True),
}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("case", list(_CASES))
def test_named_writes_raise_naming_the_tensor(case, jit):
    counter = torch.zeros(3)

    def run(x):
        return jaxtorch.call_torch(lambda a: (_CASES[case](counter, a), a)[1], x)

    with pytest.raises(StateWriteError, match="`counter`"):
        (jax.jit(run) if jit else run)(jnp.ones(3))
    assert counter.tolist() == [0.0, 0.0, 0.0] and counter.shape == (3,)


class Counter(torch.nn.Module):
    """A module keeping a plain tensor counter (not a buffer)."""

    def __init__(self):
        super().__init__()
        self.count = torch.zeros(())
        self.lin = torch.nn.Linear(3, 2)

    def forward(self, x):
        self.count += 1
        return self.lin(x)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_module_counter_attribute_raises_naming_it(jit):
    m = Counter()
    params, fn = jaxtorch.extract(m)
    f = jax.jit(fn) if jit else fn
    for _ in range(3):
        with pytest.raises(StateWriteError, match=r"`Counter\.count`.*register_buffer"):
            f(params, jnp.ones((2, 3)))
    assert float(m.count) == 0.0
    with pytest.raises(StateWriteError, match=r"`Counter\.count`"):
        jaxtorch.torch_module_to_jax(m)(jnp.ones((2, 3)))


class CounterBuffer(Counter):
    """The same counter as a buffer: `extract(mutable=True)` carries it."""

    def __init__(self):
        super().__init__()
        del self.count
        self.register_buffer("count", torch.zeros(()))


def test_counter_buffer_is_carried_by_mutable_extract():
    m = CounterBuffer()
    params, fn = jaxtorch.extract(m, mutable=True)
    step = jax.jit(fn)
    state = fn.state
    for _ in range(3):
        _, state = step(params, jnp.ones((2, 3)), state=state)
    assert float(state["count"]) == 3.0
    assert float(m.count) == 0.0  # the module is left as found


@functools.cache
def _bn() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_batchnorm_train_mode_non_mutable_raises(jit):
    model = _bn().train()
    params, fn = jaxtorch.extract(model)
    f = jax.jit(fn) if jit else fn
    with pytest.raises(StateWriteError, match=r"`1\.(num_batches_tracked|running_mean)`.*mutable=True"):
        f(params, jnp.ones((2, 3)))
    with pytest.raises(StateWriteError, match="mutable=True"):
        jaxtorch.torch_module_to_jax(model)(jnp.ones((2, 3)))


def test_batchnorm_train_mode_mutable_carries_statistics_like_torch():
    model = _bn().train()
    x = torch.randn(8, 3)
    params, fn = jaxtorch.extract(model, mutable=True)
    out, new = jax.jit(fn)(params, jaxtorch.to_jax(x))
    ref = copy.deepcopy(model)
    want = ref(x)
    np.testing.assert_allclose(np.asarray(out), want.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(new["1.running_mean"]), ref[1].running_mean.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(new["1.running_var"]), ref[1].running_var.numpy(), rtol=1e-5, atol=1e-6)
    assert int(new["1.num_batches_tracked"]) == 1
    assert torch.equal(model[1].running_mean, torch.zeros(4))  # the module is left as found


def test_batchnorm_eval_mode_non_mutable_is_fine():
    model = _bn().eval()
    params, fn = jaxtorch.extract(model)
    x = torch.randn(5, 3)
    np.testing.assert_allclose(
        np.asarray(jax.jit(fn)(params, jaxtorch.to_jax(x))), model(x).detach().numpy(), rtol=1e-5, atol=1e-6
    )


def test_writes_to_tensors_made_inside_are_fine():
    def body(x):
        scratch = torch.zeros(3)  # on the jax device there: not torch state
        scratch.add_(x)
        scratch[0] = 7.0
        torch._foreach_mul_([scratch], 2.0)
        return scratch

    for f in (lambda x: jaxtorch.call_torch(body, x), jax.jit(lambda x: jaxtorch.call_torch(body, x))):
        np.testing.assert_array_equal(np.asarray(f(jnp.ones(3))), [14.0, 2.0, 2.0])


def test_cpu_scratch_made_inside_is_not_torch_state():
    """A CPU tensor the function makes itself (and a composite kernel's temporaries) may be written."""
    keys = torch.tensor([3.0, 1.0, 2.0])

    def body(x):
        scratch = torch.empty(3, device="cpu")
        scratch.fill_(2.0)
        scratch[:1].mul_(2.0)  # a view of it
        order = torch.empty(3, dtype=torch.long, device="cpu")
        torch.argsort(keys, stable=True, out=order)  # writes `order` and a temporary of its own
        return x * scratch + order.float()

    want = np.array([4.0, 2.0, 2.0]) + np.array([1.0, 2.0, 0.0])
    for f in (lambda x: jaxtorch.call_torch(body, x), jax.jit(lambda x: jaxtorch.call_torch(body, x))):
        np.testing.assert_array_equal(np.asarray(f(jnp.ones(3))), want)


def test_the_rule_is_per_thread_and_scoped():
    """After a refused write, the same tensor is written freely by plain torch."""
    t = torch.zeros(3)
    with pytest.raises(StateWriteError):
        jaxtorch.call_torch(lambda x: (t.add_(1), x)[1], jnp.ones(3))
    t.add_(1)
    assert t.tolist() == [1.0, 1.0, 1.0]


def test_pytorch_first_paths_write_cpu_tensors_as_torch_does():
    t = torch.zeros(3)
    with jaxtorch.default_env():
        x = torch.ones(3, device="jax")
        t.add_(1)
        t.copy_(x.cpu())
        t += 1
        torch._foreach_add_([t], 1.0)
    assert t.tolist() == [3.0, 3.0, 3.0]
    jaxtorch.enable_globally()
    try:
        t.fill_(5)
        t[0] = 1.0
    finally:
        jaxtorch.disable_globally()
    assert t.tolist() == [1.0, 5.0, 5.0]


def test_only_the_write_rule_module_installs_write_checks():
    """Issue 32 item 4: `dispatch/_writes.py` owns the write checks; compile, remat and control
    flow install theirs through `_writes.checking` (no other module touches the list)."""
    import pathlib
    import re

    import jaxtorch.bridge.dispatch._writes as writes_mod
    from jaxtorch.bridge.tensor import _tensor as tensor_mod

    root = pathlib.Path(jaxtorch.__file__).parent
    pattern = re.compile(r"write_checks\.(append|remove|insert|extend|pop|clear)|write_checks\s*[+]?=")
    found = [
        f"{p.relative_to(root)}:{i}"
        for p in sorted(root.rglob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
        and p.name not in ("_writes.py",)
        and not (p.name == "_tensor.py" and line.startswith("write_checks:"))
    ]
    assert found == [], found
    seen = []
    with writes_mod.checking(lambda t: seen.append(tuple(t.shape))):
        assert len(tensor_mod.write_checks) == 1
        with jaxtorch.default_env():
            torch.zeros(2, 3, device="jax").add_(1)
    assert tensor_mod.write_checks == [] and seen == [(2, 3)]
