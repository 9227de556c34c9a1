"""Torch semantics of the elementwise lowerings that OpInfo samples do not pin down.

Every check runs the same torch code eagerly on CPU and through jaxtorch, and compares
values and dtypes (torch.int64 is held as int32 without JAX's 64-bit mode but reported as
torch.int64, so dtypes are compared on the torch side of the bridge).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxtorch


def _run(fn, *tensors, jit=False):
    """(torch CPU result, jaxtorch result as a CPU tensor) of `fn(*tensors)`."""
    ref = fn(*tensors)
    arrays = [jaxtorch.to_jax(t) for t in tensors]
    call = lambda *a: jaxtorch.call_torch(fn, *a)
    got = jax.jit(call)(*arrays) if jit else call(*arrays)
    return ref, got


def _stored(dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of a JAX result array of a torch result of `dtype`, read back by `to_torch`:
    the array's own (int64 is held as int32 without x64)."""
    from jaxtorch.bridge.core._dtypes import to_jax_dtype, to_torch_dtype

    return to_torch_dtype(to_jax_dtype(dtype))


def _check(fn, *tensors, jit=False):
    try:
        fn(*tensors)
    except RuntimeError:  # torch refuses it (e.g. subtracting bools): jaxtorch must refuse it too
        with pytest.raises(Exception):
            jaxtorch.call_torch(fn, *[jaxtorch.to_jax(t) for t in tensors])
        return
    ref, got = _run(fn, *tensors, jit=jit)
    got_t = jaxtorch.to_torch(got)
    assert got_t.dtype == _stored(ref.dtype), (got_t.dtype, ref.dtype)
    ref = ref.to(got_t.dtype)
    assert tuple(got_t.shape) == tuple(ref.shape)
    torch.testing.assert_close(got_t, ref, equal_nan=True, rtol=1e-6, atol=1e-6)


INTS_A = torch.tensor([-7, -6, -1, 0, 1, 5, 7])
INTS_B = torch.tensor([3, -3, 2, -2, 4, -4, 3])
FLOATS_A = torch.tensor([-7.5, -6.0, -1.0, -0.0, 0.0, 5.25, 7.0, float("inf"), float("nan")])
FLOATS_B = torch.tensor([2.0, -4.0, 3.0, -2.0, 0.0, -0.5, 0.0, 3.0, 1.0])


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize(
    "fn",
    [
        lambda a, b: torch.div(a, b, rounding_mode="trunc"),
        lambda a, b: torch.div(a, b, rounding_mode="floor"),
        lambda a, b: torch.floor_divide(a, b),
        lambda a, b: torch.remainder(a, b),
        lambda a, b: torch.fmod(a, b),
        lambda a, b: a % b,
        lambda a, b: a // b,
    ],
    ids=["trunc", "floor", "floor_divide", "remainder", "fmod", "mod_op", "floordiv_op"],
)
def test_integer_division_and_remainder_signs(fn, jit):
    _check(fn, INTS_A, INTS_B, jit=jit)


@pytest.mark.parametrize(
    "fn",
    [
        lambda a, b: torch.div(a, b, rounding_mode="trunc"),
        lambda a, b: torch.div(a, b, rounding_mode="floor"),
        lambda a, b: torch.remainder(a, b),
        lambda a, b: torch.fmod(a, b),
        lambda a, b: a / b,
    ],
    ids=["trunc", "floor", "remainder", "fmod", "true_div"],
)
def test_float_division_signs_zero_inf_nan(fn):
    _check(fn, FLOATS_A, FLOATS_B)


@pytest.mark.parametrize(
    "fn",
    [
        lambda a, b: a + b,
        lambda a, b: a * b,
        lambda a, b: a - b,
        lambda a, b: a / b,
        lambda a, b: torch.true_divide(a, b),
        lambda a, b: a ** b.abs(),
        lambda a, b: torch.maximum(a, b),
    ],
    ids=["add", "mul", "sub", "div", "true_divide", "pow", "maximum"],
)
def test_int_int_promotion(fn):
    """int + int stays int64, int / int becomes float32."""
    _check(fn, INTS_A, INTS_B)


