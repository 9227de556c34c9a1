"""Training torch modules with JAX: optax steps, sharding, checkpoints, and the way back to torch.

**Example:**
    ```python
    import os, tempfile, optax

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.1), torch.nn.Linear(8, 1))
    loss_fn = lambda out, y: jnp.mean((out - y) ** 2)
    init, step = jaxtorch.train.make_train_step(model, loss_fn, optax.adam(1e-3))
    state = init()
    x, y, key = jnp.ones((8, 4)), jnp.zeros((8, 1)), jax.random.key(0)
    state, loss = step(state, x, y, key)   # the key: Dropout's randomness
    path = os.path.join(tempfile.mkdtemp(), "ckpt.safetensors")
    jaxtorch.train.save_checkpoint(state, path)
    jaxtorch.train.load_into(model, state)   # params and model_state (buffers, frozen weights)
    ```
"""

from ..bridge.core._errors import ModuleReleasedError
from ._checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from ._load import CheckpointKeysError, CheckpointKeysWarning, load_params
from ._mixed_precision import MixedPrecision
from ._sharding import DeviceLoader, data_mesh, shard, shard_batch, shardings
from ._state import DonatedStateError, TrainState, load_into
from ._step import make_train_step

__all__ = [
    "CheckpointError",
    "CheckpointKeysError",
    "CheckpointKeysWarning",
    "DeviceLoader",
    "DonatedStateError",
    "MixedPrecision",
    "ModuleReleasedError",
    "TrainState",
    "data_mesh",
    "load_checkpoint",
    "load_into",
    "load_params",
    "make_train_step",
    "save_checkpoint",
    "shard",
    "shard_batch",
    "shardings",
]
