"""`jaxtorch.jit`/`compile` as `torch.compile` users expect it (issue 30): guards and recompilation
triggers, Python values in and out, side effects, in-place writes and aliasing, module and mode
switches between calls, optimizers and schedulers, threads, exceptions mid-trace and the state after.

Each case compares with eager CPU torch (the same function run without compilation) or asserts a
clear error.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import jaxtorch

from .harness import case, close, equal, refuses, refuses_or

GAIN = 2.0  # globals the cases below read (and change, restoring them)
MODE = {"relu": True}
DTYPE = torch.float32
N_KEEP = 2
SHARED = (torch.ones(3), torch.zeros(3))


def _cpu(t):
    return t.detach().cpu() if isinstance(t, torch.Tensor) else t


def _same(f, *args, **kwargs):
    """Run `f` eagerly and through `jaxtorch.jit` on the same arguments; results close."""
    got = jaxtorch.jit(f)(*args, **kwargs)
    close(_cpu(got), f(*args, **kwargs))


def _helper(x):
    return x + 1


# ---- guards: Python values read from outside the function ------------------------------------------
@case("compiled2/guard/global_float_changes")
def _global_float():
    global GAIN

    def f(x):
        return x * GAIN

    fast, x = jaxtorch.jit(f), torch.randn(4)
    try:
        for g in (2.0, -3.0, 0.5):
            GAIN = g
            close(_cpu(fast(x)), f(x))
    finally:
        GAIN = 2.0
    assert fast.recompilations == 2, fast.stats()


@case("compiled2/guard/global_dict_flag_switches_branch")
def _dict_branch():
    def f(x):
        return torch.relu(x) if MODE["relu"] else torch.tanh(x)

    fast, x = jaxtorch.jit(f), torch.randn(5)
    try:
        close(_cpu(fast(x)), f(x))
        MODE["relu"] = False
        close(_cpu(fast(x)), f(x))
    finally:
        MODE["relu"] = True
    close(_cpu(fast(x)), f(x))


@case("compiled2/guard/global_int_used_as_slice_bound")
def _global_int():
    global N_KEEP

    def f(x):
        return x[:N_KEEP] * 2

    fast, x = jaxtorch.jit(f), torch.arange(6.0)
    try:
        close(_cpu(fast(x)), f(x))
        N_KEEP = 5
        close(_cpu(fast(x)), f(x))
    finally:
        N_KEEP = 2


@case("compiled2/guard/global_dtype_changes")
def _global_dtype():
    global DTYPE

    def f(x):
        return x.to(DTYPE) * 3

    fast, x = jaxtorch.jit(f), torch.randn(4)
    try:
        equal(_cpu(fast(x)), f(x))
        DTYPE = torch.bfloat16
        equal(_cpu(fast(x)), f(x))
    finally:
        DTYPE = torch.float32


@case("compiled2/guard/redefined_global_helper")
def _redefined_helper():
    global _helper

    def f(x):
        return _helper(x) * 2

    fast, x = jaxtorch.jit(f), torch.randn(3)
    original = _helper
    try:
        close(_cpu(fast(x)), f(x))
        _helper = lambda x: x - 10
        close(_cpu(fast(x)), f(x))
    finally:
        _helper = original


@case("compiled2/guard/closure_cell_reassigned_from_outside")
def _closure_cell():
    def make():
        k = 1.0

        def f(x):
            return x + k

        def set_k(v):
            nonlocal k
            k = v

        return f, set_k

    f, set_k = make()
    fast, x = jaxtorch.jit(f), torch.zeros(2)
    close(_cpu(fast(x)), f(x))
    set_k(41.0)
    close(_cpu(fast(x)), f(x))


@case("compiled2/guard/tensor_in_global_tuple_replaced_in_place")
def _global_tuple():
    def f(x):
        return x * SHARED[0] + SHARED[1]

    fast, x = jaxtorch.jit(f), torch.randn(3)
    close(_cpu(fast(x)), f(x))
    SHARED[1].add_(4)
    SHARED[0].mul_(-1)
    try:
        close(_cpu(fast(x)), f(x))
    finally:
        SHARED[1].zero_()
        SHARED[0].fill_(1)
    assert fast.compilations == 1


@case("compiled2/guard/tensor_in_nested_closed_over_dict_replaced")
def _nested_dict():
    store = {"layer": {"w": torch.ones(3), "b": [torch.zeros(3)]}}

    def f(x):
        return x * store["layer"]["w"] + store["layer"]["b"][0]

    fast, x = jaxtorch.jit(f), torch.randn(3)
    close(_cpu(fast(x)), f(x))
    store["layer"]["w"] = torch.full((3,), 3.0)
    store["layer"]["b"][0] = torch.full((3,), -2.0)
    close(_cpu(fast(x)), f(x))
    assert fast.compilations == 1


@case("compiled2/guard/closed_over_list_grows_between_calls")
def _list_grows():
    parts = [torch.ones(2)]

    def f(x):
        return x + sum(parts)

    fast, x = jaxtorch.jit(f), torch.zeros(2)
    close(_cpu(fast(x)), f(x))
    parts.append(torch.full((2,), 5.0))
    close(_cpu(fast(x)), f(x))


@case("compiled2/guard/default_argument_tensor_written_in_place")
def _default_tensor():
    def f(x, bias=torch.ones(2)):  # noqa: B008  (the default tensor is the point)
        return x + bias

    fast, x = jaxtorch.jit(f), torch.zeros(2)
    close(_cpu(fast(x)), f(x))
    f.__defaults__[0].add_(9)
    close(_cpu(fast(x)), f(x))
    close(_cpu(fast(x, torch.ones(2))), f(x, torch.ones(2)))


@case("compiled2/guard/bound_method_float_attribute")
def _bound_method():
    class Scaler:
        def __init__(self):
            self.k = 2.0

        def apply(self, x):
            return x * self.k

    s = Scaler()
    fast, x = jaxtorch.jit(s.apply), torch.randn(3)
    close(_cpu(fast(x)), s.apply(x))
    s.k = -7.0
    close(_cpu(fast(x)), s.apply(x))


@case("compiled2/guard/closed_over_config_object_attribute")
def _config_object():
    class Cfg:
        temperature = 1.0

    cfg = Cfg()
    cfg.temperature = 1.0

    def f(logits):
        return F.softmax(logits / cfg.temperature, -1)

    fast, x = jaxtorch.jit(f), torch.randn(2, 5)
    close(_cpu(fast(x)), f(x))
    cfg.temperature = 0.1
    close(_cpu(fast(x)), f(x))


@case("compiled2/guard/global_store_refused_clearly")
def _global_store():
    def f(x):
        global GAIN
        GAIN = 5.0
        return x

    refuses(
        lambda: jaxtorch.jit(f)(torch.ones(2)),
        "assigning a global inside jaxtorch.jit ran without an error",
        "GAIN",
        error=jaxtorch.StateWriteError,
    )
    assert GAIN == 2.0


# ---- modules: hooks, attributes, modes between calls -----------------------------------------------
@case("compiled2/module/forward_hook_added_after_first_call")
def _hook_added():
    lin = nn.Linear(3, 2)
    fast, x = jaxtorch.compile(lin), torch.randn(2, 3)
    fast(x)
    lin.register_forward_hook(lambda m, a, out: out.clamp(min=0))
    close(_cpu(fast(x)), lin(x))


@case("compiled2/module/forward_pre_hook_with_kwargs")
def _pre_hook_kwargs():
    lin = nn.Linear(3, 2)
    fast, x = jaxtorch.compile(lin), torch.randn(2, 3)
    fast(x)
    lin.register_forward_pre_hook(lambda m, args, kwargs: ((args[0] * 2,), kwargs), with_kwargs=True)
    close(_cpu(fast(x)), lin(x))


@case("compiled2/module/removed_hook_stops_running")
def _hook_removed():
    lin = nn.Linear(3, 2)
    h = lin.register_forward_hook(lambda m, a, out: out * 100)
    fast, x = jaxtorch.compile(lin), torch.randn(2, 3)
    close(_cpu(fast(x)), lin(x))
    h.remove()
    close(_cpu(fast(x)), lin(x))


@case("compiled2/module/submodule_swapped_for_another_class")
def _submodule_swap():
    net = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    fast, x = jaxtorch.compile(net), torch.randn(4, 3)
    close(_cpu(fast(x)), net(x))
    net[1] = nn.Tanh()  # no tensors: only its class tells the programs apart
    close(_cpu(fast(x)), net(x))


@case("compiled2/module/submodule_eval_while_parent_trains")
def _sub_eval():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.9))
    fast, x = jaxtorch.compile(net), torch.randn(4, 3)
    fast(x)  # train mode: dropout draws
    net[1].eval()
    close(_cpu(fast(x)), net(x))


@case("compiled2/module/batchnorm_momentum_changed_between_calls")
def _bn_momentum():
    torch.manual_seed(0)
    a, b = nn.BatchNorm1d(3), nn.BatchNorm1d(3)
    fast = jaxtorch.compile(a)
    xs = [torch.randn(8, 3) for _ in range(3)]
    fast(xs[0])
    b(xs[0])
    a.momentum = b.momentum = 0.9
    for x in xs[1:]:
        close(_cpu(fast(x)), b(x))
    close(_cpu(a.running_mean), b.running_mean)
    close(_cpu(a.running_var), b.running_var)


@case("compiled2/module/dropout_p_set_to_zero")
def _dropout_p():
    net = nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.5))
    fast, x = jaxtorch.compile(net), torch.randn(4, 3)
    fast(x)
    net[1].p = 0.0
    close(_cpu(fast(x)), net(x))


@case("compiled2/module/requires_grad_toggled_between_calls")
def _requires_grad_toggle():
    lin = nn.Linear(3, 1)
    fast, x = jaxtorch.compile(lin), torch.randn(4, 3)
    fast(x).sum().backward()
    lin.zero_grad(set_to_none=True)
    lin.weight.requires_grad_(False)
    fast(x).sum().backward()
    assert lin.weight.grad is None and lin.bias.grad is not None
    equal(_cpu(lin.bias.grad), torch.full((1,), 4.0))


# ---- grad mode, autocast, arguments ------------------------------------------------------------------
@case("compiled2/modes/no_grad_then_grad")
def _no_grad_then_grad():
    lin = nn.Linear(3, 1)
    fast, x = jaxtorch.compile(lin), torch.randn(2, 3)
    with torch.no_grad():
        assert not fast(x).requires_grad
    y = fast(x)
    assert y.requires_grad == lin(x).requires_grad
    y.sum().backward()
    close(_cpu(lin.weight.grad), x.sum(0, keepdim=True))


@case("compiled2/modes/input_requires_grad_toggled")
def _input_rg_toggle():
    def f(x):
        return (x**3).sum()

    fast = jaxtorch.jit(f)
    x = torch.randn(3)
    assert not fast(x).requires_grad
    xr = x.clone().requires_grad_(True)
    fast(xr).backward()
    close(xr.grad, 3 * x**2)


@case("compiled2/args/python_bool_argument_switches_branch")
def _bool_arg():
    def f(x, flip):
        return -x if flip else x * 2

    fast, x = jaxtorch.jit(f), torch.randn(3)
    for flip in (True, False, True):
        close(_cpu(fast(x, flip)), f(x, flip))
    assert fast.compilations == 2


@case("compiled2/args/float_kwarg_and_its_default")
def _float_kwarg():
    def f(x, *, scale=0.5):
        return x * scale

    fast, x = jaxtorch.jit(f), torch.randn(3)
    close(_cpu(fast(x)), f(x))
    close(_cpu(fast(x, scale=4.0)), f(x, scale=4.0))
    close(_cpu(fast(x)), f(x))


@case("compiled2/args/shape_then_dtype_change")
def _shape_dtype():
    def f(x):
        return (x * 2 + 1).sum(0)

    fast = jaxtorch.jit(f)
    for x in (torch.randn(3, 2), torch.randn(5, 2), torch.arange(6).reshape(3, 2)):
        equal(_cpu(fast(x)), f(x))
    assert fast.compilations == 3


# ---- results: Python values, aliasing --------------------------------------------------------------
@case("compiled2/results/shape_dtype_and_size_as_torch")
def _python_results():
    def f(x):
        return x.shape, x.dtype, x.size(-1), x.dim() / 2

    x = torch.randn(3, 4)
    assert jaxtorch.jit(f)(x) == f(x)


@case("compiled2/results/none_and_strings_kept")
def _none_result():
    def f(x):
        return None, "ok", x + 1

    a, b, c = jaxtorch.jit(f)(torch.ones(2))
    assert a is None and b == "ok"
    equal(_cpu(c), torch.full((2,), 2.0))


@case("compiled2/results/generator_function_refused_clearly")
def _generator():
    def f(x):
        yield x * 2

    refuses(
        lambda: jaxtorch.jit(f)(torch.ones(2)),
        "a generator made while tracing came back without an error",
        "generator",
        error=TypeError,
    )


@case("compiled2/results/format_of_a_compiled_loss")
def _format_loss():
    def f(x):
        return (x**2).mean()

    x = torch.randn(8)
    assert f"{jaxtorch.jit(f)(x):.4f}" == f"{f(x):.4f}"


@case("compiled2/alias/write_through_returned_view")
def _returned_view():
    def f(x):
        return x[1:]

    a, b = torch.arange(4.0).to("jax"), torch.arange(4.0)
    va, vb = jaxtorch.jit(f)(a), f(b)
    va.mul_(10)
    vb.mul_(10)
    equal(_cpu(a), b)


@case("compiled2/alias/input_written_in_place_and_returned")
def _inplace_returned():
    def f(x):
        x.mul_(3)
        return x

    a, b = torch.ones(3), torch.ones(3)
    out = jaxtorch.jit(f)(a)
    assert out is a
    f(b)
    equal(a, b)


# ---- side effects, data-dependent control flow, exceptions -----------------------------------------
@case("compiled2/effects/closed_over_list_append_each_call")
def _append_each_call():
    got, want = [], []

    def make(log):
        def f(x):
            y = x * 2
            log.append(y.sum())
            return y

        return f

    fast, slow = jaxtorch.jit(make(got)), make(want)
    for i in range(3):
        fast(torch.full((2,), float(i)))
        slow(torch.full((2,), float(i)))
    assert len(got) == len(want) == 3
    for g, w in zip(got, want):
        close(_cpu(g), w)


@case("compiled2/effects/item_under_jit_is_a_clear_error")
def _item():
    def f(x):
        return x * x.sum().item()

    refuses(lambda: jaxtorch.jit(f)(torch.ones(2)), ".item() of a traced tensor gave a value", "item", "data")


@case("compiled2/effects/data_dependent_if_is_a_clear_error")
def _data_if():
    def f(x):
        return x if x.sum() > 0 else -x

    refuses(lambda: jaxtorch.jit(f)(torch.ones(2)), "a tensor in a Python `if` gave a value", "bool", "data")


@case("compiled2/exceptions/error_mid_trace_then_next_call_works")
def _error_then_ok():
    lin = nn.Linear(2, 2)

    def f(x, fail):
        y = lin(x)
        if fail:
            raise ValueError("boom")
        return y

    fast, x = jaxtorch.jit(f), torch.randn(3, 2)
    before = lin.weight.detach().clone()
    with pytest.raises(ValueError, match="boom"):
        fast(x, True)
    equal(lin.weight.detach(), before)
    close(_cpu(fast(x, False)), f(x, False))


@case("compiled2/exceptions/buffer_write_before_an_error_is_kept_as_eager")
def _write_then_raise():
    def f(buf, x):
        buf.add_(1)
        if x.shape[0] > 2:
            raise ValueError("too long")
        return buf * x

    a, b = torch.zeros(3), torch.zeros(3)
    with pytest.raises(ValueError):
        f(b, torch.ones(3))
    with pytest.raises(ValueError):
        jaxtorch.jit(f)(a, torch.ones(3))
    equal(a, b)  # eager torch keeps the write made before the error


@case("compiled2/threads/concurrent_callers_get_their_own_results")
def _threads():
    lin = nn.Linear(4, 4)
    fast = jaxtorch.compile(lin)
    xs = [torch.randn(2, 4) for _ in range(8)]
    out: dict[int, torch.Tensor] = {}

    def run(i):
        with torch.no_grad():
            out[i] = _cpu(fast(xs[i]))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with torch.no_grad():
        for i, x in enumerate(xs):
            close(out[i], lin(x))


@case("compiled2/nesting/jit_function_calling_a_jit_function")
def _nested():
    @jaxtorch.jit
    def inner(x):
        return torch.sin(x) * 2

    def outer(x):
        return inner(x) + 1

    x = torch.randn(3)
    close(_cpu(jaxtorch.jit(outer)(x)), torch.sin(x) * 2 + 1)


# ---- optimizers and schedulers -----------------------------------------------------------------------
def _train(make_opt, make_sched, steps=5, lr_edit=None):
    """Train a small model eagerly on the CPU and through jaxtorch.jit on the jax device."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    model.load_state_dict(ref.state_dict())
    model = model.to("jax")
    ropt, opt = make_opt(ref.parameters()), make_opt(model.parameters())
    rs, s = make_sched(ropt), make_sched(opt)

    def step(m, o, x, y):
        o.zero_grad()
        loss = F.mse_loss(m(x), y)
        loss.backward()
        o.step()
        return loss

    fast = jaxtorch.jit(step)
    g = torch.Generator().manual_seed(1)
    for i in range(steps):
        x, y = torch.randn(6, 3, generator=g), torch.randn(6, 1, generator=g)
        close(_cpu(fast(model, opt, x.to("jax"), y.to("jax"))), step(ref, ropt, x, y), rtol=1e-5, atol=1e-6)
        if rs is not None:
            rs.step()
            s.step()
        if lr_edit is not None:
            for o in (ropt, opt):
                o.param_groups[0]["lr"] = lr_edit(i)
    for p, q in zip(ref.parameters(), model.parameters()):
        close(_cpu(q), p, rtol=1e-5, atol=1e-6)
    return fast