@pytest.mark.parametrize(
    "fn",
    [
        lambda a, b: a + b,
        lambda a, b: a * b,
        lambda a, b: a | b,
        lambda a, b: a & b,
        lambda a, b: a ^ b,
        lambda a, b: torch.logical_xor(a, b),
        lambda a, b: a == b,
        lambda a, b: ~a,
        lambda a, b: a + 1,
        lambda a, b: a * 2.5,
        lambda a, b: a / b,
    ],
    ids=["add", "mul", "or", "and", "xor", "logical_xor", "eq", "not", "add_int", "mul_float", "div"],
)
def test_bool_ops(fn):
    a = torch.tensor([True, True, False, False])
    b = torch.tensor([True, False, True, False])
    _check(fn, a, b)


@pytest.mark.parametrize(
    "fn",
    [
        lambda x, s: x + s,
        lambda x, s: x * s,
        lambda x, s: s - x,
        lambda x, s: x < s,
        lambda x, s: x.float() + s,
    ],
    ids=["add", "mul", "rsub", "lt", "float_plus_int0"],
)
@pytest.mark.parametrize(
    "dtypes",
    [
        (torch.int64, torch.float32),
        (torch.float32, torch.int64),
        (torch.int32, torch.int64),
        (torch.bool, torch.int64),
        (torch.float16, torch.float32),
    ],
)
def test_zero_dim_vs_dimensioned(fn, dtypes):
    """A 0-dim tensor only lifts the category (int -> float), never the width within one."""
    x = torch.tensor([1, -2, 3]).to(dtypes[0])
    s = torch.tensor(2).to(dtypes[1])
    _check(fn, x, s)


@pytest.mark.parametrize("scalar", [2, 2.5, True, -3])
@pytest.mark.parametrize(
    "fn",
    [
        lambda x, s: x + s,
        lambda x, s: x * s,
        lambda x, s: x - s,
        lambda x, s: s - x,
        lambda x, s: x / s,
        lambda x, s: x // s if s != 0 else x,
        lambda x, s: x % s,
        lambda x, s: x**2,
        lambda x, s: s ** x.abs(),
        lambda x, s: x == s,
        lambda x, s: x > s,
        lambda x, s: torch.clamp(x, min=s),
        lambda x, s: torch.clamp(x, max=s),
    ],
    ids=["add", "mul", "sub", "rsub", "div", "floordiv", "mod", "pow2", "rpow", "eq", "gt", "clamp_min", "clamp_max"],
)
@pytest.mark.parametrize("dtype", [torch.int64, torch.float32, torch.int16])
def test_python_scalars(fn, scalar, dtype):
    """Python scalars promote only across categories (int tensor * 2.5 -> float32)."""
    x = torch.tensor([1, -2, 3, 4]).to(dtype)
    try:
        ref = fn(x, scalar)
    except RuntimeError:  # torch refuses the combination (e.g. subtracting a bool); nothing to compare
        with pytest.raises(Exception):
            jaxtorch.call_torch(lambda t: fn(t, scalar), jaxtorch.to_jax(x))
        return
    got = jaxtorch.to_torch(jaxtorch.call_torch(lambda t: fn(t, scalar), jaxtorch.to_jax(x)))
    assert got.dtype == _stored(ref.dtype)
    torch.testing.assert_close(got, ref.to(got.dtype), equal_nan=True)


def test_int_pow_negative_exponent_tensor():
    base = torch.tensor([1, -1, -1, 2, 3, 0])
    exp = torch.tensor([-3, -3, -2, -1, 2, 0])
    _check(torch.pow, base, exp)


