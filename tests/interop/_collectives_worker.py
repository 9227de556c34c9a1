"""Checks of torch.distributed collectives on 8 simulated devices; run by test_collectives.py in
one subprocess:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m tests.interop._collectives_worker

It prints "OK <check>" after each check. Every result is compared with NumPy or with eager torch on
the CPU. The DDP-style step here is also what `_collectives_multi.py` runs in two processes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxtorch

c10d = torch.ops._c10d_functional
SPLIT = P("d")


def spmd(fn, mesh, in_specs=SPLIT, out_specs=SPLIT, **kw):
    """`fn` (torch code) on each device's block, under jax.jit(jax.shard_map)."""
    body = jax.shard_map(
        lambda *a: jaxtorch.call_torch(fn, *a), mesh=mesh, in_specs=in_specs, out_specs=out_specs, **kw
    )
    return jax.jit(body)


def refuses(call, *words) -> str:
    """Assert `call()` raises a `CollectiveError` whose message holds each of `words`."""
    try:
        call()
    except jaxtorch.CollectiveError as e:
        for w in words:
            assert w in str(e), (w, str(e))
        return str(e)
    raise AssertionError(f"no CollectiveError for {words}")


def blocks(x: np.ndarray, n: int = 8) -> np.ndarray:
    """The global array as its `n` devices' blocks: `(n, rows / n, ...)`."""
    return x.reshape(n, x.shape[0] // n, *x.shape[1:])


def _inputs(rng, dtype, rows=32) -> np.ndarray:
    if np.issubdtype(dtype, np.integer):
        return rng.integers(-50, 50, size=(rows, 3)).astype(dtype)
    x = rng.standard_normal((rows, 3)).astype(dtype)
    x[0, 0], x[5, 1], x[9, 2] = np.inf, -0.0, -np.inf
    return x


# ---- the functional collectives and the in-place calls, against NumPy --------------------------
def check_all_reduce(mesh, world):
    rng = np.random.default_rng(0)
    ops = {"sum": np.sum, "avg": np.mean, "max": np.max, "min": np.min, "product": np.prod}
    inplace = {"sum": "SUM", "avg": "AVG", "max": "MAX", "min": "MIN", "product": "PRODUCT"}
    for dtype in (np.float32, np.int32):
        x = _inputs(rng, dtype)
        if dtype == np.float32:
            x[3, 0] = np.nan  # max and min propagate NaN, as torch's backends and NumPy do
        for op, ref in ops.items():
            if op == "avg" and dtype == np.int32:
                continue
            expected = ref(blocks(x), axis=0).astype(dtype)
            # a product is a gather, whose result JAX types as device-varying (as `lax.all_gather`'s)
            kw = {"check_vma": False} if op == "product" else {}
            got = np.asarray(spmd(lambda t, op=op: funcol.all_reduce(t, op, world), mesh, out_specs=P(), **kw)(x))

            def in_place(t, op=op):
                t = t.clone()
                work = dist.all_reduce(t, op=getattr(dist.ReduceOp, inplace[op]), async_op=True)
                assert work.wait() and work.is_completed()  # complete: a JAX collective's result is a value
                return t

            got_inplace = np.asarray(spmd(in_place, mesh, out_specs=P(), **kw)(x))
            for g in (got, got_inplace):
                assert g.dtype == dtype, (op, g.dtype)
                if op in ("sum", "avg", "product") and dtype == np.float32:
                    np.testing.assert_allclose(g, expected, rtol=1e-6, err_msg=op)
                else:
                    np.testing.assert_array_equal(g, expected, err_msg=op)
    # booleans stay booleans, as in torch: SUM and MAX are OR, MIN and PRODUCT are AND
    b = rng.integers(0, 2, size=(32, 3)).astype(bool)
    b[:, 0] = False
    for op, ref in {"sum": np.any, "max": np.any, "min": np.all, "product": np.all}.items():
        got = np.asarray(spmd(lambda t, op=op: funcol.all_reduce(t, op, world), mesh, out_specs=P())(b))
        assert got.dtype == np.bool_, (op, got.dtype)
        np.testing.assert_array_equal(got, ref(blocks(b), axis=0), err_msg=op)
    # coalesced: each tensor of the list
    x = _inputs(rng, np.float32)
    a, b = spmd(lambda t: funcol.all_reduce_coalesced([t, 2 * t], "sum", world), mesh, out_specs=[P(), P()])(x)
    np.testing.assert_allclose(np.asarray(b), 2 * np.asarray(a), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(a), blocks(x).sum(0), rtol=1e-6)
    print("OK all_reduce")


def check_gather_scatter_all_to_all(mesh, world):
    rng = np.random.default_rng(1)
    for dtype in (np.float32, np.int32):
        x = _inputs(rng, dtype, rows=64)  # 8 rows per device
        # all_gather: every device gets the blocks in rank order
        gathered = {"out_specs": P(), "check_vma": False}  # JAX types an all_gather's result device-varying
        got = spmd(lambda t: funcol.all_gather_single(t, 0, world), mesh, **gathered)(x)
        np.testing.assert_array_equal(np.asarray(got), x)

        def gather_inplace(t):
            out = torch.empty((8 * t.shape[0], *t.shape[1:]), dtype=t.dtype)
            dist.all_gather_into_tensor(out, t)
            return out

        np.testing.assert_array_equal(np.asarray(spmd(gather_inplace, mesh, **gathered)(x)), x)

        def gather_list(t):
            outs = [torch.empty_like(t) for _ in range(8)]
            dist.all_gather(outs, t)
            return torch.cat(outs)

        np.testing.assert_array_equal(np.asarray(spmd(gather_list, mesh, **gathered)(x)), x)
        got = spmd(lambda t: funcol.all_gather_single(t, 1, world), mesh, **gathered)(x)  # along dim 1
        np.testing.assert_array_equal(np.asarray(got), np.concatenate(list(blocks(x)), axis=1))
        # reduce_scatter: rank r gets block r of the sum of every device's input
        expected = blocks(x).reshape(8, 8, 1, 3).sum(0).reshape(8, 3)  # (rank, 1 row each)
        got = spmd(lambda t: funcol.reduce_scatter_single(t, "sum", 0, world), mesh)(x)
        maxed = spmd(lambda t: funcol.reduce_scatter_single(t, "max", 0, world), mesh)(x)

        def scatter_inplace(t):
            out = torch.empty((1, 3), dtype=t.dtype)
            dist.reduce_scatter_tensor(out, t, op=dist.ReduceOp.SUM)
            return out

        def scatter_list(t):
            out = torch.empty((1, 3), dtype=t.dtype)
            dist.reduce_scatter(out, list(t.split(1)), op=dist.ReduceOp.SUM)
            return out

        for g in (got, spmd(scatter_inplace, mesh)(x), spmd(scatter_list, mesh)(x)):
            np.testing.assert_allclose(np.asarray(g), expected, rtol=1e-6)
        np.testing.assert_array_equal(np.asarray(maxed), blocks(x).reshape(8, 8, 1, 3).max(0).reshape(8, 3))
        wide = np.tile(x, (1, 8))[:16]  # (2 rows per device, 24 columns): scatter along dim 1
        summed = blocks(wide).sum(0)
        got = spmd(lambda t: funcol.reduce_scatter_single(t, "sum", 1, world), mesh)(wide)
        expected = np.concatenate([summed[:, 3 * r : 3 * r + 3] for r in range(8)])
        np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-6)
        # all_to_all_single: block j of rank i goes to rank j, at block i
        expected = blocks(x).reshape(8, 8, 1, 3).transpose(1, 0, 2, 3).reshape(64, 3)
        got = spmd(lambda t: funcol.all_to_all_single(t, None, None, world), mesh)(x)

        def a2a_inplace(t):
            out = torch.empty_like(t)
            dist.all_to_all_single(out, t, output_split_sizes=[1] * 8, input_split_sizes=[1] * 8)
            return out

        def a2a_list(t):
            outs = [torch.empty_like(r) for r in t.split(1)]
            dist.all_to_all(outs, list(t.split(1)))
            return torch.cat(outs)

        for g in (got, spmd(a2a_inplace, mesh)(x), spmd(a2a_list, mesh)(x)):
            np.testing.assert_array_equal(np.asarray(g), expected)
    print("OK gather_scatter_all_to_all")