@case("compiled2/optim/sgd_exponential_lr_compiles_twice")
def _sgd_exp():
    fast = _train(
        lambda p: torch.optim.SGD(p, lr=0.1), lambda o: torch.optim.lr_scheduler.ExponentialLR(o, 0.5), steps=6
    )
    assert fast.compilations == 2, fast.stats()  # no grads at the first step, then grads: two signatures


@case("compiled2/optim/rmsprop_steplr_bounded_compilations")
def _rmsprop_step():
    fast = _train(
        lambda p: torch.optim.RMSprop(p, lr=0.01), lambda o: torch.optim.lr_scheduler.StepLR(o, 1, 0.5), steps=6
    )
    assert fast.compilations <= 2, fast.stats()


@case("compiled2/optim/lr_set_by_hand_between_steps")
def _lr_by_hand():
    fast = _train(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), lambda o: None, lr_edit=lambda i: 0.05 / (i + 1))
    assert fast.compilations <= 2, fast.stats()


@case("compiled2/optim/onecycle_cycles_momentum_values_match")
def _onecycle():
    _train(
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.5, total_steps=10),
        steps=5,
    )


@case("compiled2/optim/adamw_cosine_values_match")
def _adamw_cosine():
    fast = _train(
        lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
        lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=4),
        steps=5,
    )
    assert fast.compilations <= 2, fast.stats()