def test_scalar_base_pow():
    _check(lambda e: torch.pow(2, e), torch.tensor([0, 1, 5]))
    _check(lambda e: torch.pow(2.0, e), torch.tensor([0, 1, 5]))
    _check(lambda e: torch.pow(2, e), torch.tensor([0.5, 1.0, -1.0]))


@pytest.mark.parametrize(
    "fn",
    [
        lambda a, b: torch.bitwise_left_shift(a, b),
        lambda a, b: torch.bitwise_right_shift(a, b),
        lambda a, b: a << 3,
        lambda a, b: a >> 3,
    ],
    ids=["lshift", "rshift", "lshift_scalar", "rshift_scalar"],
)
def test_shifts(fn):
    a = torch.tensor([-16, -1, 1, 5, 1024], dtype=torch.int32)
    b = torch.tensor([1, 2, 31, -1, 40], dtype=torch.int32)
    _check(fn, a, b)


def test_shifts_uint8():
    a = torch.tensor([255, 1, 128], dtype=torch.uint8)
    b = torch.tensor([1, 9, 7], dtype=torch.uint8)
    _check(torch.bitwise_left_shift, a, b)
    _check(torch.bitwise_right_shift, a, b)


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: torch.round(x),
        lambda x: torch.round(x, decimals=1),
        lambda x: torch.round(x, decimals=-1),
        lambda x: torch.sign(x),
        lambda x: torch.signbit(x),
        lambda x: torch.nan_to_num(x),
        lambda x: torch.nan_to_num(x, nan=1.0, posinf=2.0),
        lambda x: torch.clamp(x, -1.0, 1.0),
        lambda x: torch.clamp(x, 2.0, 1.0),
        lambda x: torch.frac(x),
        lambda x: torch.isposinf(x),
        lambda x: torch.isfinite(x),
        lambda x: torch.sgn(x),
        lambda x: torch.angle(x),
    ],
    ids=[
        "round",
        "round1",
        "round-1",
        "sign",
        "signbit",
        "nan_to_num",
        "nan_to_num_args",
        "clamp",
        "clamp_min_gt_max",
        "frac",
        "isposinf",
        "isfinite",
        "sgn",
        "angle",
    ],
)
def test_unary_special_values(fn):
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, -0.0, 0.0, 14.0, -15.0, float("inf"), -float("inf"), float("nan")])
    _check(fn, x)


@pytest.mark.parametrize(
    "fn",
    [
        torch.round,
        torch.floor,
        torch.ceil,
        torch.trunc,
        torch.sign,
        torch.abs,
        torch.isnan,
        torch.isinf,
        torch.signbit,
        torch.square,
        torch.angle,
        torch.sqrt,
        torch.sigmoid,
    ],
)
def test_unary_on_integers(fn):
    _check(fn, torch.tensor([-3, 0, 4]))


def test_min_max_nan_and_fmax():
    a = torch.tensor([1.0, float("nan"), 3.0, float("nan")])
    b = torch.tensor([2.0, 1.0, float("nan"), float("nan")])
    for fn in (torch.maximum, torch.minimum, torch.fmax, torch.fmin):
        _check(fn, a, b)


def test_gcd_lcm_heaviside():
    a, b = torch.tensor([12, -18, 0, 7]), torch.tensor([-8, 12, 5, 0])
    _check(torch.gcd, a, b)
    _check(torch.lcm, a, b)
    x = torch.tensor([-1.5, 0.0, 2.0])
    _check(lambda t: torch.heaviside(t, torch.tensor([0.5])), x)


def test_clamp_gradient_at_bounds_goes_to_input():
    x = torch.tensor([-1.0, 0.0, 0.5, 1.0, 2.0], requires_grad=True)
    torch.clamp(x, 0.0, 1.0).sum().backward()
    g = jax.grad(lambda a: jaxtorch.call_torch(lambda t: torch.clamp(t, 0.0, 1.0).sum(), a))(
        jnp.array([-1.0, 0.0, 0.5, 1.0, 2.0])
    )
    np.testing.assert_array_equal(np.asarray(g), x.grad.numpy())


