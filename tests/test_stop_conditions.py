"""Stop conditions on a tiny random model at temperature 0 (greedy output is deterministic, so an
unrestricted run tells us what each stop condition must cut)."""

import pytest

from ssd_engine import LLM, SamplingParams

EOS = 2
PROMPTS = ["def f(x):", "Once upon a time", "hello world", "The quick brown fox", "abc", "print(1)"]
N = 16  # tokens of the unrestricted greedy reference


def greedy(**kwargs):
    return SamplingParams(temperature=0, **kwargs)


@pytest.fixture(scope="module")
def llm(tiny_qwen2):
    return LLM(tiny_qwen2, max_model_len=128, block_size=4, max_num_seqs=8, num_threads=1)


@pytest.fixture(scope="module")
def references(llm):
    """prompt -> greedy output (token ids, text) of N tokens with EOS ignored."""
    outs = llm.generate(PROMPTS, greedy(max_tokens=N, ignore_eos=True), use_tqdm=False)
    for out in outs:
        assert len(out.token_ids) == N and out.finish_reason == "length"
    return {p: (out.token_ids, out.text) for p, out in zip(PROMPTS, outs)}


def decode(llm, ids):
    return llm.tokenizer.decode(ids, skip_special_tokens=True)


def unused_token(ids):
    return next(t for t in range(3, 320) if t not in ids)


def test_conditions_that_never_trigger_change_nothing(llm, references):
    prompt = PROMPTS[0]
    ids, text = references[prompt]
    outs = llm.generate(
        [prompt] * 3,
        [
            greedy(max_tokens=N, ignore_eos=True),  # rerun: deterministic
            greedy(max_tokens=N, stop_token_ids=[unused_token(ids)], ignore_eos=True),
            greedy(max_tokens=N, stop="zzzz-not-there", ignore_eos=True),
        ],
        use_tqdm=False,
    )
    for out in outs:
        assert out.finish_reason == "length" and out.token_ids == ids and out.text == text


def test_stop_token_id_stops_at_fifth_token(llm, references):
    # a prompt whose 5th greedy token does not occur among the first four
    prompt = next((p for p in PROMPTS if references[p][0][4] not in references[p][0][:4]), None)
    assert prompt is not None, "no candidate prompt has a fresh 5th token"
    ids = references[prompt][0]
    stops = [unused_token(ids), ids[4]]
    # ignore_eos does not switch off explicit stop ids
    outs = llm.generate(
        [prompt] * 2,
        [greedy(max_tokens=N, stop_token_ids=stops, ignore_eos=flag) for flag in (False, True)],
        use_tqdm=False,
    )
    for out in outs:
        assert out.finish_reason == "stop"
        assert out.token_ids == ids[:5]  # the stop token itself is included
        assert out.metrics.num_output_tokens == 5


def _ascii_stop_string(text):
    """(p, text[p:p+2]): an ASCII 2-char string from the middle of `text` at its first occurrence,
    whose second char also first occurs there (so both complete on the same token)."""
    for p in range(3, len(text) - 3):
        candidate = text[p : p + 2]
        if (
            all(33 <= ord(c) < 127 for c in candidate)
            and text.find(candidate) == p
            and text.find(candidate[1]) == p + 1
        ):
            return p, candidate
    return None


def test_stop_string_truncates_text_before_it(llm, references):
    found = [(p, _ascii_stop_string(references[p][1])) for p in PROMPTS]
    prompt, (pos, stop) = next((p, s) for p, s in found if s is not None)
    ids, text = references[prompt]
    # the generation ends at the first token whose text completes the stop string
    k = next(k for k in range(1, N + 1) if stop in decode(llm, ids[:k]))
    # a stop string first occurring after the first one
    later = next(
        (
            text[q : q + 2]
            for q in range(pos + 2, len(text) - 1)
            if "\ufffd" not in text[q : q + 2] and text.find(text[q : q + 2]) == q
        ),
        "\x00never",
    )
    outs = llm.generate(
        [prompt] * 3,
        [
            greedy(max_tokens=N, stop=stop, ignore_eos=True),
            greedy(max_tokens=N, stop=[later, "\x00never", stop], ignore_eos=True),
            # stop[1] alone completes on the same token, one char later: the earliest position wins
            greedy(max_tokens=N, stop=[stop[1], stop], ignore_eos=True),
        ],
        use_tqdm=False,
    )
    for out in outs:
        assert out.finish_reason == "stop"
        assert out.text == text[:pos] and stop not in out.text
        assert out.token_ids == ids[:k]


@pytest.mark.parametrize("max_tokens", [1, 7])
def test_max_tokens_finishes_with_length(llm, references, max_tokens):
    prompt = PROMPTS[1]
    out = llm.generate(prompt, greedy(max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)[0]
    assert out.finish_reason == "length"
    assert len(out.token_ids) == max_tokens and out.metrics.num_output_tokens == max_tokens
    assert out.token_ids == references[prompt][0][:max_tokens]


def test_eos_stops_unless_ignore_eos(llm, references, monkeypatch):
    assert EOS in llm.engine.output_processor.eos_token_ids
    # prefer a prompt whose greedy output really produces EOS (id 2); otherwise declare its 3rd token EOS
    prompt = next((p for p in PROMPTS if EOS in references[p][0]), None)
    if prompt is None:
        prompt = PROMPTS[0]
        eos = references[prompt][0][2]
        monkeypatch.setattr(llm.engine.output_processor, "eos_token_ids", {eos})
    else:
        eos = EOS
    ids = references[prompt][0]
    k = ids.index(eos) + 1

    stopped = llm.generate(prompt, greedy(max_tokens=N), use_tqdm=False)[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == ids[:k] and stopped.token_ids[-1] == eos
    if eos == EOS:
        assert "</s>" not in stopped.text  # the special token is not rendered

    ignored = llm.generate(prompt, greedy(max_tokens=N, ignore_eos=True), use_tqdm=False)[0]
    assert ignored.finish_reason == "length" and ignored.token_ids == ids and len(ids) > k


def test_each_request_in_a_batch_obeys_its_own_stop_conditions(llm, references):
    prompt = PROMPTS[0]
    ids, text = references[prompt]
    params = [
        greedy(max_tokens=3, ignore_eos=True),
        greedy(max_tokens=N, stop_token_ids=[ids[5]], ignore_eos=True),
        greedy(max_tokens=N, ignore_eos=True),
    ]
    outs = llm.generate([prompt] * 3, params, use_tqdm=False)
    assert [o.finish_reason for o in outs] == ["length", "stop", "length"]
    assert outs[0].token_ids == ids[:3]
    assert outs[1].token_ids == ids[: ids.index(ids[5]) + 1]
    assert outs[2].token_ids == ids and outs[2].text == text
