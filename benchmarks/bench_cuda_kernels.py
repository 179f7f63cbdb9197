"""CUDA only: the Triton masked-gather decode kernel against the torch reference attention, as a
kernel (SSD tree-branch shapes) and inside the engine (AR decode of a random Qwen2-1.5B-shaped
model, fp32). Prints a Markdown table; run on a GPU machine:

    python benchmarks/bench_cuda_kernels.py > benchmarks/results/DATE-cuda-kernels.md
"""
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kernels.tree_attention import masked_gather_attention, reference_masked_gather_attention  # noqa: E402


def timed(fn, reps: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps


def kernel_rows() -> list[str]:
    rows = ["| rows (branches) | keys L | Hq/Hk/D | triton ms | reference ms | reference / triton |", "|---|---|---|---|---|---|"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    for b, length in ((5, 512), (40, 1024), (160, 2048)):
        hq, hk, d, slots = 12, 2, 128, 4096
        q = torch.randn(b, hq, d, device="cuda", generator=gen)
        k = torch.randn(slots, hk, d, device="cuda", generator=gen)
        v = torch.randn(slots, hk, d, device="cuda", generator=gen)
        gather = torch.randint(0, slots, (b, length), device="cuda", generator=gen)
        mask = torch.rand(b, length, device="cuda", generator=gen) < 0.9
        mask[:, 0] = True
        fast = timed(lambda: masked_gather_attention(q, k, v, gather, mask, d ** -0.5))
        ref = timed(lambda: reference_masked_gather_attention(q, k, v, gather, mask, d ** -0.5))
        rows.append(f"| {b} | {length} | {hq}/{hk}/{d} | {fast * 1e3:.3f} | {ref * 1e3:.3f} | {ref / fast:.1f}x |")
    return rows


def engine_rows() -> list[str]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from ssd_engine import LLM, SamplingParams
    from ssd_engine.layers import attention

    config = Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=4096,
                         tie_word_embeddings=True)
    rows = ["| attention | batch | decode tok/s |", "|---|---|---|"]
    with tempfile.TemporaryDirectory() as path:
        Qwen2ForCausalLM(config).save_pretrained(path)
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
        from tiny_checkpoints import byte_tokenizer
        byte_tokenizer().save_pretrained(path)
        params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
        for name, use in (("triton", "1"), ("torch reference", "0")):
            attention._KERNEL.clear()
            os.environ["SSD_ENGINE_TRITON"] = use
            with LLM(path, device="cuda", max_model_len=2048) as llm:
                for batch in (1, 8):
                    prompts = [[100 + i] * 512 for i in range(batch)]
                    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
                    start = time.perf_counter()
                    outs = llm.generate(prompts, params, use_tqdm=False)
                    seconds = time.perf_counter() - start
                    rows.append(f"| {name} | {batch} | {sum(len(o.token_ids) for o in outs) / seconds:.1f} |")
    return rows


if __name__ == "__main__":
    print(f"# CUDA kernels, {torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    print("## Masked-gather decode attention (one query per row, fp32)\n")
    print("\n".join(kernel_rows()))
    print("\n## Engine AR decode, random Qwen2-1.5B-shaped model, fp32, 512-token prompts, 128 new tokens "
          "(eager, no CUDA graphs; includes prefill)\n")
    print("\n".join(engine_rows()))