# ---- lazy mode and strings -------------------------------------------------------------------------
ACT = "relu"


@case("compiled2/guard/global_string_selects_the_activation")
def _global_string():
    global ACT

    def f(x):
        return getattr(F, ACT)(x)

    fast, x = jaxtorch.jit(f), torch.randn(6)
    try:
        close(_cpu(fast(x)), f(x))
        ACT = "gelu"
        close(_cpu(fast(x)), f(x))
    finally:
        ACT = "relu"


def _lazy_pair():
    torch.manual_seed(0)
    ref = nn.Linear(3, 2)
    m = nn.Linear(3, 2)
    m.load_state_dict(ref.state_dict())
    return ref, m.to("jax"), torch.randn(4, 3)


@case("compiled2/lazy/format_of_a_pending_loss")
def _lazy_format():
    ref, m, x = _lazy_pair()
    with jaxtorch.lazy():
        loss = (m(x.to("jax")) ** 2).mean()
        text = f"{loss:.4f}"
    assert text == f"{(ref(x) ** 2).mean():.4f}"


@case("compiled2/lazy/jit_of_a_pending_tensor")
def _lazy_jit():
    ref, m, x = _lazy_pair()
    with jaxtorch.lazy():
        y = m(x.to("jax"))
        z = jaxtorch.jit(lambda t: torch.tanh(t) * 2)(y)
    close(_cpu(z), torch.tanh(ref(x)) * 2)


