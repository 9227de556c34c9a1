"""jaxtorch: run PyTorch code on JAX.

JAX-first:
    ```python
    params, fn = jaxtorch.extract(torch_model)      # dict of jax.Arrays, pure function
    logits = jax.jit(fn)(params, input_ids)
    m = jaxtorch.torch_module_to_jax(torch_model)   # an equinox.Module
    out = jaxtorch.call_torch(torch_fn, *jax_args)  # torch code on JAX values
    ```
PyTorch-first (the two-line change):
    ```python
    import jaxtorch; jaxtorch.enable_globally()
    m = MyModel().to("jax"); y = m(torch.randn(3, 8, device="jax"))
    y.jax(); y.cpu()
    ```
Lazy (torch_xla style): `jaxtorch.enable_globally(lazy=True)` or `with jaxtorch.lazy():`
records ops and runs each step as one cached XLA program at `jaxtorch.xla.mark_step()`.
torch.distributed: `dist.init_process_group("jax", ...)` and the functional collectives run as
JAX collectives inside `jax.shard_map`/`jax.pmap` (`collectives_axis` names the mesh axes).
Also: `checks()` (torch's IndexError/RuntimeError for out-of-range indices and integer
division by zero, opt-in), `compile`/`jit` (torch-first jit), `export`, `from_exported` (a
`torch.export.ExportedProgram` as `(params, fn)`), `register_op`, `register_object` (a
class of yours as a pytree), `JaxModule` (JAX modules as torch modules), and the submodules
`train` (optax steps, sharding, checkpoints), `generation` (compiled greedy decoding),
`coverage` (which ops a model needs) and `xla` (torch_xla-style helpers).
"""

from . import coverage, generation, train, xla  # the public submodules
from ._install import install_all, installed
from .bridge.api._compile import Compiled, compile, jit
from .bridge.api._export import export
from .bridge.api._exported import from_exported
from .bridge.api._jax_first import TorchModule, call_torch, extract, torch_module_to_jax
from .bridge.api._jax_module import JaxModule
from .bridge.core._checks import checks
from .bridge.core._errors import (
    CollectiveError,
    ControlFlowError,
    DataDependentError,
    DeviceMismatchError,
    ExportedInputError,
    ExportedProgramError,
    Float64Error,
    GeneratorUnderTraceError,
    GradScalerError,
    HookUnderTraceError,
    Int64Error,
    JaxtorchError,
    MetaTensorError,
    MissingKeyError,
    OnceDifferentiableError,
    StateWriteError,
    TorchVersionError,
    UnsupportedOpError,
)
from .bridge.core._lazy import lazy, sync
from .bridge.core._pytrees import register_object
from .bridge.core._random import manual_seed
from .bridge.core._registry import register_op
from .bridge.dispatch._environment import default_env, disable_globally, enable_globally
from .bridge.state._binding import ParamsError
from .bridge.tensor._autograd import call_jax, jax_function_to_torch
from .bridge.tensor._convert import jax_view, to_jax, to_torch, torch_view
from .bridge.tensor._tensor import JaxTensor
from .ops.collectives import collectives_axis
from .train import load_checkpoint, load_into, load_params, save_checkpoint

install_all()  # everything jaxtorch changes in torch and JAX, in order, once (see `installed()`)

__version__ = "0.1.0"

__all__ = [
    "JaxModule",
    "JaxTensor",
    "TorchModule",
    "call_jax",
    "Compiled",
    "compile",
    "jit",
    "call_torch",
    "checks",
    "collectives_axis",
    "default_env",
    "disable_globally",
    "enable_globally",
    "export",
    "extract",
    "from_exported",
    "installed",
    "jax_function_to_torch",
    "jax_view",
    "lazy",
    "load_checkpoint",
    "load_into",
    "load_params",
    "manual_seed",
    "register_object",
    "register_op",
    "save_checkpoint",
    "sync",
    "to_jax",
    "to_torch",
    "torch_module_to_jax",
    "torch_view",
    "CollectiveError",
    "ControlFlowError",
    "DataDependentError",
    "DeviceMismatchError",
    "ExportedInputError",
    "ExportedProgramError",
    "Float64Error",
    "GeneratorUnderTraceError",
    "GradScalerError",
    "HookUnderTraceError",
    "Int64Error",
    "JaxtorchError",
    "MetaTensorError",
    "MissingKeyError",
    "OnceDifferentiableError",
    "ParamsError",
    "StateWriteError",
    "TorchVersionError",
    "UnsupportedOpError",
    # public submodules
    "coverage",
    "generation",
    "train",
    "xla",
]
