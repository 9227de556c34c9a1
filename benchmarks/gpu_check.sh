#!/usr/bin/env bash
# One GPU check (the device machine: CUDA builds of jax and torch, no jaxtorch install):
# GPT-2 forward/train step vs torch CUDA (gpu.py), greedy decoding tokens/s (decode.py: jaxtorch on
# the GPU, torch's generate on the CPU cores) plus torch's own CUDA generate in a process without
# jaxtorch, and time to first result. Every part has its own time limit.
#     bash benchmarks/gpu_check.sh
set -u
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import jax, torch, transformers; print('jax', jax.__version__, jax.devices(), 'torch', torch.__version__, 'transformers', transformers.__version__)"
cd benchmarks
echo "## gpu.py"; timeout 150 python3 gpu.py 30
echo "## decode.py"; timeout 150 python3 decode.py --repeats 3
echo "## torch CUDA generate (same Llama, no jaxtorch in this process)"
timeout 90 python3 - <<'PY'
import statistics, time, torch, transformers
cfg = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=256, num_attention_heads=8, num_key_value_heads=4,
                               intermediate_size=256 * 8 // 3, vocab_size=4096, max_position_embeddings=1024,
                               bos_token_id=0, eos_token_id=0)
torch.manual_seed(0)
m = transformers.LlamaForCausalLM(cfg).eval().cuda()
ids = torch.randint(1, 4096, (1, 16), generator=torch.Generator().manual_seed(1)).cuda()
for cache in (None, "static"):
    kw = {"cache_implementation": cache} if cache else {}
    def run():
        with torch.no_grad():
            out = m.generate(ids, max_new_tokens=64, min_new_tokens=64, do_sample=False, pad_token_id=0, **kw)
        torch.cuda.synchronize()
        return out
    run()
    ts = []
    for _ in range(5):
        t0 = time.perf_counter(); run(); ts.append(time.perf_counter() - t0)
    print(f"torch CUDA generate, cache={cache or 'dynamic'}: {64 / statistics.median(ts):.0f} tokens/s (median of 5)")
PY
echo "## first_result.py"; timeout 200 python3 first_result.py --repeat 1 --no-cache
