"""call_torch and extract's fn from several threads at once; the environment stays per thread."""

import threading
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
import torch

import jaxtorch


def test_concurrent_extract_and_call_torch():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    params, fn = jaxtorch.extract(model)
    xs = [jax.random.normal(jax.random.key(i), (3, 8)) for i in range(16)]
    refs = [model(jaxtorch.to_torch(x)).detach().numpy() for x in xs]

    def work(i):
        p = jax.tree_util.tree_map(lambda a: a * (1 + (i % 3)), params)
        out = fn(p, xs[i])
        scaled = jaxtorch.call_torch(lambda t: t * i, xs[i])
        return i, np.asarray(out), np.asarray(scaled)

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(work, range(16)))
    for i, out, scaled in results:
        np.testing.assert_allclose(scaled, np.asarray(xs[i]) * i, rtol=1e-6)
        if i % 3 == 0:
            np.testing.assert_allclose(out, refs[i], rtol=1e-5, atol=1e-6)
    # the module itself was never left with swapped-in parameters
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())


def test_enable_globally_does_not_leak_into_other_threads():
    seen = {}
    jaxtorch.enable_globally()
    try:

        def other():
            seen["depth"] = torch._C._len_torch_dispatch_stack()

        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert torch._C._len_torch_dispatch_stack() >= 1
    finally:
        jaxtorch.disable_globally()
    assert seen["depth"] == 0
