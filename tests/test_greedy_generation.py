"""Greedy generation is token-identical to transformers' greedy `generate`.

Batches of 1, 3 and 8 ragged prompts, 64+ new tokens, with prefix sharing, chunked prefill and a
KV budget small enough to force preemption (recompute). EOS is ignored so every run is long.
"""

import hf_oracle
import pytest

from ssd_engine import LLM, SamplingParams

NEW_TOKENS = 72


def _prompts(n: int) -> list[list[int]]:
    shared = [(11 * i) % 250 + 3 for i in range(20)]  # a common prefix, longer than one block
    prompts = []
    for i in range(n):
        own = [(31 * i + 7 * j) % 250 + 3 for j in range(3 + 5 * i)]
        prompts.append(shared + own if i % 2 else own)
    return prompts


def _oracle(path: str, prompts: list[list[int]]) -> list[list[int]]:
    return hf_oracle.greedy(path, prompts, NEW_TOKENS)


@pytest.fixture(scope="module")
def oracle_outputs(tiny_model_dir):
    cache = {}

    def get(arch: str, n: int):
        if (arch, n) not in cache:
            cache[arch, n] = _oracle(tiny_model_dir(arch), _prompts(n))
        return cache[arch, n]

    return get


GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_matches_transformers(tiny_model_dir, oracle_outputs, arch, batch):
    with LLM(tiny_model_dir(arch), block_size=8) as llm:
        outputs = llm.generate(_prompts(batch), GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == oracle_outputs(arch, batch)
    assert all(o.finish_reason == "length" for o in outputs)


def test_greedy_with_prefix_sharing_and_chunked_prefill(tiny_model_dir, oracle_outputs):
    with LLM(tiny_model_dir("qwen2"), block_size=4, max_num_batched_tokens=16) as llm:
        first = llm.generate(_prompts(8), GREEDY, use_tqdm=False)
        again = llm.generate(_prompts(8), GREEDY, use_tqdm=False)  # prompts now fully cached
    expected = oracle_outputs("qwen2", 8)
    assert [o.token_ids for o in first] == expected
    assert [o.token_ids for o in again] == expected
    assert sum(o.metrics.num_cached_tokens for o in first) > 0  # shared prefix within the batch
    assert all(o.metrics.num_cached_tokens >= len(o.prompt_token_ids) // 4 * 4 - 4 for o in again)


@pytest.mark.parametrize("mode", ["ar", "sd"])
@pytest.mark.parametrize(
    "pacing", [dict(prefill_tokens_while_decoding=3), dict(max_decode_stall=1.2)]
)
def test_greedy_with_prompts_read_a_few_tokens_a_step_beside_decodes(
    tiny_model_dir, oracle_outputs, mode, pacing
):
    """Two requests at a time: each later prompt is read a few tokens a step while the other decodes
    (3, or as many as the measured step times allow), in AR and in SD (whose draft follows the
    target's chunks)."""
    path = tiny_model_dir("qwen2")
    options = (
        dict(speculative_mode="sd", draft_model=path, num_speculative_tokens=2)
        if mode == "sd"
        else {}
    )
    with LLM(path, block_size=4, max_num_seqs=2, **pacing, **options) as llm:
        outputs = llm.generate(_prompts(8), GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == oracle_outputs("qwen2", 8)


def test_greedy_under_preemption(tiny_model_dir, oracle_outputs):
    # 8 sequences of up to ~130 tokens need ~120 blocks of 8; 40 blocks force preemption by recompute
    with LLM(tiny_model_dir("llama"), block_size=8, num_kv_blocks=40) as llm:
        outputs = llm.generate(_prompts(8), GREEDY, use_tqdm=False)
        preemptions = llm.engine.scheduler.num_preemptions
    assert preemptions > 0
    assert [o.token_ids for o in outputs] == oracle_outputs("llama", 8)


def test_seeded_sampling_reproducible_alone_and_in_batch(tiny_qwen2):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    prompts = _prompts(4)
    with LLM(tiny_qwen2) as llm:
        alone = llm.generate([prompts[1]], seeded, use_tqdm=False)[0].token_ids
        batch = llm.generate(prompts, [other, seeded, other, other], use_tqdm=False)
    assert batch[1].token_ids == alone
    assert (
        len(set(tuple(o.token_ids) for o in batch)) > 1
    )  # sampling is really random across requests
