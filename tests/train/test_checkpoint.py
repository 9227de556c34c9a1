"""save_checkpoint / load_checkpoint: round trips, atomic saves, corrupted files."""

import collections
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxtorch.train import CheckpointError, TrainState, load_checkpoint, save_checkpoint

Point = collections.namedtuple("Point", ["x", "y"])


def _state():
    params = {"fc.weight": jnp.arange(6.0).reshape(2, 3), "fc.bias": jnp.ones(2, jnp.bfloat16), "n": jnp.int32(7)}
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    return {
        "train": TrainState(
            params, {"bn.running_var": jnp.ones(3)}, opt.init(params_subset(params)), jnp.zeros((), jnp.int32)
        ),
        "misc": [1, 2.5, True, "name", None, (Point(jnp.zeros(2), 3), float("inf"))],
        "np": np.arange(4, dtype=np.int16),
        "key": jax.random.key(3),
        "ints": {1: "one", 2: jnp.ones(1)},
    }


def params_subset(params):
    return {k: v for k, v in params.items() if jnp.issubdtype(v.dtype, jnp.floating)}


def _assert_same(a, b):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        assert type(x) is type(y) or (isinstance(x, jax.Array) and isinstance(y, jax.Array))
        if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            np.testing.assert_array_equal(jax.random.key_data(x), jax.random.key_data(y))
        elif isinstance(x, (jax.Array, np.ndarray)):
            assert x.dtype == y.dtype and x.shape == y.shape
            np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
        else:
            assert x == y


def test_round_trip(tmp_path):
    state = _state()
    save_checkpoint(state, tmp_path / "sub" / "ckpt.safetensors")
    back = load_checkpoint(tmp_path / "sub" / "ckpt.safetensors")
    _assert_same(state, back)
    assert isinstance(back["train"], TrainState)
    assert type(back["train"].opt_state[1][0]) is type(state["train"].opt_state[1][0])  # optax ScaleByAdamState
    assert isinstance(back["np"], np.ndarray) and isinstance(back["train"].params["fc.weight"], jax.Array)
    assert back["misc"][5][1] == float("inf")


def test_optimizer_continues_identically(tmp_path):
    opt = optax.adam(0.1)
    params = {"w": jnp.array([1.0, -2.0])}
    grad = lambda p: jax.grad(lambda p: jnp.sum(p["w"] ** 2))(p)
    st = opt.init(params)
    for _ in range(2):
        u, st = opt.update(grad(params), st, params)
        params = optax.apply_updates(params, u)
    save_checkpoint((params, st), tmp_path / "c.safetensors")
    p2, st2 = load_checkpoint(tmp_path / "c.safetensors")
    u1, _ = opt.update(grad(params), st, params)
    u2, _ = opt.update(grad(p2), st2, p2)
    np.testing.assert_array_equal(u1["w"], u2["w"])


def test_unknown_namedtuple_class_is_not_imported(tmp_path):
    """A namedtuple class not already imported comes back as a stand-in (no imports on load)."""
    save_checkpoint(Point(1, 2), tmp_path / "p.safetensors")
    path = tmp_path / "p.safetensors"
    data = path.read_bytes().replace(b"test_checkpoint:Point", b"nomodule_xyz_ab:Point")
    assert b"nomodule_xyz_ab:Point" in data  # same length: the header stays valid
    path.write_bytes(data)
    back = load_checkpoint(path)
    assert back == (1, 2) and back._fields == ("x", "y") and type(back) is not Point
    assert not any("nomodule_xyz_ab" in m for m in __import__("sys").modules)


def test_failed_save_keeps_previous_checkpoint(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint({"w": jnp.ones(3), "step": 1}, path)
    with pytest.raises(TypeError, match="object"):
        save_checkpoint({"w": jnp.zeros(3), "bad": object()}, path)
    assert load_checkpoint(path)["step"] == 1
    assert sorted(os.listdir(tmp_path)) == ["ckpt.safetensors"]


def test_interrupted_write_keeps_previous_checkpoint(tmp_path, monkeypatch):
    import safetensors.numpy

    path = tmp_path / "ckpt.safetensors"
    save_checkpoint({"w": jnp.ones(3), "step": 1}, path)
    real = safetensors.numpy.save_file

    def dies_midway(tensors, filename, metadata=None):
        real(tensors, filename, metadata=metadata)
        with open(filename, "r+b") as f:
            f.truncate(20)  # half a file on disk, then the "disk full" error
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.numpy, "save_file", dies_midway)
    with pytest.raises(OSError):
        save_checkpoint({"w": jnp.zeros(3), "step": 2}, path)
    monkeypatch.undo()
    back = load_checkpoint(path)
    assert back["step"] == 1
    np.testing.assert_array_equal(back["w"], np.ones(3))
    assert sorted(os.listdir(tmp_path)) == ["ckpt.safetensors"]


@pytest.mark.parametrize("cut", [4, 100, -3])
def test_truncated_file_raises_naming_path(tmp_path, cut):
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint({"w": jnp.arange(64.0)}, path)
    data = path.read_bytes()
    path.write_bytes(data[:cut])
    with pytest.raises(CheckpointError, match=str(path)):
        load_checkpoint(path)


def test_corrupted_data_raises_naming_path(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint({"w": jnp.arange(64.0)}, path)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupted") as e:
        load_checkpoint(path)
    assert str(path) in str(e.value)


def test_missing_and_foreign_files(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint"):
        load_checkpoint(tmp_path / "nope.safetensors")
    import safetensors.numpy

    safetensors.numpy.save_file({"a": np.ones(2, np.float32)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(CheckpointError, match="not a jaxtorch checkpoint"):
        load_checkpoint(tmp_path / "plain.safetensors")
    (tmp_path / "pickle.pt").write_bytes(b"\x80\x04\x95" + b"\x00" * 40)
    with pytest.raises(CheckpointError, match="pickle.pt"):
        load_checkpoint(tmp_path / "pickle.pt")


def test_load_with_sharding_places_arrays(tmp_path):
    path = tmp_path / "c.safetensors"
    save_checkpoint({"w": jnp.ones((4, 2))}, path)
    dev = jax.devices()[0]
    back = load_checkpoint(path, shardings=jax.sharding.SingleDeviceSharding(dev))
    assert back["w"].sharding == jax.sharding.SingleDeviceSharding(dev)