def test_sinc_xlogy_gradients_finite_at_zero():
    for fn in (
        lambda t: torch.sinc(t).sum(),
        lambda t: torch.xlogy(t, torch.tensor([0.0, 0.5, 2.0])).sum(),
        lambda t: torch.special.xlog1py(t, torch.tensor([-1.0, 0.5, 2.0])).sum(),
    ):
        x = torch.tensor([0.0, 0.5, 2.0], requires_grad=True)
        fn(x).backward()
        g = jax.grad(lambda a: jaxtorch.call_torch(fn, a))(jnp.array([0.0, 0.5, 2.0]))
        np.testing.assert_allclose(np.asarray(g), x.grad.numpy(), rtol=1e-5, atol=1e-6, equal_nan=True)


class TestThroughInterpreter:
    """In-place and `out=` overloads are derived from the functional lowerings."""

    @pytest.fixture(autouse=True)
    def _enabled(self):
        jaxtorch.enable_globally()
        yield
        jaxtorch.disable_globally()

    def test_inplace_add(self):
        x = torch.tensor([1.0, 2.0, 3.0], device="jax")
        y = x.add_(1)
        assert y is x
        torch.testing.assert_close(x.cpu(), torch.tensor([2.0, 3.0, 4.0]))

    def test_inplace_int_keeps_dtype(self):
        x = torch.tensor([7, -7], device="jax")
        x.floor_divide_(2)
        assert x.dtype == torch.int64
        torch.testing.assert_close(x.cpu(), torch.tensor([3, -4]))
        x.remainder_(3)
        torch.testing.assert_close(x.cpu(), torch.tensor([0, 2]))

    def test_inplace_on_view_writes_back(self):
        x = torch.zeros(2, 3, device="jax")
        x[0].mul_(0).add_(5).clamp_(max=4.0)
        x[:, 1].sub_(1)
        ref = torch.zeros(2, 3)
        ref[0].mul_(0).add_(5).clamp_(max=4.0)
        ref[:, 1].sub_(1)
        torch.testing.assert_close(x.cpu(), ref)

    def test_out_argument(self):
        a = torch.tensor([1.0, 2.0], device="jax")
        b = torch.tensor([3.0, 4.0], device="jax")
        c = torch.empty(2, device="jax")
        r = torch.add(a, b, out=c)
        assert r is c
        torch.testing.assert_close(c.cpu(), torch.tensor([4.0, 6.0]))
        torch.mul(a, 3, out=c)
        torch.testing.assert_close(c.cpu(), torch.tensor([3.0, 6.0]))
        d = torch.empty(2, dtype=torch.bool, device="jax")
        torch.gt(a, 1.5, out=d)
        torch.testing.assert_close(d.cpu(), torch.tensor([False, True]))

    def test_inplace_comparison_and_logical(self):
        x = torch.tensor([1.0, -2.0, 3.0], device="jax")
        x.gt_(0)
        assert x.dtype == torch.float32
        torch.testing.assert_close(x.cpu(), torch.tensor([1.0, 0.0, 1.0]))
        b = torch.tensor([True, False], device="jax")
        b.logical_not_()
        torch.testing.assert_close(b.cpu(), torch.tensor([False, True]))

    def test_inplace_unary_and_pow(self):
        x = torch.tensor([1.0, 4.0], device="jax")
        x.sqrt_().pow_(3).neg_()
        torch.testing.assert_close(x.cpu(), torch.tensor([-1.0, -8.0]))


# In-place ops whose result type cannot be cast back (torch: "result type Float can't be cast to
# the desired output type Long") raised nowhere on the jax device: the write rounded silently.
_CAST_REFUSED = "can't be cast to the desired output type"
# op name -> why the jax device still writes where CPU torch refuses (checked both ways)
_CAST_NOT_CHECKED = {
    "ldexp": "ldexp_ runs torch's decomposition, whose mul_ result is already cast",
}


