#!/usr/bin/env bash
# GPU check for issues 22-24 (the device machine: its own CUDA builds of jax and torch, jaxtorch from this
# checkout): the contract suites on the GPU backend, the train step's device memory (default = donated vs
# donate=False) on the 336 M Llama, and remat's compiled memory (activation checkpointing). Each part has a time limit.
#     bash benchmarks/gpu_contracts.sh
set -u
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" JAX_PLATFORMS=cuda,cpu PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import jax, torch, transformers; print('jax', jax.__version__, jax.devices(), 'torch', torch.__version__, 'transformers', transformers.__version__)"
time python3 -c "import jaxtorch, jaxtorch.bridge.tensor._device as d; print('cpp guard:', d.CPP_GUARD or 'none')"
echo "## contract suites on the GPU backend"
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 300 python3 -m pytest -q -p no:cacheprovider -n 4 tests/adversarial tests/bridge/test_autocast.py \
    tests/bridge/test_remat.py tests/bridge/test_saving.py tests/train/test_step.py tests/bridge/test_api.py \
    tests/interop/test_compile_autograd.py 2>&1 | grep -E "passed|failed|^FAILED|^ERROR" | head -60
echo "## train step memory, 336 M Llama, AdamW float32"
timeout 200 python3 benchmarks/train_memory.py --preset 336m --configs default,donate=False
echo "## remat (compiled memory plan)"
timeout 90 python3 benchmarks/remat.py
