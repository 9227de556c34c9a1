"""The tensor subclass and the PyTorch-first path: device "jax", constructors, autograd, views."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxtorch
from jaxtorch import JaxTensor


def test_reports_torch_metadata(env):
    x = torch.zeros(2, 3, device="jax")
    assert isinstance(x, JaxTensor)
    assert x.shape == (2, 3) and x.dtype == torch.float32
    assert x.device.type == "jax"
    assert isinstance(x.jax(), jax.Array)


def test_constructors_on_jax_device(env):
    assert torch.ones(3, device="jax").cpu().tolist() == [1.0, 1.0, 1.0]
    assert torch.full((2,), 7, device="jax").cpu().tolist() == [7, 7]
    assert torch.arange(4, device="jax").tolist() == [0, 1, 2, 3]
    assert torch.tensor([1.5, 2.5], device="jax").tolist() == [1.5, 2.5]
    r = torch.randn(3, 4, device="jax")
    assert r.shape == (3, 4) and r.dtype == torch.float32


def test_to_and_back(env):
    t = torch.arange(6.0).reshape(2, 3)
    j = t.to("jax")
    assert isinstance(j, JaxTensor)
    back = j.cpu()
    assert type(back) is torch.Tensor and torch.equal(back, t)
    np.testing.assert_array_equal(j.numpy(), t.numpy())
    assert j[1, 2].item() == 5.0
    assert j.tolist() == t.tolist()


def test_module_to_jax_and_dtype_changes(env):
    m = torch.nn.Linear(3, 2)
    w = m.weight.detach().clone()
    m.to("jax")
    assert isinstance(m.weight, JaxTensor) and isinstance(m.weight, torch.nn.Parameter)
    np.testing.assert_array_equal(m.weight.cpu().detach().numpy(), w.numpy())
    m.to(torch.bfloat16)  # goes through `param.data = ...` on jax tensors
    assert m.weight.dtype == torch.bfloat16 and m.weight.jax().dtype == jnp.bfloat16
    np.testing.assert_allclose(m.weight.float().cpu().detach().numpy(), w.numpy(), rtol=1e-2)


def test_readme_example_two_line_change():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(4 * 26 * 26, 10)
    )
    x = torch.randn(3, 3, 28, 28)
    ref = model(x)
    with jaxtorch.default_env():
        m = model.to("jax")
        res = m(x.to("jax"))
        assert isinstance(res, JaxTensor)
        np.testing.assert_allclose(res.cpu().detach().numpy(), ref.detach().numpy(), rtol=1e-5, atol=1e-5)


def test_backward_fills_grad_with_jax_tensors(env):
    torch.manual_seed(0)
    m_cpu = torch.nn.Linear(4, 3)
    x_cpu = torch.randn(5, 4)
    m_cpu(x_cpu).pow(2).mean().backward()
    m = torch.nn.Linear(4, 3)
    m.load_state_dict(m_cpu.state_dict())
    m.to("jax")
    loss = m(x_cpu.to("jax")).pow(2).mean()
    assert loss.requires_grad
    loss.backward()
    assert isinstance(m.weight.grad, JaxTensor)
    np.testing.assert_allclose(m.weight.grad.cpu().numpy(), m_cpu.weight.grad.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m.bias.grad.cpu().numpy(), m_cpu.bias.grad.numpy(), rtol=1e-5, atol=1e-6)


def test_type_promotion_follows_torch(env):
    a = torch.tensor([5, -7], device="jax")
    b = torch.tensor([2, 2], device="jax")
    assert (a + b).dtype == torch.int64
    assert (a / b).dtype == torch.float32
    np.testing.assert_allclose((a / b).cpu().numpy(), [2.5, -3.5])
    assert (a // b).tolist() == [2, -4]  # floor division, as torch
    assert (a % b).tolist() == [1, 1]  # remainder has the divisor's sign
    t = torch.tensor([True, False], device="jax")
    assert (t | t).dtype == torch.bool
    assert (a * 1.5).dtype == torch.float32


def test_view_mutation_updates_base_and_back(env):
    x = torch.zeros(2, 3, device="jax")
    v = x.view(6)
    v[0] = 5.0
    assert x[0, 0].item() == 5.0
    x.add_(1)
    assert v.tolist() == [6.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    row = x[1]
    row.mul_(10)
    assert x.tolist() == [[6.0, 1.0, 1.0], [10.0, 10.0, 10.0]]
    x[0, 0] = -1.0
    assert x[0, 0].item() == -1.0


_OVERLAP = "more than one element of the written-to tensor refers to a single memory location"


def test_write_into_overlapping_view_refused_as_torch(env):
    """A destination whose elements share memory (an `expand` of a size-1 dim, an `as_strided`
    with stride 0) is refused by the ops torch refuses (it wrote every row into one base row);
    fills and a broadcast-free view of it still write, as in torch."""
    x = torch.zeros(1, 4, device="jax")
    with pytest.raises(RuntimeError, match=_OVERLAP):
        x.expand(3, 4).add_(1)
    with pytest.raises(RuntimeError, match=_OVERLAP):
        x[0, :1].expand(3).copy_(torch.tensor([1.0, 2.0, 3.0], device="jax"))
    with pytest.raises(RuntimeError, match=_OVERLAP):
        torch.mul(torch.ones(3, 4, device="jax"), 2, out=x.expand(3, 4))
    with pytest.raises(RuntimeError, match=_OVERLAP):
        x.as_strided((3, 4), (0, 1)).normal_()
    with pytest.raises(RuntimeError, match=_OVERLAP):
        torch._foreach_add_([x.expand(2, 4).t()], 1.0)
    assert x.tolist() == [[0.0] * 4]  # nothing written
    x.expand(1, 4).add_(1)  # size-1 dims and views without the broadcast dim write
    x.expand(3, 4)[1].add_(1)
    x.expand(3, 4)[:1].mul_(2)
    assert x.tolist() == [[4.0] * 4]
    x.expand(3, 4).fill_(7.0)
    assert x.tolist() == [[7.0] * 4]


def test_partial_write_into_overlapping_view_refused_naming_clone(env):
    """torch writes `index_put_`/`masked_fill_` into an expanded tensor (with a deprecation warning)
    element by element into the shared memory (`x.expand(3, 4).index_put_((tensor([0]),), 5.0)` sets
    every row), and computes an `as_strided` with overlapping strides in memory order: a jax view, a
    function of its base, cannot reproduce either, so jaxtorch refuses rather than write the last alias."""
    x = torch.zeros(1, 4, device="jax")
    mask = torch.zeros(3, 4, dtype=torch.bool, device="jax")
    mask[0, 0] = True
    for write in (
        lambda: x.expand(3, 4).index_put_((torch.tensor([0], device="jax"),), torch.tensor(5.0, device="jax")),
        lambda: x.expand(3, 4).masked_fill_(mask, 3.0),
        lambda: x.view(4).as_strided((3, 2), (1, 1)).add_(1),
        lambda: x.view(4).as_strided((3, 2), (1, 1)).copy_(torch.ones(3, 2, device="jax")),
    ):
        with pytest.raises(jaxtorch.JaxtorchError, match=r"clone\(\)"):
            write()
    assert x.tolist() == [[0.0] * 4]  # nothing written
    x.view(4).as_strided((2, 2), (2, 1)).add_(1)  # no aliasing: written as torch writes it
    assert x.tolist() == [[1.0] * 4]


def test_write_into_overlapping_view_refused_under_jit():
    def f(a):
        a.expand(3, 4).add_(1)
        return a

    with pytest.raises(RuntimeError, match=_OVERLAP):
        jax.jit(lambda a: jaxtorch.call_torch(f, a))(jnp.zeros((1, 4)))


def test_partial_write_into_overlapping_view_refused_under_jit():
    def f(a):
        a.expand(3, 4).index_put_((torch.tensor([0]),), torch.tensor(5.0))
        return a

    with pytest.raises(jaxtorch.JaxtorchError, match=r"clone\(\)"):
        jax.jit(lambda a: jaxtorch.call_torch(f, a))(jnp.zeros((1, 4)))


def test_setitem_and_inplace_under_jit():
    def f(a):
        x = a.clone()
        x[0, 0] = 7.0
        x[:, 1] += 1
        y = x.t()
        y[2, 1] = 3.0
        return x

    a = jnp.zeros((2, 3))
    out = jax.jit(lambda a: jaxtorch.call_torch(f, a))(a)
    ref = f(torch.zeros(2, 3))
    np.testing.assert_array_equal(np.asarray(out), ref.numpy())


def test_apply_jax(env):
    x = torch.ones(3, device="jax")
    y = x.apply_jax(jnp.sin)
    np.testing.assert_allclose(y.cpu().numpy(), np.sin(np.ones(3)), rtol=1e-6)
    x.apply_jax_(lambda a: a * 3)
    assert x.tolist() == [3.0, 3.0, 3.0]


def test_repr_shows_device_and_dtype(env):
    r = repr(torch.ones(2, device="jax"))
    assert "device='jax:0'" in r and "float32" in r


def test_disable_globally_turns_modes_off():
    jaxtorch.enable_globally()
    try:
        assert torch._C._len_torch_dispatch_stack() >= 1
    finally:
        jaxtorch.disable_globally()
    assert torch._C._len_torch_dispatch_stack() == 0


def test_format_of_a_0d_tensor_is_its_items_as_torch(env):
    """Issue 30 item 13: `f"{loss:.3f}"` (torch formats a 0-d tensor's `.item()`)."""
    for cpu in (torch.tensor(1.23456), torch.tensor(7), torch.tensor(True), torch.tensor(-0.5)):
        t = cpu.to("jax")
        for spec in ("", ".3f", ">10", "e") if cpu.dtype.is_floating_point else ("", ">4"):
            assert format(t, spec) == format(cpu, spec), (cpu, spec)
    assert f"{torch.tensor(0.25).to('jax'):.2%}" == "25.00%"


def test_format_with_a_spec_of_a_non_0d_tensor_raises_as_torch(env):
    import pytest

    with pytest.raises(TypeError, match="unsupported format string"):
        format(torch.ones(2), ".3f")
    with pytest.raises(TypeError, match="unsupported format string"):
        format(torch.ones(2).to("jax"), ".3f")