def _in_place_cases():
    from torch.testing._internal.common_methods_invocations import op_db

    for op in op_db:
        if op.inplace_variant is not None:
            yield pytest.param(op, id=f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name)


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
def test_in_place_result_type_rule_matches_cpu(dtype):
    """Over every OpInfo op with an in-place variant (first sample, integer and bool inputs):
    the jax device refuses exactly when CPU torch refuses the cast (`int_tensor.add_(0.5)`)."""
    jaxtorch.enable_globally()
    mismatches = []
    for param in _in_place_cases():
        (op,) = param.values
        try:
            samples = [s for s in op.sample_inputs("cpu", dtype) if isinstance(s.input, torch.Tensor)][:1]
        except Exception:  # (no samples for this dtype)
            continue
        for s in samples:

            def run(device):
                """True: refused the cast; False: ran; None: another error (not this rule)."""

                def move(v):
                    if isinstance(v, torch.Tensor):
                        return v.to(device)
                    return type(v)(move(w) for w in v) if isinstance(v, (list, tuple)) else v

                try:
                    op.inplace_variant(
                        s.input.clone().to(device),
                        *[move(a) for a in s.args],
                        **{k: move(v) for k, v in s.kwargs.items()},
                    )
                except Exception as e:
                    return True if _CAST_REFUSED in str(e) else None
                return False

            cpu = run("cpu")
            if cpu is None:  # torch refuses this sample for another reason
                continue
            jx = run("jax")
            if cpu != jx and op.name not in _CAST_NOT_CHECKED:
                mismatches.append((op.name, "cpu refuses" if cpu else "jax refuses"))
            if op.name in _CAST_NOT_CHECKED and cpu and jx:
                mismatches.append((op.name, "listed in _CAST_NOT_CHECKED but now refused: remove it"))
    assert not mismatches, mismatches


def test_in_place_cast_refusals_name_the_op_and_foreach_too():
    jaxtorch.enable_globally()
    x = torch.tensor([1, 2], device="jax")
    with pytest.raises(RuntimeError, match=r"add_.*torch.float32 can't be cast.*torch.int64"):
        x.add_(0.5)
    with pytest.raises(RuntimeError, match=r"_foreach_add_.*can't be cast"):
        torch._foreach_add_([x], 0.5)
    assert x.cpu().tolist() == [1, 2]  # nothing written
    x.mul_(3).gt_(4)  # allowed casts still write, as in torch
    x.fill_(2.7)
    assert x.cpu().tolist() == [2, 2]


def test_out_cast_refusals_follow_torch():
    """A pointwise op's `out=` tensor follows the in-place rule: `torch.add(float_t, 0.5,
    out=int_t)` refuses as CPU torch does (it truncated silently); widening casts still write."""
    jaxtorch.enable_globally()
    x = torch.tensor([1.5, 2.5], device="jax")
    out = torch.zeros(2, dtype=torch.int64, device="jax")
    with pytest.raises(RuntimeError, match=r"add\.out.*can't be cast to the desired output type"):
        torch.add(x, 0.5, out=out)
    with pytest.raises(RuntimeError, match=r"sqrt\.out.*can't be cast"):
        torch.sqrt(x, out=out)
    with pytest.raises(RuntimeError, match=r"can't be cast"):
        torch.add(x, 1, out=torch.zeros(2, dtype=torch.bool, device="jax"))
    assert out.cpu().tolist() == [0, 0]  # nothing written
    i = torch.tensor([1, 2], device="jax")
    f = torch.zeros(2, device="jax")
    torch.add(i, 1, out=f)  # integer result into a float out: allowed, as in torch
    assert f.cpu().tolist() == [2.0, 3.0]
    torch.eq(i, i, out=out)  # bool into int64: allowed
    assert out.cpu().tolist() == [1, 1]
