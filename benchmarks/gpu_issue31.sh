#!/usr/bin/env bash
# Issue 31's GPU check (the device machine: CUDA builds of jax and torch, no jaxtorch install):
# GradScaler against torch's CUDA GradScaler and the exhaustive reciprocal check (gpu_issue31.py), then the
# new test files with JAX on the GPU (torch's references on the CPU, in the same process). Each part has a limit.
#     bash benchmarks/gpu_issue31.sh
set -u
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import jax, torch; print('jax', jax.__version__, jax.devices(), 'torch', torch.__version__)"
echo "## gpu_issue31.py"; timeout 170 python3 benchmarks/gpu_issue31.py
echo "## new tests, JAX on the GPU"
JAX_PLATFORMS=cuda timeout 130 python3 -m pytest -q -x -p no:cacheprovider -n 4 \
  tests/train/test_grad_scaler.py tests/interop/test_control_flow.py 2>&1 | tail -25
