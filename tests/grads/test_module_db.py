"""One gradient, whichever path, over PyTorch's ModuleInfo database (issue 29, item 6).

For every `module_db` entry with trainable parameters, one float32 sample in eval mode
(no dropout or other train-mode randomness; `tests/modules/harness.py` builds it): the
parameters' gradients of `sum(out * cotangent)` over the float outputs, with a fixed random
cotangent, agree between CPU PyTorch, torch-first eager on the `jax` device and `extract` +
`jax.grad` (`tests/grads/_paths.py`). Two-way expected failures as in
`test_semantics_models.py` (names are the entries', `nn.Linear`). Composite and lazy entries
whose parts are tested here are left out (`SKIP`), to keep the file short.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.utils._pytree as pytree

from tests.grads import _paths
from tests.grads._expected import check
from tests.modules import harness

PATHS = ("eager", "extract")
RTOL = 1e-5
# left out to keep the file short (about a minute of CPU): each is made of entries tested here
SKIP = {
    "nn.Transformer": "an encoder and a decoder of the TransformerEncoderLayer / TransformerDecoderLayer tested here",
    "nn.TransformerEncoder": "a stack of the TransformerEncoderLayer tested here",
    **{
        f"nn.Lazy{m}": f"after its first forward it is the nn.{m} tested here"
        for m in ("Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d")
    },
}


class Call(torch.nn.Module):
    """A ModuleInfo sample as a module of its tensor inputs: non-tensor arguments and keyword
    structure are fixed, the entry's module is `self.module` (parameter names `module.*`)."""

    def __init__(self, module, leaves, spec, pos):
        super().__init__()
        self.module = module
        self._call = (leaves, spec, pos)

    def forward(self, *tensors):
        leaves, spec, pos = self._call
        args, kwargs = harness._unflatten_args(leaves, spec, pos, tensors)
        return self.module(*args, **kwargs)


@functools.cache
def _cases() -> dict:
    """name -> (module, inputs, loss, reference gradients) for every entry with trainable
    parameters in its first eval sample that has them."""
    cases = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, info in harness.entries().items():
            if name in SKIP:
                continue
            for sample in harness.samples(info, training=False):
                module = harness._build(info, sample, training=False)
                if not _paths.trainable(module):
                    continue
                leaves, spec, pos = harness._split(sample)
                model = Call(module, leaves, spec, pos).eval()
                inputs = tuple(leaves[p].detach().clone() for p in pos)
                cases[name] = (model, inputs)
                break
    return cases


def _loss_for(model, inputs):
    """`sum(out * cotangent)` over the float outputs, the cotangents drawn once from a fixed seed."""
    out = pytree.tree_leaves(_paths.fresh(model)(*inputs))
    gen = torch.Generator().manual_seed(1)
    cots = [torch.randn(o.shape, generator=gen) if o.dtype.is_floating_point else None for o in out]

    def loss(out):
        leaves = pytree.tree_leaves(out)
        return sum((o * c.to(o.device)).sum() for o, c in zip(leaves, cots) if c is not None)

    return loss


@functools.cache
def _reference(name: str):
    model, inputs = _cases()[name]
    loss = _loss_for(model, inputs)
    return loss, _paths.grads_cpu(model, inputs, loss)


def _names():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return list(_cases())


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", _names())
def test_module_db(name, path):
    model, inputs = _cases()[name]

    def run():
        loss, ref = _reference(name)
        _paths.compare(ref, _paths.GRADS[path](model, inputs, loss), rtol=RTOL)

    check(path, name, run)
