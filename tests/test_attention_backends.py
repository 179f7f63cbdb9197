"""Attention backends behind one interface: the Triton kernels inside the engine, on CPU.

With TRITON_INTERPRET=1 (set here before the kernels are imported) `attention_backend="triton"` runs
the very kernels a GPU compiles, through the engine's own metadata: prefill chunks, decode,
verification of K + 1 tokens (SD) and the SSD draft process's tree-branch steps. Greedy output must
still equal transformers' token for token; the backends must agree on random step metadata.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import hf_oracle  # noqa: E402
from paged_steps import random_paged_step  # noqa: E402
from ssd_engine.kernels import gguf_cpu  # noqa: E402

from ssd_engine import LLM, SamplingParams  # noqa: E402
from ssd_engine.layers.attention import (  # noqa: E402
    AttentionMetadata,
    row_independent_attention,
    torch_attention,
)
from ssd_engine.layers.attention_backends import select_backend, triton_attention  # noqa: E402
from ssd_engine.speculative.ssd.draft.tree_mask import branch_metadata  # noqa: E402

# an object, as the engine names its device: what tests/instrumentation/placement.py takes for the accelerator
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PROMPTS = [list(range(5, 12)), list(range(40, 75)), [7, 8, 9]]

# a GPU runs these tests (scripts/gpu_check.sh): each also fails in CI where a host tensor meets the device
CHECK_PLACEMENT = True


def _expected(path, prompts, n):
    return hf_oracle.greedy(path, prompts, n, DEVICE)


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_engine_with_triton_kernels_matches_transformers(tiny_model_dir, mode):
    path = tiny_model_dir("qwen2", vocab_size=259)  # 4 query heads over 2 KV heads: GQA
    prompts, n = (
        (PROMPTS, 20) if mode != "ssd" else (PROMPTS[:2], 8)
    )  # the interpreter is slow: SSD less
    expected = _expected(path, prompts, n)
    greedy = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    # block_size 4 and a 16-token prefill budget: prompts span pages and arrive in chunks
    options = dict(
        device=DEVICE.type,
        dtype="float32",
        attention_backend="triton",
        block_size=4,
        max_num_batched_tokens=16,
    )
    if mode != "ar":
        options.update(
            draft_model=path if mode == "ssd" else tiny_model_dir("qwen2", seed=1, vocab_size=259),
            speculative_mode=mode,
            num_speculative_tokens=3,
            ssd_fanout="2",
            draft_timeout_s=300,
            ssd_budget=8,  # fixed: no timing of this machine (under the interpreter) sizes it
            draft_dtype="fp32",
        )  # SSD drafts with the target itself: hits need its exact argmax
    with LLM(path, **options) as llm:
        assert llm.engine.runner.attention_backend is triton_attention
        assert [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == expected
        if mode == "ssd":  # the cache was built by tree-branch steps and used
            summary = llm.engine.speculator.metrics.summary()
            assert not summary["draft_failures"] and summary["cache_hit_rate"] > 0


def _random_paged(g, rows, page):
    q_lens = [int(x) for x in torch.randint(1, 7, (rows,), generator=g)]
    kv_lens = [n + int(torch.randint(0, 30, (1,), generator=g)) for n in q_lens]
    meta, slots = random_paged_step(q_lens, kv_lens, page, g, DEVICE)
    return meta, slots // page


@pytest.mark.parametrize("seed", range(4))
def test_torch_and_triton_backends_agree_on_random_steps(seed):
    g = torch.Generator().manual_seed(seed)
    hq, hk, d, page = [(4, 2, 32, 4), (6, 3, 40, 8), (8, 1, 16, 16), (2, 2, 64, 4)][seed]
    meta, pages = _random_paged(g, 1 + seed, page)
    k_cache = torch.randn(pages * page, hk, d, generator=g).to(DEVICE)
    v_cache = torch.randn(pages * page, hk, d, generator=g).to(DEVICE)
    q = torch.randn(meta.slot_mapping.shape[0], hq, d, generator=g).to(DEVICE)
    ref = torch_attention(q, k_cache, v_cache, meta, d**-0.5)
    fast = triton_attention(q, k_cache, v_cache, meta, d**-0.5)
    torch.testing.assert_close(fast, ref, atol=2e-4, rtol=2e-4)
    # a tree step over the same cache: two branches per row, forking inside each row's keys
    rows = meta.kv_lens.shape[0]
    seq_of_branch = torch.arange(rows, device=DEVICE).repeat_interleave(2)
    visible = torch.clamp(
        meta.kv_lens.long()[seq_of_branch] - torch.tensor([0, 1] * rows, device=DEVICE), min=1
    )
    scratch = torch.randperm(pages * page, generator=g)[: 2 * rows * 3].view(2 * rows, 3).to(DEVICE)
    for step in range(3):
        tree = branch_metadata(
            meta.block_tables, seq_of_branch, visible, int(visible.max()), scratch, step, page
        )
        qb = torch.randn(2 * rows, hq, d, generator=g).to(DEVICE)
        torch.testing.assert_close(
            triton_attention(qb, k_cache, v_cache, tree, d**-0.5),
            torch_attention(qb, k_cache, v_cache, tree, d**-0.5),
            atol=2e-4,
            rtol=2e-4,
        )


def test_backend_choice_errors_name_the_problem(monkeypatch):
    cpu = torch.device("cpu")
    # CPU inference runs the compiled kernel where it builds, else the reference
    assert select_backend("auto", cpu, 16) is (
        row_independent_attention if gguf_cpu.available() else torch_attention
    )
    assert select_backend("torch", cpu, 16) is torch_attention
    with pytest.raises(ValueError, match="needs a CUDA device"):
        select_backend("flash-attn", cpu, 256)
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        select_backend("xformers", cpu, 16)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        select_backend("triton", cpu, 16)
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        LLM("/nonexistent", attention_backend="flashinfer")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash-attn runs on CUDA only")
def test_flash_attn_backend_matches_reference():
    pytest.importorskip("flash_attn", reason="flash-attn is an optional extra")
    from ssd_engine.layers.attention_backends import flash_attention

    g = torch.Generator().manual_seed(0)
    page, hq, hk, d, rows, q_len = (
        256,
        12,
        2,
        128,
        3,
        5,
    )  # uniform K + 1 queries per row (verification)
    kv_lens = torch.tensor([300, 700, 5], dtype=torch.int32)
    tables = torch.randperm(9, generator=g)[:6].view(rows, 2).to(torch.int32)
    slots = torch.cat(
        [
            tables[b, (kv_lens[b] - q_len + torch.arange(q_len)) // page] * page
            + (kv_lens[b] - q_len + torch.arange(q_len)) % page
            for b in range(rows)
        ]
    )
    meta = AttentionMetadata(
        slots.cuda(),
        tables.cuda(),
        kv_lens.cuda(),
        (torch.arange(rows + 1, dtype=torch.int32) * q_len).cuda(),
        q_len,
        700,
        page,
    )
    k_cache = torch.randn(9 * page, hk, d, generator=g).cuda().bfloat16()
    v_cache = torch.randn(9 * page, hk, d, generator=g).cuda().bfloat16()
    q = torch.randn(rows * q_len, hq, d, generator=g).cuda().bfloat16()
    torch.testing.assert_close(
        flash_attention(q, k_cache, v_cache, meta, d**-0.5).float(),
        torch_attention(q, k_cache, v_cache, meta, d**-0.5).float(),
        atol=3e-2,
        rtol=3e-2,
    )
