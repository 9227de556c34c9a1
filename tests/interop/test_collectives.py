"""torch.distributed collectives as JAX collectives (issue 31, item 2).

In this process (one device): the refusals that need no mesh, and one-device maps. On 8
simulated devices (one subprocess, `_collectives_worker.py`): every collective against NumPy,
broadcast bit for bit, the axes rules, the refusals, torch autograd through a collective and a
DDP-style training step against eager torch. In two processes over loopback
(`_collectives_multi.py`): the same training step across processes. And the example of
docs/api/collectives.md, run as written.
"""

from __future__ import annotations

import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxtorch
from jaxtorch.bridge.dispatch._routing import Kind, route

from ..train._procs import ROOT, cpu_env, free_port, spawn, wait_all

c10d = torch.ops._c10d_functional
GROUP = "jaxtorch-test-group"  # a group name no process group holds: the axes decide its size


def _one_device(fn, x, **kw):
    """`fn` (torch code) under jax.shard_map over a one-device mesh with the axis "d"."""
    mesh = Mesh(np.array(jax.devices()[:1]), ("d",))
    return jax.shard_map(lambda a: jaxtorch.call_torch(fn, a), mesh=mesh, in_specs=P("d"), out_specs=P("d"), **kw)(x)


def test_eight_devices_against_numpy_and_eager_torch():
    proc = subprocess.run(
        [sys.executable, "-m", "tests.interop._collectives_worker"],
        cwd=ROOT,
        env=cpu_env(8),
        capture_output=True,
        text=True,
        timeout=600,
    )
    checks = ["all_reduce", "gather_scatter_all_to_all", "broadcast_bit_exact", "axes", "refusals", "autograd", "ddp"]
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    for check in checks:
        assert f"OK {check}\n" in proc.stdout, (check, proc.stdout[-2000:])


def test_two_processes_over_loopback_train_like_eager_torch():
    port = free_port()
    procs = [spawn(["tests.interop._collectives_multi", str(i), str(port)], devices=2) for i in range(2)]
    outs = wait_all(procs)
    last = [re.search(r"OK multi (\d) (\S+)", out) for out in outs]
    assert [m.group(1) for m in last if m] == ["0", "1"], outs
    assert last[0].group(2) == last[1].group(2)  # both processes hold the same loss, bit for bit


def test_docs_example_runs_as_written():
    text = (ROOT / "docs" / "api" / "collectives.md").read_text()
    example = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    proc = subprocess.run(
        [sys.executable, "-c", example], cwd=ROOT, env=cpu_env(1), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "OK" in proc.stdout


def test_no_axis_outside_a_map():
    x = jnp.arange(4.0)
    for run in (jaxtorch.call_torch, lambda f, a: jax.jit(lambda b: jaxtorch.call_torch(f, b))(a)):
        with pytest.raises(jaxtorch.CollectiveError, match="no mesh axis is bound"):
            run(lambda t: funcol.all_reduce(t, "sum", GROUP), x)


def test_one_device_map_runs_each_collective():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 3)), jnp.float32)
    expected = np.asarray(x)
    for fn in (
        lambda t: funcol.all_reduce(t, "sum", GROUP),
        lambda t: funcol.all_reduce(t, "max", GROUP),
        lambda t: funcol.broadcast(t, 0, GROUP),
        lambda t: c10d.all_to_all_single(t, [], [], GROUP),
        lambda t: c10d.reduce_scatter_tensor(t, "avg", 1, GROUP),
        lambda t: c10d.wait_tensor(c10d.all_gather_into_tensor(t, 1, GROUP)),
        lambda t: c10d.all_reduce_(t.clone(), "sum", GROUP),  # the in-place overload writes back
    ):
        np.testing.assert_array_equal(np.asarray(_one_device(fn, x, check_vma=False)), expected)


def test_refusals_in_a_map():
    x = jnp.ones((4, 3))
    for op in ("band", "bor", "bxor", "premul_sum"):
        with pytest.raises(jaxtorch.CollectiveError, match=f"`{op}`"):
            _one_device(lambda t, op=op: c10d.all_reduce(t, op, GROUP), x)
    with pytest.raises(jaxtorch.CollectiveError, match="average of integers"):
        _one_device(lambda t: c10d.all_reduce(t.int(), "avg", GROUP), x)
    with pytest.raises(jaxtorch.CollectiveError, match="2 ranks"):
        _one_device(lambda t: c10d.all_gather_into_tensor(t, 2, GROUP), x, check_vma=False)
    with pytest.raises(jaxtorch.CollectiveError, match=r"equal blocks"):
        _one_device(lambda t: c10d.all_to_all_single(t, [3], [3], GROUP), x)
    with pytest.raises(jaxtorch.CollectiveError, match="source must be a rank"):
        _one_device(lambda t: c10d.broadcast(t, 1, GROUP), x)

    def unknown(t):
        with jaxtorch.collectives_axis("model"):
            return c10d.all_reduce(t, "sum", GROUP)

    with pytest.raises(jaxtorch.CollectiveError, match="binds no axis"):
        _one_device(unknown, x)


def test_collectives_axis_nests_and_restores():
    from jaxtorch.ops.collectives import _bound_axes

    assert _bound_axes("g") == (None, False)
    with jaxtorch.collectives_axis("data"):
        with jaxtorch.collectives_axis(("a", "b"), group="g"):
            assert _bound_axes("g") == (("a", "b"), True)
            assert _bound_axes("other") == (("data",), True)
        assert _bound_axes("g") == (("data",), True)
    assert _bound_axes("g") == (None, False)


def test_routes_and_backend():
    assert route(c10d.all_reduce.default).kind is Kind.FUNCTIONAL
    assert route(c10d.all_reduce_.default).kind is Kind.VIA_SIBLING  # in place: the functional op, written back
    assert route(c10d.all_gather_into_tensor_out.default).kind is Kind.MUTATING
    assert dist.Backend("jax") == "jax"  # `dist.init_process_group("jax", ...)` is known to torch


def test_jax_process_group_lifecycle():
    dist.init_process_group("jax", rank=1, world_size=2, store=dist.HashStore())
    try:
        assert (dist.get_backend(), dist.get_world_size(), dist.get_rank()) == ("jax", 2, 1)
        assert dist.barrier(async_op=True).wait()  # one SPMD program has no stragglers
        with pytest.raises(jaxtorch.CollectiveError, match="dist.reduce"):
            dist.reduce(torch.ones(2, device="jax"), dst=0)
    finally:
        dist.destroy_process_group()
    assert not dist.is_initialized()
