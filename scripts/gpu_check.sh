#!/usr/bin/env bash
# Everything the GPU path needs checked on a lent GPU:
#
#     bash scripts/gpu_check.sh OUT                       # every stage, in order
#     bash scripts/gpu_check.sh OUT tests anchor          # some stages (the device tool allows 10 minutes a call)
#
# Each stage's whole output goes to OUT as it is written, so a call stopped at its time limit still returns
# what ran; a stage that outlasts one call is split by naming fewer stages a call.
#
# Stages:
#   tests      the CUDA tests (real kernels, fused layer kernels, real CUDA graph capture, greedy AR/SD/SSD equal
#              to transformers in fp32, bf16 greedy within the fp64 recompute's tolerance)
#   tests-compiled  the engine's CUDA tests again with every runner compiled (inductor: minutes of compiling)
#   kernels    the Triton attention kernels against the torch reference, and engine decode per backend
#   bandwidth  one decode step at the default pair's shapes (bf16, batch 1/8/32, context 512) against the
#              measured HBM ceiling, as the engine runs it (graphed, fused Triton layer kernels): GPU kernels
#              per step and the batch-1 step's profile; the 0.5B / 1.5B step ratio is the two models' batch-1 rows
#   bandwidth-variants  the same step graphed with torch's ops, graphed + compiled (minutes of compiling),
#              and eager (which fusion wins sets the CUDA default)
#   anchor     our AR against transformers' static-cache generate with its forward compiled (torch.compile,
#              reduce-overhead) at the 1.5B shape, bf16, batch 1, a 512-token prompt, 128 new tokens
#   auto       speculative_mode="auto" on the GPU: the mode it chooses from the forwards it timed there, and the
#              per-step choice at batch 1 / 8 / 32, against AR and SD every step measured in the same call (7B- and
#              1.5B-shaped targets, 0.5B-shaped draft, alpha 0.8)
#   profile    where a batch-8 decode step's time goes (torch.profiler) for AR, SD every step, and plain steps
#              inside an SD engine (the per-step choice's K = 0 arm), 1.5B-shaped target, 0.5B-shaped draft
#   host       host time per AR step and SD round on this machine's CPU (tiny pair, real graphs; the same steps
#              again with every replay skipped: the host's own work, to set against a step's GPU time)
#   synthetic  AR / SD / SSD at synthetic acceptance, the SSD draft sharing the one GPU: alpha 0.8, K 4,
#              batch 1 with the Qwen2.5-7B-shaped target and the 0.5B-shaped draft, the draft as a process
#   synthetic-thread  the same with the SSD draft as a thread on its own CUDA stream (which shares one GPU
#              better sets the default)
#   synthetic-sweep  alpha 0.5/0.7/0.9, K 2/4/8, budgets 2/4/8, batch 1/8 at the default pair's shapes
# Weights are random at real shapes (load_format="dummy", configs/shapes/): the default pair's weights
# cannot travel to the GPU machine, and speed does not depend on the weights' values. Every result
# file names the device; copy them into benchmarks/results/.
set -u
out=${1:-benchmarks/results}
shift || true
all_stages="tests tests-compiled kernels bandwidth bandwidth-variants anchor auto profile host synthetic synthetic-thread synthetic-sweep"
stages=${*:-$all_stages}
day=$(date +%F)
mkdir -p "$out"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET SSD_ENGINE_EMULATE_CUDA_GRAPHS
# Packages the GPU image lacks (gguf, fastapi, uvicorn, pydantic, ...) travel as wheels in .whl/ (the device
# tool's README says how to download them); the engine is installed, not put on PYTHONPATH, because the
# package maps the top-level kernels/ folder to ssd_engine.kernels
if compgen -G ".whl/*.whl" >/dev/null; then
    python -m pip install -q --no-index --no-deps --no-compile --target /tmp/gpu-check-site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/gpu-check-site${PYTHONPATH:+:$PYTHONPATH}"
fi
python -m pip install -q --no-deps --no-build-isolation -e . || exit 1
shapes=configs/shapes
target=$shapes/qwen2.5-coder-1.5b-instruct
draft=$shapes/qwen2.5-coder-0.5b-instruct
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/$day-gpu.txt"

