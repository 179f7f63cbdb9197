"""Stop strings found from the output's tail (engine/output_processor.py): the same decisions as a search
of the whole output's text after every token, for a tokenizer whose tokens cut characters (one byte a
token) and a real BPE one, with the tokens arriving one by one and in speculative rounds; and the work a
token costs no longer grows with the output."""

import random

import pytest
from tiny_checkpoints import byte_tokenizer

from ssd_engine.core.sampling_params import SamplingParams
from ssd_engine.core.structures import Sequence
from ssd_engine.engine.output_processor import OutputProcessor, _cut_at_stop

FRAGMENTS = [
    "def",
    " f",
    "(x)",
    ":",
    "\n",
    "\n\n",
    "    ",
    " return",
    " x",
    " .",
    " ,",
    "'s",
    "é",
    "漢字",
    "🙂",
    "ß",
    " the",
    " end",
    "END",
    "--",
    "\t",
    "ok",
]


class WholeText(OutputProcessor):
    """The reference: every token, a search of the whole output's text."""

    def _hit_stop_string(self, seq: Sequence) -> bool:
        return _cut_at_stop(self._decode(seq), seq.params.stop) is not None


class CountingTokenizer:
    """Counts the tokens decoded."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.decoded = tokenizer, 0

    def decode(self, ids, **kwargs) -> str:
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, **kwargs)


def _tokenizers(smollm2_dir=None) -> dict:
    tokenizers = {"bytes": byte_tokenizer()}
    if smollm2_dir is not None:
        from transformers import AutoTokenizer

        tokenizers["smollm2"] = AutoTokenizer.from_pretrained(smollm2_dir)
    return tokenizers


def _run(processor: OutputProcessor, ids: list[int], stop: list[str], rounds: list[int]):
    """Feed `ids` in rounds of the given sizes; -> (tokens kept, finish reason, final text)."""
    seq = Sequence(
        [5, 6, 7], SamplingParams(stop=stop, max_tokens=len(ids) + 1, ignore_eos=True), 16
    )
    at = 0
    for size in rounds:
        processor.append(seq, ids[at : at + size])
        at += size
        if seq.finish_reason is not None:
            break
    return seq.num_output_tokens, seq.finish_reason, processor.final_text(seq)


def _case(rng: random.Random, tokenizer):
    text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(5, 120)))
    ids = tokenizer.encode(text, add_special_tokens=False)
    for _ in range(rng.randint(0, 3)):  # special tokens, which decode to nothing
        ids.insert(rng.randint(0, len(ids)), tokenizer.eos_token_id)
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    stops = []
    for _ in range(rng.randint(1, 3)):
        # one that occurs: a piece of the text, multibyte ones too
        if rng.random() < 0.75 and whole:
            start = rng.randrange(len(whole))
            stops.append(whole[start : start + rng.randint(1, 12)])
        else:
            stops.append(rng.choice(["zzz", "END--END", "漢字漢字漢字", "\n\n\n\n"]))
    rounds, left = [], len(ids)
    while left > 0:
        rounds.append(rng.choice([1, 1, 2, 3, 5]))
        left -= rounds[-1]
    return ids, stops, rounds


@pytest.mark.parametrize("name", ["bytes", "smollm2"])
def test_the_tail_search_decides_as_the_whole_texts(name, request):
    tokenizer = _tokenizers(request.getfixturevalue("smollm2_dir") if name == "smollm2" else None)[
        name
    ]
    rng = random.Random(name)
    hits = 0
    for _ in range(300):
        ids, stops, rounds = _case(rng, tokenizer)
        expected = _run(WholeText(tokenizer, set(), 10**6), ids, stops, rounds)
        assert _run(OutputProcessor(tokenizer, set(), 10**6), ids, stops, rounds) == expected, (
            ids,
            stops,
        )
        hits += expected[1] == "stop"
    assert hits > 150  # most cases stop, many early in a long output (the tail decides there)


def test_a_token_costs_the_same_decoding_late_in_a_long_output():
    """1,500 tokens with a stop string that never comes: the whole-text search decodes ~1.1 M tokens in
    all; the tail search a bounded number a token."""
    tokenizer = byte_tokenizer()
    ids = tokenizer.encode("def f(x):\n    return x . 漢字 🙂\n" * 60, add_special_tokens=False)[
        :1500
    ]
    costs = {}
    for kind in (WholeText, OutputProcessor):
        counting = CountingTokenizer(tokenizer)
        kept, reason, _ = _run(kind(counting, set(), 10**6), ids, ["never here"], [1] * len(ids))
        assert (kept, reason) == (len(ids), None)
        costs[kind] = counting.decoded
    assert costs[WholeText] > 1_000_000
    assert costs[OutputProcessor] < 200 * len(ids)
