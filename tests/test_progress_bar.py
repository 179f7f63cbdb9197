"""LLM.generate's progress bar counts generated tokens, not requests (a single request would sit at
0/1 until done), and ends full even when a request stops before its max_tokens."""

import pytest

from ssd_engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_qwen2):
    with LLM(tiny_qwen2, num_threads=1, num_kv_blocks=64, max_num_seqs=2) as llm:
        yield llm


def final_bar(err: str) -> str:
    return err.replace("\r", "\n").strip().splitlines()[-1]


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def test_one_request_counts_its_tokens(llm, capsys):
    llm.generate([5, 6, 7], greedy(12))
    bar = final_bar(capsys.readouterr().err)
    assert "12/12" in bar and "tok/s" in bar and "requests=1/1" in bar, bar


def test_a_request_that_stops_early_shrinks_the_total(llm, capsys):
    tokens = llm.generate([5, 6, 7], greedy(12), use_tqdm=False)[0].token_ids
    k = next(
        i for i in range(1, len(tokens)) if tokens[i] not in tokens[:i]
    )  # stops right after position k
    capsys.readouterr()
    outs = llm.generate([[5, 6, 7], [8, 9]], [greedy(12, stop_token_ids=[tokens[k]]), greedy(7)])
    assert len(outs[0].token_ids) == k + 1
    bar = final_bar(capsys.readouterr().err)
    assert f"{k + 1 + 7}/{k + 1 + 7}" in bar and "100%" in bar and "requests=2/2" in bar, bar
