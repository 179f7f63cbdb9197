"""LLM.generate_stream: increments join to exactly what generate() returns (stop strings and
incomplete UTF-8 included), several streams interleave on one engine, and a stream closed early
cancels its request and returns its blocks."""

import pytest

from ssd_engine import LLM, SamplingParams
from ssd_engine.generate import main as generate_main

PROMPTS = ["hello world", "def f(x):", "The quick brown fox"]


@pytest.fixture(scope="module")
def llm(tiny_qwen2):
    with LLM(tiny_qwen2, max_num_seqs=4, num_kv_blocks=64) as engine:
        yield engine


def _stream(llm, prompt, params) -> tuple[list[str], object]:
    stream = llm.generate_stream(prompt, params)
    pieces = list(stream)
    return pieces, stream.output


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_increments_join_to_the_offline_text(llm, temperature):
    for i, prompt in enumerate(PROMPTS):
        params = SamplingParams(temperature=temperature, max_tokens=24, ignore_eos=True, seed=i)
        offline = llm.generate([prompt], params, use_tqdm=False)[0]
        pieces, out = _stream(llm, prompt, params)
        assert "".join(pieces) == offline.text == out.text
        assert (
            out.token_ids == offline.token_ids
            and out.finish_reason == offline.finish_reason == "length"
        )
        assert len(pieces) > 1  # text arrives as it is generated, not in one piece at the end


def test_stop_string_is_never_streamed(llm):
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    full = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].text
    stop = full[10:13]  # a stop string that occurs inside the greedy output
    stopped = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, stop=[stop])
    offline = llm.generate([PROMPTS[0]], stopped, use_tqdm=False)[0]
    pieces, out = _stream(llm, PROMPTS[0], stopped)
    assert "".join(pieces) == offline.text == out.text and stop not in out.text
    assert out.finish_reason == "stop"
    # no piece ever contained text past the cut
    assert all(stop not in "".join(pieces[: i + 1]) for i in range(len(pieces)))


def test_interleaved_streams_each_equal_their_offline_output(llm):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    offline = [o.text for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    streams = [llm.generate_stream(p, params) for p in PROMPTS]
    iterators = [iter(s) for s in streams]
    texts = ["", "", ""]
    live = set(range(3))
    while live:  # round-robin: each stream's steps also advance the others
        for i in sorted(live):
            try:
                texts[i] += next(iterators[i])
            except StopIteration:
                live.discard(i)
    assert texts == offline


def test_closing_a_stream_early_cancels_it_and_frees_its_blocks(llm):
    engine = llm.engine
    free = engine.block_manager.num_free_blocks
    stream = iter(
        llm.generate_stream(
            PROMPTS[1] * 8, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        )
    )
    next(stream)
    assert engine.block_manager.num_free_blocks < free
    stream.close()
    assert not engine.has_unfinished() and engine.block_manager.num_free_blocks == free
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)  # the engine carries on
    assert (
        "".join(llm.generate_stream(PROMPTS[0], params))
        == llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].text
    )


def test_cli_stream_prints_the_completion(tiny_qwen2, capsys):
    argv = [
        "--model",
        tiny_qwen2,
        "--prompt",
        "hello",
        "--max-tokens",
        "12",
        "--ignore-eos",
        "--no-progress",
        "--temperature",
        "0",
    ]  # the CLI samples by default: greedy, so both runs print the same text
    assert generate_main(argv + ["--stream"]) in (0, None)
    streamed = capsys.readouterr().out
    assert generate_main(argv) in (0, None)
    assert streamed == capsys.readouterr().out
    with pytest.raises(SystemExit):
        generate_main(argv + ["--stream", "--prompt", "again"])
    assert "--stream takes one prompt" in capsys.readouterr().err


def test_an_incomplete_character_is_held_back_until_it_completes():
    from types import SimpleNamespace

    from ssd_engine.engine.streaming import TextIncrements

    texts = ["ab\ufffd", "ab\ufffd\ufffd", "ab\U0001f600c"]  # a 4-byte emoji arriving byte by byte
    increments = TextIncrements(SimpleNamespace(params=SamplingParams(max_tokens=4)))
    assert [increments.delta(text) for text in texts] == ["ab", "", "\U0001f600c"]
    assert increments.rest("ab\U0001f600cd") == "d"