def check_broadcast_bit_exact(mesh, world):
    rng = np.random.default_rng(2)
    f = rng.standard_normal((16, 4)).astype(np.float32)
    bits = f.view(np.uint32)
    bits[2, :] = [0x7FC00001, 0xFFC0BEEF, 0x80000000, 0x00000001]  # NaN payloads, -0.0, a denormal
    f[3, :] = [np.inf, -np.inf, 0.0, -0.0]
    cases = {
        "float32": f,
        "bfloat16": torch.from_numpy(f).bfloat16().view(torch.int16).numpy().view(jnp.bfloat16),
        "int32": rng.integers(-(2**31), 2**31 - 1, size=(16, 4), dtype=np.int32),
        "bool": rng.integers(0, 2, size=(16, 4)).astype(bool),
        "uint8": rng.integers(0, 256, size=(16, 4), dtype=np.uint8),
    }
    for name, x in cases.items():
        for src in (0, 5, 7):
            expected = np.tile(blocks(x)[src], (8, 1))
            got = np.asarray(spmd(lambda t, s=src: funcol.broadcast(t, s, world), mesh)(x))

            def in_place(t, s=src):
                t = t.clone()
                dist.broadcast(t, src=s)
                return t

            for g in (got, np.asarray(spmd(in_place, mesh)(x))):
                assert g.dtype == x.dtype and g.tobytes() == expected.tobytes(), (name, src)
    print("OK broadcast_bit_exact")


