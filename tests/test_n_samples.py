"""SamplingParams.n: n independent samples of one prompt that share its KV pages.

- Samples after the first wait for the first's prompt to be computed, then take its full blocks
  from the prefix cache (their num_cached_tokens), in AR, SD and SSD.
- Greedy samples are identical; seeded sampled ones are reproducible, sample 0 equals the same
  request with n = 1, and the others draw from streams of their own (they differ).
- RequestOutput.outputs holds every sample in index order; a bad n is a one-line error naming it.
"""

import pytest

from ssd_engine import LLM, SamplingParams

PROMPT = [(5 * j) % 200 + 3 for j in range(21)]  # 21 tokens: five full blocks of 4


def _llm(target, mode="ar", draft=None):
    extra = {} if mode == "ar" else dict(draft_model=draft, num_speculative_tokens=3)
    return LLM(target, num_threads=1, block_size=4, speculative_mode=mode, **extra)


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_samples_share_the_prompts_pages_and_greedy_ones_agree(tiny_model_dir, mode):
    target, draft = tiny_model_dir("qwen2"), tiny_model_dir("qwen2", seed=1)
    with _llm(target, mode, draft) as llm:
        engine = llm.engine
        samples = engine.make_samples(
            PROMPT, SamplingParams(n=3, temperature=0, max_tokens=6, ignore_eos=True)
        )
        for seq in samples:
            engine.scheduler.add(seq)
        while engine.has_unfinished():
            engine.step()
        assert [s.num_cached_tokens for s in samples] == [0, 20, 20]
        assert (
            samples[0].output_token_ids
            == samples[1].output_token_ids
            == samples[2].output_token_ids
        )


def test_seeded_samples_are_reproducible_distinct_and_the_first_is_n_1s(tiny_model_dir):
    target = tiny_model_dir("qwen2")
    params = dict(temperature=1.0, max_tokens=12, ignore_eos=True, seed=11)
    with _llm(target) as llm:
        first = llm.generate([PROMPT], SamplingParams(n=4, **params), use_tqdm=False)[0]
        again = llm.generate([PROMPT], SamplingParams(n=4, **params), use_tqdm=False)[0]
        alone = llm.generate([PROMPT], SamplingParams(**params), use_tqdm=False)[0]
    tokens = [o.token_ids for o in first.outputs]
    assert [o.index for o in first.outputs] == [0, 1, 2, 3] and len(set(map(tuple, tokens))) == 4
    assert tokens == [o.token_ids for o in again.outputs]
    assert tokens[0] == alone.token_ids == first.token_ids


def test_bad_n_is_a_one_line_error(tiny_model_dir):
    with pytest.raises(ValueError, match=r"^n must be an int >= 1"):
        SamplingParams(n=0)
    with LLM(tiny_model_dir("qwen2"), num_threads=1, speculative_mode="ar", max_num_seqs=4) as llm:
        with pytest.raises(
            ValueError, match=r"^n \(5\) is more than the 4 sequences the engine runs at once"
        ):
            llm.generate([PROMPT], SamplingParams(n=5), use_tqdm=False)
        with pytest.raises(ValueError, match="n must be 1 for a stream"):
            llm.generate_stream(PROMPT, SamplingParams(n=2))
        assert (
            llm.generate([PROMPT], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].index
            == 0
        )
