"""Training torch modules with JAX: optax steps, sharding, checkpoints, and the way back to torch.

```python
init, step = jaxtorch.train.make_train_step(model, loss_fn, optax.adam(1e-3))
state = init()
state, loss = step(state, x, y, key)
jaxtorch.train.save_checkpoint(state, "ckpt.safetensors")
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