def check_axes(mesh2d):
    """A (2, 4) mesh: by default the world is both axes row-major; `collectives_axis` names others."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((16, 3)).astype(np.float32)
    spec = P(("a", "b"))
    world = dist.group.WORLD
    gathered = {"in_specs": spec, "out_specs": P(), "check_vma": False}
    got = spmd(lambda t: funcol.all_gather_single(t, 0, world), mesh2d, **gathered)(x)
    np.testing.assert_array_equal(np.asarray(got), x)  # rank = row-major index over (a, b)
    tp = dist.new_group(ranks=[0, 1, 2, 3], backend="jax")  # this process is rank 0: a member

    def over_b(t):
        with jaxtorch.collectives_axis("b", group=tp):
            return funcol.all_reduce(t, "sum", tp)

    got = np.asarray(spmd(over_b, mesh2d, in_specs=spec, out_specs=P("a"))(x))
    np.testing.assert_allclose(got, x.reshape(2, 4, 2, 3).sum(1).reshape(4, 3), rtol=1e-6)

    def grad_over_b(t):  # the backward's all_reduce runs on torch's autograd thread, over "b" too
        t = t.detach().requires_grad_()
        with jaxtorch.collectives_axis("b", group=tp):
            funcol.all_reduce(t, "sum", tp).sum().backward()
        return t.grad

    got = np.asarray(spmd(grad_over_b, mesh2d, in_specs=spec, out_specs=spec, check_vma=False)(x))
    np.testing.assert_array_equal(got, np.full_like(x, 4.0))  # the 4 ranks' cotangents of ones, summed

    def over_a_then_b(t):
        with jaxtorch.collectives_axis(("b", "a")):
            return funcol.all_gather_single(t, 0, world)

    got = np.asarray(spmd(over_a_then_b, mesh2d, **gathered)(x))
    np.testing.assert_array_equal(got, x.reshape(2, 4, 2, 3).transpose(1, 0, 2, 3).reshape(16, 3))
    # a torch DeviceMesh over the same (2, 4) grid: each dimension's group bound to its JAX axis
    from torch.distributed.device_mesh import init_device_mesh

    dm = init_device_mesh("jax", (2, 4), mesh_dim_names=("a", "b"))

    def per_dimension(t):
        with jaxtorch.collectives_axis("a", group=dm.get_group("a")):
            with jaxtorch.collectives_axis("b", group=dm.get_group("b")):
                return funcol.all_reduce(t, "sum", dm["b"]) + 10 * funcol.all_reduce(t, "max", dm["a"])

    got = np.asarray(spmd(per_dimension, mesh2d, in_specs=spec, out_specs=spec)(x))
    grid = x.reshape(2, 4, 2, 3)
    expected = grid.sum(1, keepdims=True) + 10 * grid.max(0, keepdims=True)
    np.testing.assert_allclose(got, expected.reshape(16, 3), rtol=1e-6)
    # refusals: the world (8 ranks) over one axis of 4; an axis the map does not bind
    run = spmd(lambda t: funcol.all_reduce(t, "sum", world), mesh2d, in_specs=spec, out_specs=spec)
    with jaxtorch.collectives_axis("b"):
        refuses(lambda: run(x), "8 ranks", "('b',)", "4 devices")
    with jaxtorch.collectives_axis("nope"):
        refuses(lambda: run(x), "('nope',)", "binds no axis")
    # pmap binds its axis too
    y = jax.pmap(lambda t: jaxtorch.call_torch(lambda u: funcol.all_reduce(u, "sum", world), t), axis_name="i")(
        x.reshape(8, 2, 3)
    )
    np.testing.assert_allclose(np.asarray(y), np.broadcast_to(x.reshape(8, 2, 3).sum(0), (8, 2, 3)), rtol=1e-6)
    print("OK axes")


def check_refusals(mesh, world):
    x = np.ones((16, 3), np.float32)
    name = world.group_name
    for op in ("band", "bor", "bxor", "premul_sum"):
        refuses(lambda op=op: spmd(lambda t: c10d.all_reduce(t, op, name), mesh)(x), f"`{op}`", "SUM")
    refuses(lambda: spmd(lambda t: dist.all_reduce(t.clone(), op=dist.ReduceOp.BOR), mesh)(x), "`bor`")

    def uneven(t):
        out = torch.empty((3, 3))
        dist.all_to_all_single(out, t, output_split_sizes=[1, 1, 1, 0, 0, 0, 0, 0], input_split_sizes=[2] + [0] * 7)
        return out

    refuses(lambda: spmd(uneven, mesh)(x), "equal blocks", "[2, 0, 0")
    refuses(lambda: spmd(lambda t: c10d.all_gather_into_tensor(t, 4, name), mesh)(x), "4 ranks", "8 devices")
    t = torch.ones(4, device="jax")
    refuses(lambda: dist.all_reduce(t), "no mesh axis is bound")  # eagerly, outside shard_map
    refuses(lambda: jax.jit(lambda a: jaxtorch.call_torch(lambda u: funcol.all_reduce(u, "sum", world), a))(x), "bound")
    refuses(lambda: dist.all_reduce(torch.ones(4)), "on cpu", "jax device")
    refuses(lambda: dist.reduce(t, dst=0), "dist.reduce", "all_reduce")
    refuses(lambda: dist.gather(t, gather_list=[torch.empty_like(t) for _ in range(8)], dst=0), "dist.gather")
    refuses(lambda: dist.scatter(t, scatter_list=[torch.empty_like(t) for _ in range(8)], src=0), "dist.scatter")
    refuses(lambda: dist.send(t, dst=1), "dist.send")
    refuses(lambda: dist.recv(t, src=1), "dist.recv")
    print("OK refusals")


def check_autograd(mesh, world):
    """torch autograd through a collective: torch's formula (the backward of all_reduce sums the
    cotangents of every rank), eagerly differentiated by torch inside the shard_map."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((16, 3)).astype(np.float32)
    w = rng.standard_normal((2, 3)).astype(np.float32)

    def grad_of_x(t, wt):
        t = t.detach().requires_grad_()
        funcol.all_reduce(t * wt, "sum", world).pow(2).sum().backward()
        return t.grad

    got = spmd(grad_of_x, mesh, in_specs=(P("d"), P()), check_vma=False)(x, w)
    total = (blocks(x) * w).sum(0)  # the all-reduced value, the same on every rank
    expected = np.tile(8 * 2 * total * w, (8, 1))  # each of 8 ranks' loss contributes 2 * total * w
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5)
    print("OK autograd")