@case("compiled2/lazy/global_float_guard_in_lazy_mode")
def _lazy_guard():
    global GAIN

    def f(t):
        return t * GAIN

    fast = jaxtorch.jit(f)
    x = torch.randn(3)
    try:
        with jaxtorch.lazy():
            a = fast(x.to("jax"))
            GAIN = 5.0
            b = fast(x.to("jax"))
    finally:
        GAIN = 2.0
    close(_cpu(a), x * 2.0)
    close(_cpu(b), x * 5.0)


@case("compiled2/optim/rprop_with_a_scheduler_values_match")
def _rprop():
    _train(lambda p: torch.optim.Rprop(p, lr=0.01), lambda o: torch.optim.lr_scheduler.StepLR(o, 2, 0.5), steps=4)


@case("compiled2/optim/adagrad_matches_or_refuses_clearly")
def _adagrad():
    def check():
        _train(lambda p: torch.optim.Adagrad(p, lr=0.1), lambda o: None, steps=3)

    refuses_or(check, "item", "data")


@case("compiled2/args/zero_dim_tensor_as_alpha")
def _tensor_alpha():
    def f(x, y, a):
        return x.add(y, alpha=a), torch.sub(x, y, alpha=a), torch._foreach_add([x], [y], alpha=a)[0]

    x, y, a = torch.randn(3), torch.randn(3), torch.tensor(-0.3)
    for got, want in zip(jaxtorch.jit(f)(x, y, a), f(x, y, a)):
        close(_cpu(got), want)
