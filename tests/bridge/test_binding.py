"""The one module-state mechanism (`state/_binding.Binding`): snapshot, bind by identity, restore."""

from __future__ import annotations

import jax.numpy as jnp
import pytest
import torch

import jaxtorch
from jaxtorch import JaxTensor, StateWriteError
from jaxtorch.bridge.state._binding import Binding, bound


class _Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(5, 3)
        self.head = torch.nn.Linear(3, 5, bias=False)
        self.head.weight = self.emb.weight
        self.shared = torch.nn.Linear(3, 3)
        self.alias = self.shared  # one submodule under two names


def test_bind_reaches_every_slot_holding_the_tensor_and_restore_puts_back_the_same_objects():
    m = _Tied()
    weight, shared = m.emb.weight, m.shared.weight
    new = JaxTensor(jnp.zeros((5, 3)))
    with Binding([m]) as b:
        b.bind(m, {"emb.weight": new})
        assert m.emb.weight is new and m.head.weight is new
        m.cache = torch.ones(1)  # an attribute a forward adds
        assert b.rebound() == []
    assert m.emb.weight is weight and m.head.weight is weight and m.alias.weight is shared
    assert not hasattr(m, "cache")


def test_bind_refuses_names_the_module_does_not_have_and_leaves_it_as_found():
    m = _Tied()
    with pytest.raises(KeyError, match="not parameters or buffers"):
        with bound(m, {"head.weight": JaxTensor(jnp.zeros((5, 3)))}):  # tied: named emb.weight
            pass
    assert m.head.weight is m.emb.weight


def test_bind_data_is_restored_and_carry_keeps_what_the_run_left():
    t = JaxTensor(jnp.ones(3))
    view = t[1:]
    with Binding(tensors=[view]) as b:
        assert b.roots == [t]
        b.bind_data([jnp.zeros(3)])
        assert float(view.sum()) == 0.0
    assert float(view.sum()) == 2.0
    b = Binding(tensors=[t])
    b.bind_data([jnp.full(3, 2.0)])
    b.carry(lambda root, value: value * 2)
    assert t.jax().tolist() == [4.0, 4.0, 4.0]


class _Ema(torch.nn.Module):
    def __init__(self, shape=(3,)):
        super().__init__()
        self.register_buffer("avg", torch.zeros(3))
        self.shape = shape

    def forward(self, x):
        self.avg = self.avg * 0.5 + x.reshape(self.shape)  # a new tensor, not an in-place write
        return self.avg.sum()


def test_a_compiled_forward_assigning_a_buffer_writes_it_as_eager_torch_does():
    eager, m = _Ema(), _Ema().to("jax")
    fast = jaxtorch.compile(m)
    for _ in range(2):
        x = torch.arange(3.0)
        expected = eager(x)
        assert float(fast(x.to("jax"))) == float(expected)
    assert m.avg.cpu().tolist() == eager.avg.tolist()
    assert fast.compilations == 1


def test_a_compiled_forward_assigning_a_buffer_of_another_shape_raises_and_restores():
    m = _Ema(shape=(1, 3)).to("jax")
    avg = m.avg
    with pytest.raises(StateWriteError, match="replaces `avg`"):
        jaxtorch.compile(m)(torch.arange(3.0).to("jax"))
    assert m.avg is avg and m.avg.cpu().tolist() == [0.0, 0.0, 0.0]
