"""CPU index tensors for a tensor on the jax device, as torch allows them for CUDA tensors.

`nn.init.sparse_` writes `tensor[torch.randperm(rows)[:k], col] = 0`: CPU indices into the
tensor being initialised. Torch moves CPU indices of `index`/`index_put` to the indexed
tensor's device; jaxtorch raised `DeviceMismatchError`. Each check is against CPU torch.
"""

import math

import pytest
import torch

import jaxtorch


def _indexing_cases():
    i = torch.tensor([2, 0])
    mask = torch.tensor([True, False, True])
    return {
        "gather_rows": lambda x: x[i],
        "rows_and_column": lambda x: x[i, 1],
        "bool_mask": lambda x: x[mask],
        "setitem_scalar": lambda x: x.__setitem__((i, 1), 9.0) or x,
        "setitem_mask": lambda x: x.__setitem__(mask, 0.5) or x,
        "index_put_": lambda x: x.index_put_((i,), torch.tensor(5.0)),
        "index_put_accumulate": lambda x: x.index_put((i, torch.tensor([1, 1])), torch.tensor(2.0), accumulate=True),
    }


@pytest.mark.parametrize("name", sorted(_indexing_cases()))
def test_cpu_index_tensors_index_a_jax_tensor_as_torch(name):
    f = _indexing_cases()[name]
    want = f(torch.arange(6.0).reshape(3, 2))
    got = f(torch.arange(6.0).reshape(3, 2).to("jax"))
    assert got.device.type == "jax" and got.dtype == want.dtype
    assert torch.equal(got.cpu(), want)


def test_cpu_index_in_lazy_mode():
    want = torch.arange(6.0).reshape(3, 2)[torch.tensor([1, 1])] * 2
    with jaxtorch.lazy():
        got = torch.arange(6.0, device="jax").reshape(3, 2)[torch.tensor([1, 1])] * 2
    assert torch.equal(got.cpu(), want)


def test_a_cpu_tensor_outside_the_index_list_is_still_refused():
    x = torch.ones(3, device="jax")
    with pytest.raises(jaxtorch.DeviceMismatchError, match="jax:0 and cpu"):
        torch.index_select(x, 0, torch.tensor([0, 1]))  # torch refuses this for CUDA too
    with pytest.raises(jaxtorch.DeviceMismatchError, match="jax:0 and cpu"):
        x + torch.ones(3)


@pytest.mark.parametrize("sparsity", [0.1, 0.5, 0.9])
def test_sparse_init_on_jax_matches_cpu_structurally(sparsity):
    rows, cols, std = 400, 20, 1.0
    want = torch.nn.init.sparse_(torch.empty(rows, cols), sparsity, std=std)
    got = torch.nn.init.sparse_(torch.empty(rows, cols, device="jax"), sparsity, std=std)
    assert got.device.type == "jax" and got.shape == want.shape and got.dtype == want.dtype
    got = got.cpu()
    zeros_per_column = (got == 0).sum(0).tolist()
    assert zeros_per_column == (want == 0).sum(0).tolist() == [math.ceil(sparsity * rows)] * cols
    assert abs(got[got != 0].std().item() - want[want != 0].std().item()) < 0.1
    assert abs(got[got != 0].mean().item()) < 0.1


def test_sparse_init_with_a_jax_generator_is_reproducible():
    g = torch.Generator(device="jax")
    draws = []
    for _ in range(2):
        g.manual_seed(3)
        torch.manual_seed(3)  # (sparse_ draws its zero positions from the global CPU generator)
        draws.append(torch.nn.init.sparse_(torch.empty(8, 5, device="jax"), 0.5, generator=g).cpu())
    assert torch.equal(draws[0], draws[1])
    assert ((draws[0] == 0).sum(0) == 4).all()
