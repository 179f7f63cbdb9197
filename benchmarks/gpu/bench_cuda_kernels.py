"""The GPU path measured in one run: Triton attention kernels against the torch reference, and the
engine's decode with each attention backend, eager and with CUDA graphs.

    python benchmarks/gpu/bench_cuda_kernels.py > benchmarks/results/DATE-cuda-kernels.md

Kernels use the target's shape (Qwen2.5-1.5B: 12 query heads over 2 KV heads of 128) in bfloat16:
decode (one query per row), verification (K + 1 = 5 queries per row) and SSD tree-branch steps
(one query per branch, trunk + own path), each with the KV bytes it must read per call and the
bandwidth that gives. The engine rows decode a random model of the same shape (the default pair's
weights are not on the GPU machine) with 512-token prompts, timing decode only (prefill excluded).
`--smoke` runs tiny shapes on CPU under TRITON_INTERPRET=1: CI's check that this script still runs.
"""

import argparse
import os
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [REPO, os.path.join(REPO, "tests"), os.path.join(REPO, "benchmarks")]


def timed(fn, reps: int) -> float:
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps


def _step(
    kind: str,
    rows: int,
    context: int,
    hq: int,
    hk: int,
    d: int,
    page: int,
    device,
    dtype,
    k: int = 4,
):
    """Random cache + metadata of one step: (q, k_cache, v_cache, meta, KV bytes read)."""
    from ssd_engine.layers.attention import AttentionMetadata
    from ssd_engine.speculative.ssd.draft.tree_mask import branch_metadata

    blocks_each = -(-(context + k + 1) // page)
    total = rows * blocks_each + -(-rows * k // page) + 1
    gen = torch.Generator().manual_seed(0)
    kv = [torch.randn(total * page, hk, d, generator=gen).to(device, dtype) for _ in range(2)]
    tables = (
        torch.randperm(rows * blocks_each, generator=gen).view(rows, blocks_each).to(torch.int32)
    )
    per_row = {"decode": 1, "verify": k + 1, "tree": 1}[kind]
    kv_bytes = 2 * hk * d * kv[0].element_size()
    if kind == "tree":  # rows branches over rows // (k + 1) sequences' trunks, each at its own fork
        seqs = max(1, rows // (k + 1))
        seq_of = torch.arange(rows) % seqs
        visible = context + torch.arange(rows) % (k + 1)
        scratch = rows * blocks_each * page + torch.arange(rows * k).view(rows, k)
        meta = branch_metadata(
            tables[:seqs].to(device),
            seq_of.to(device),
            visible.to(device),
            int(visible.max()),
            scratch.to(device),
            k - 1,
            page,
        )
        read = int(visible.sum() + rows * k) * kv_bytes
    else:
        kv_lens = torch.full((rows,), context + per_row, dtype=torch.int32)
        slots = torch.stack(
            [
                tables[b, (context + i) // page] * page + (context + i) % page
                for b in range(rows)
                for i in range(per_row)
            ]
        ).long()
        meta = AttentionMetadata(
            slots.to(device),
            tables.to(device),
            kv_lens.to(device),
            (torch.arange(rows + 1, dtype=torch.int32) * per_row).to(device),
            per_row,
            context + per_row,
            page,
        )
        read = rows * (context + per_row) * kv_bytes
    q = torch.randn(rows * per_row, hq, d, generator=gen).to(device, dtype)
    return q, kv[0], kv[1], meta, read


def kernel_rows(device, dtype, shapes, reps: int) -> list[str]:
    from ssd_engine.layers.attention import torch_attention
    from ssd_engine.layers.attention_backends import triton_attention

    hq, hk, d, page = shapes["heads"]
    rows = [
        "| step | rows | context | KV MB read | triton ms | triton GB/s | reference ms | reference / triton |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for kind, n, context in shapes["steps"]:
        q, kc, vc, meta, read = _step(kind, n, context, hq, hk, d, page, device, dtype)
        fast = timed(lambda: triton_attention(q, kc, vc, meta, d**-0.5), reps)
        ref = timed(lambda: torch_attention(q, kc, vc, meta, d**-0.5), reps)
        rows.append(
            f"| {kind} | {n} | {context} | {read / 1e6:.2f} | {fast * 1e3:.3f} | {read / fast / 1e9:.0f} | "
            f"{ref * 1e3:.3f} | {ref / fast:.1f}x |"
        )
    return rows


def engine_rows(
    device: str, dtype: str, config, batches, prompt_len: int, new_tokens: int
) -> list[str]:
    from tiny_checkpoints import byte_tokenizer
    from transformers import Qwen2ForCausalLM

    from ssd_engine import LLM, SamplingParams

    rows = ["| attention | CUDA graphs | batch | decode tok/s | TPOT ms |", "|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as path:
        Qwen2ForCausalLM(config).save_pretrained(path)
        byte_tokenizer().save_pretrained(path)
        for backend, eager in (("torch", True), ("triton", True), ("triton", False)):
            with LLM(
                path,
                device=device,
                dtype=dtype,
                attention_backend=backend,
                enforce_eager=eager,
                max_model_len=prompt_len + new_tokens + 8,
            ) as llm:
                for batch in batches:
                    prompts = [[100 + i] * prompt_len for i in range(batch)]
                    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
                    llm.generate(prompts, params, use_tqdm=False)  # warm-up: captures the graphs
                    outs = llm.generate(prompts, params, use_tqdm=False)
                    # the suite's decode window: from the batch's last first token to its last token
                    decode_s = max(o.metrics.e2e_s for o in outs) - max(
                        o.metrics.ttft_s for o in outs
                    )
                    tok_s = sum(len(o.token_ids) - 1 for o in outs) / decode_s
                    rows.append(
                        f"| {backend} | {'off' if eager else 'on'} | {batch} | {tok_s:.1f} | "
                        f"{decode_s / (new_tokens - 1) * 1e3:.2f} |"
                    )
    return rows


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/gpu/bench_cuda_kernels.py", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.smoke:  # before any kernel is imported; graphs emulated so every row's path runs
        os.environ["TRITON_INTERPRET"] = "1"
        from ssd_engine.testing import EMULATE_CUDA_GRAPHS

        os.environ[EMULATE_CUDA_GRAPHS] = "1"
    from transformers import Qwen2Config

    if args.smoke:
        device, dtype = "cpu", torch.float32
        shapes = dict(
            heads=(4, 2, 16, 4), steps=[("decode", 2, 9), ("verify", 2, 9), ("tree", 5, 9)]
        )
        config = Qwen2Config(
            vocab_size=320,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
        )
        engine = dict(batches=(1, 3), prompt_len=8, new_tokens=5)
        reps, name = 1, "CPU smoke run (Triton interpreter)"
    else:
        device, dtype = "cuda", torch.bfloat16
        shapes = dict(
            heads=(12, 2, 128, 16),
            steps=[
                ("decode", 1, 2048),
                ("decode", 16, 2048),
                ("verify", 1, 2048),
                ("verify", 16, 2048),
                ("tree", 40, 1024),
                ("tree", 160, 2048),
            ],
        )
        config = Qwen2Config(
            vocab_size=151936,
            hidden_size=1536,
            intermediate_size=8960,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
        )
        engine = dict(batches=(1, 8, 32), prompt_len=512, new_tokens=128)
        reps, name = 50, torch.cuda.get_device_name()
    from suite.machine import machine_line

    print(f"# GPU path: attention kernels and decode, {name}\n\n{machine_line(device)}\n")
    print(
        f"## Attention kernels, {str(dtype).removeprefix('torch.')}, heads {shapes['heads'][0]}/"
        f"{shapes['heads'][1]}, head dim {shapes['heads'][2]}, page {shapes['heads'][3]}, K = 4\n"
    )
    print("\n".join(kernel_rows(device, dtype, shapes, reps)))
    print(
        f"\n## Engine AR decode, random Qwen2 model ({config.num_hidden_layers} layers, hidden {config.hidden_size}), "
        f"{engine['prompt_len']}-token prompts, {engine['new_tokens']} new tokens, decode only\n"
    )
    print("\n".join(engine_rows(device, "float32" if args.smoke else "bfloat16", config, **engine)))


if __name__ == "__main__":
    main()