# ---- the DDP-style training step ---------------------------------------------------------------
def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def batches(n: int = 3, rows: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, 4, generator=g), torch.randn(rows, 2, generator=g)) for _ in range(n)]


def ddp_step(model, params, momenta, x, y):
    """One data-parallel SGD step as torch users write it: local backward, gradients all-reduced
    by hand (`dist.all_reduce`, then divided by the world size), then the optimizer's step."""
    ps = [p.detach().requires_grad_() for p in params]
    opt = torch.optim.SGD(ps, lr=0.1, momentum=0.9)
    for p, m in zip(ps, momenta, strict=True):
        opt.state[p]["momentum_buffer"] = m.clone()
    names = [n for n, _ in model.named_parameters()]
    loss = F.mse_loss(torch.func.functional_call(model, dict(zip(names, ps, strict=True)), (x,)), y)
    loss.backward()
    for p in ps:
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    opt.step()
    loss = loss.detach().clone()
    dist.all_reduce(loss, op=dist.ReduceOp.AVG)
    return [p.detach() for p in ps], [opt.state[p]["momentum_buffer"] for p in ps], loss


def reference_training() -> tuple[list[np.ndarray], list[float]]:
    """The same steps in eager torch on the CPU, on the global batch (one device)."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for x, y in batches():
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return [p.detach().numpy() for p in model.parameters()], losses


def ddp_training(mesh, put) -> tuple[list[np.ndarray], list[float]]:
    """`ddp_step` under jax.shard_map over `mesh`'s axis "d"; `put(array, spec)` places the inputs."""
    model = make_model()
    step = spmd(
        lambda *a: ddp_step(model, *a),
        mesh,
        in_specs=(P(), P(), P("d"), P("d")),
        out_specs=(P(), P(), P()),
        check_vma=False,  # torch's backward meets values JAX types as device-varying
    )
    params = [put(p.detach().numpy(), P()) for p in model.parameters()]
    momenta = [put(np.zeros(p.shape, np.float32), P()) for p in model.parameters()]
    data = [(put(x.numpy(), P("d")), put(y.numpy(), P("d"))) for x, y in batches()]
    run = step.lower(params, momenta, *data[0]).compile()  # compile ahead (see `multi`)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("jaxtorch_collectives_compiled")
    losses = []
    for x, y in data:
        params, momenta, loss = run(params, momenta, x, y)
        losses.append(float(np.asarray(loss.addressable_data(0))))
    return [np.asarray(p.addressable_data(0)) for p in params], losses


def check_ddp(mesh):
    ref_params, ref_losses = reference_training()
    params, losses = ddp_training(mesh, lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec)))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for got, ref in zip(params, ref_params, strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    print("OK ddp")


def eight() -> None:
    assert jax.device_count() == 8
    dist.init_process_group("jax", rank=0, world_size=8, store=dist.HashStore())
    world = dist.group.WORLD
    mesh = Mesh(np.array(jax.devices()), ("d",))
    mesh2d = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
    check_all_reduce(mesh, world)
    check_gather_scatter_all_to_all(mesh, world)
    check_broadcast_bit_exact(mesh, world)
    check_axes(mesh2d)
    check_refusals(mesh, world)
    check_autograd(mesh, world)
    check_ddp(mesh)


if __name__ == "__main__":
    eight()
