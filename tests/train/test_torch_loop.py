"""PyTorch-first training: an unchanged torch loop on the `jax` device matches the CPU run."""

import copy

import numpy as np
import pytest
import torch

import jaxtorch
import jaxtorch.xla as xm

from ._models import MLP, BNNet


@pytest.fixture
def jax_env():
    jaxtorch.enable_globally()
    yield
    jaxtorch.disable_globally()


def _loop(model, device, opt_name, steps=5):
    """The standard loop: zero_grad, forward, backward, clip_grad_norm_, step, scheduler."""
    model = model.to(device)
    opt = (
        torch.optim.Adam(model.parameters(), lr=1e-2)
        if opt_name == "adam"
        else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    )
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    g = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
        x, y = x.to(device), y.to(device)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
        xm.optimizer_step(opt) if device != "cpu" else opt.step()
        sched.step()
        losses.append(loss.item())
    return losses, {k: v.detach().cpu() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("opt_name", ["adam", "sgd"])
def test_torch_loop_on_jax_matches_cpu(jax_env, opt_name):
    model = MLP()
    cpu_model = copy.deepcopy(model)
    losses, state = _loop(model, "jax", opt_name)
    cpu_losses, cpu_state = _loop(cpu_model, "cpu", opt_name)
    np.testing.assert_allclose(losses, cpu_losses, rtol=1e-4, atol=1e-5)
    for k in cpu_state:
        np.testing.assert_allclose(state[k].numpy(), cpu_state[k].numpy(), atol=1e-4, err_msg=k)
    assert xm.is_xla_tensor(next(model.parameters())) and not xm.is_xla_tensor(next(cpu_model.parameters()))


def test_torch_loop_batchnorm_buffers(jax_env):
    model = BNNet().train()
    cpu_model = copy.deepcopy(model)
    model.to("jax")
    opt, cpu_opt = torch.optim.Adam(model.parameters(), lr=1e-2), torch.optim.Adam(cpu_model.parameters(), lr=1e-2)
    for _ in range(3):
        x, y = torch.randn(16, 6), torch.randn(16, 2)
        for m, o, dev in ((model, opt, "jax"), (cpu_model, cpu_opt, "cpu")):
            o.zero_grad()
            torch.nn.functional.mse_loss(m(x.to(dev)), y.to(dev)).backward()
            o.step()
    for k, v in cpu_model.state_dict().items():
        np.testing.assert_allclose(model.state_dict()[k].cpu().numpy(), v.numpy(), atol=1e-4, err_msg=k)


def test_xla_helpers(jax_env, monkeypatch, capsys):
    assert xm.xla_device() == torch.device("jax") and xm.xla_device(0) == torch.device("jax:0")
    assert xm.get_ordinal() == 0 and xm.world_size() == 1 and xm.is_master_ordinal()
    xm.master_print("hello from 0")
    assert capsys.readouterr().out == "hello from 0\n"
    t = xm.send_to_device({"a": torch.ones(2), "b": [torch.zeros(1, dtype=torch.int64)]})
    assert xm.is_xla_tensor(t["a"]) and t["a"].dtype == torch.float32 and t["b"][0].dtype == torch.int64
    assert not xm.is_xla_tensor(torch.ones(1)) and not xm.is_xla_tensor(3)

    monkeypatch.setenv("JAXTORCH_USE_BF16", "1")
    assert xm.use_bf16()
    m = xm.send_to_device(MLP())
    assert m.fc1.weight.dtype == torch.bfloat16 and xm.is_xla_tensor(m.fc1.weight)
    x = xm.send_to_device(torch.randn(4, 8))
    assert x.dtype == torch.bfloat16
    out = m(x)
    assert out.dtype == torch.bfloat16
    ref = MLP()
    ref.load_state_dict({k: v.cpu().float() for k, v in m.state_dict().items()})
    np.testing.assert_allclose(out.detach().float().cpu().numpy(), ref(x.cpu().float()).detach().numpy(), atol=5e-2)
    monkeypatch.setenv("JAXTORCH_USE_BF16", "0")
    assert not xm.use_bf16()
