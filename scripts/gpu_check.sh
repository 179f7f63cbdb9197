#!/usr/bin/env bash
# Everything the GPU path needs checked on a lent GPU, in one call of the device tool:
#
#     bash scripts/gpu_check.sh "$OUT"
#
# 1. correctness: greedy AR / SD / SSD token-identical to transformers on the GPU (fp32), and in bf16
#    each greedy token the target's fp64 argmax up to bf16 noise, the Triton kernels compiled for the
#    GPU against the references, real CUDA graph capture, flash-attn if present;
# 2. speed: kernels vs the torch reference and engine decode per backend, eager vs CUDA graphs (bf16);
# 3. achieved decode memory bandwidth against the GPU's datasheet peak.
# The default pair's weights cannot travel to the GPU machine (no network there, 64 MiB carried), so
# speed is measured on random models of the target's and draft's exact shapes: speed does not depend
# on the weights' values. Each result file names the device; copy them into benchmarks/results/.
set -u
out=${1:-benchmarks/results}
day=$(date +%F)
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/$day-gpu.txt"

python -m pytest -q -rs tests/test_cuda_path.py tests/test_cuda_graphs.py tests/test_paged_attention_kernels.py \
    tests/test_attention_backends.py tests/test_draft_link.py tests/test_model_equivalence.py \
    tests/test_bf16_exactness.py \
    2>&1 | tail -40 | tee "$out/$day-cuda-tests.txt"

python benchmarks/bench_cuda_kernels.py 2>/dev/null | tee "$out/$day-cuda-kernels.md"

python - <<'EOF'
# random checkpoints with the default pair's shapes (Qwen2.5-Coder-1.5B / 0.5B), byte tokenizer
import sys
from transformers import Qwen2Config, Qwen2ForCausalLM
sys.path.insert(0, "tests")
from tiny_checkpoints import byte_tokenizer
shapes = {"/tmp/shape-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                  num_attention_heads=12, num_key_value_heads=2),
          "/tmp/shape-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                  num_attention_heads=14, num_key_value_heads=2)}
for path, shape in shapes.items():
    config = Qwen2Config(vocab_size=151936, max_position_embeddings=4096, tie_word_embeddings=True, **shape)
    Qwen2ForCausalLM(config).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
EOF
python benchmarks/bench_bandwidth.py --device cuda --model /tmp/shape-1.5b --draft /tmp/shape-0.5b \
    --batch 1,8,32 --context 512 --steps 50 --out "$out/$day-bandwidth-cuda.md" 2>/dev/null
python benchmarks/bench_bandwidth.py --device cuda --model /tmp/shape-1.5b --batch 1,8,32 --context 512 \
    --steps 50 --enforce-eager --out "$out/$day-bandwidth-cuda-eager.md" 2>/dev/null