for stage in $stages; do
    echo "== $stage" >&2
    case $stage in
    tests)
        cuda_tests="tests/test_cuda_path.py tests/test_cuda_graphs.py tests/test_paged_attention_kernels.py
            tests/test_attention_backends.py tests/test_draft_link.py tests/test_model_equivalence.py
            tests/test_bf16_exactness.py tests/test_fused_layer_ops.py tests/test_piecewise_graphs.py
            tests/test_proposal_rows.py tests/test_ssd_units.py tests/test_doc_examples.py"
        # -v names each test as it ends, so a call stopped at its limit still says which failed; 8 workers:
        # a 16-core GPU machine ran these in ~2 minutes (4 workers: ~4); --timeout (pytest-timeout, in the
        # GPU image) fails a hung test instead of the whole call; the doc examples run the GPU page's (the
        # others are CPU commands CI runs, some needing extras the image lacks)
        python -m pytest -v -rfEs --tb=short --durations=15 -n 8 --timeout 300 -p no:cacheprovider $cuda_tests \
            -k "not test_the_block_runs or docs/GPU.md" 2>&1 | tee "$out/$day-cuda-tests.txt" | grep -E "FAILED|ERROR|passed|failed" | tail -40
        ;;
    tests-compiled)
        # 8 workers: ~2 minutes on a 16-core H200 machine, compiling included
        python -m pytest -v -rfEs --durations=15 -n 8 --timeout 300 -p no:cacheprovider --compile-model \
            tests/test_cuda_path.py tests/test_cuda_graphs.py 2>&1 \
            | tee "$out/$day-cuda-tests-compiled.txt" | grep -E "FAILED|ERROR|passed|failed" | tail -40
        ;;
    kernels)
        python benchmarks/gpu/bench_cuda_kernels.py 2>/dev/null | tee "$out/$day-cuda-kernels.md"
        ;;
    bandwidth)
        python benchmarks/gpu/bench_bandwidth.py --device cuda --load-format dummy --model $target --draft $draft \
            --batch 1,8,32 --context 512 --steps 50 --out "$out/$day-bandwidth-cuda.md"
        ;;
    bandwidth-variants)
        common="--device cuda --load-format dummy --model $target --draft $draft --batch 1,8,32 --context 512 --steps 50"
        python benchmarks/gpu/bench_bandwidth.py $common --fused-kernels off --out "$out/$day-bandwidth-cuda-unfused.md"
        python benchmarks/gpu/bench_bandwidth.py $common --compile --out "$out/$day-bandwidth-cuda-compiled.md"
        python benchmarks/gpu/bench_bandwidth.py $common --enforce-eager --out "$out/$day-bandwidth-cuda-eager.md"
        ;;
    anchor)
        python benchmarks/gpu/bench_anchor.py --device cuda --model $target --hf static --repeats 2 --out "$out"
        ;;
    auto)
        for pair_target in $shapes/qwen2.5-7b $target; do
            python benchmarks/gpu/bench_auto.py --device cuda --target $pair_target --draft $draft --alpha 0.8 \
                --batch 1,8,32 --tag "$(basename $pair_target)-cuda" --out "$out"
        done
        ;;
    profile)
        python benchmarks/gpu/profile_steps.py --target $target --draft $draft --batch 8 --k 2 \
            --out "$out/$day-profile-steps-cuda.md"
        ;;
    host)
        python benchmarks/gpu/bench_host_overhead.py --device cuda --out "$out"
        ;;
    synthetic)
        python benchmarks/bench_synthetic.py --device cuda --target $shapes/qwen2.5-7b --draft $draft \
            --alpha 0.8 --k 4 --budget 4 --hit 0.9 --batch 1 --new-tokens 128 --prompt-len 512 --tag 7b-cuda --out "$out"
        ;;
    synthetic-thread)
        python benchmarks/bench_synthetic.py --device cuda --target $shapes/qwen2.5-7b --draft $draft --draft-host thread \
            --alpha 0.8 --k 4 --budget 4 --hit 0.9 --batch 1 --new-tokens 128 --prompt-len 512 --tag 7b-cuda-thread --out "$out"
        ;;
    synthetic-sweep)
        python benchmarks/bench_synthetic.py --device cuda --target $target --draft $draft --alpha 0.5,0.7,0.9 \
            --k 2,4,8 --budget 2,4,8 --hit 0.9 --batch 1,8 --new-tokens 64 --tag sweep-cuda --out "$out"
        ;;
    *)
        echo "unknown stage $stage ($all_stages)" >&2
        exit 2
        ;;
    esac
done
