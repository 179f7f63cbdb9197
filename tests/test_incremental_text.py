"""A streamed request's text, decoded incrementally (engine/incremental_text.py): after every round
it equals the whole output's decode, for a tokenizer whose tokens cut characters (one byte a token)
and a real BPE one, special tokens included; and a round's decoding no longer grows with the output."""

import random

import pytest
from test_output_processor import FRAGMENTS, CountingTokenizer
from tiny_checkpoints import byte_tokenizer

from ssd_engine.engine.incremental_text import IncrementalText


def _tokenizer(name: str, request):
    if name == "bytes":
        return byte_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(request.getfixturevalue("smollm2_dir"))


@pytest.mark.parametrize("name", ["bytes", "smollm2"])
def test_the_text_equals_the_whole_decode_after_every_round(name, request):
    tokenizer = _tokenizer(name, request)
    rng = random.Random(name)
    counting = CountingTokenizer(tokenizer)
    for _ in range(40):
        ids = tokenizer.encode(
            "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(20, 200))),
            add_special_tokens=False,
        )
        for _ in range(rng.randint(0, 4)):  # special tokens, which decode to nothing
            ids.insert(rng.randint(0, len(ids)), tokenizer.eos_token_id)
        text, end = IncrementalText(counting), 0
        while end < len(ids):
            end = min(len(ids), end + rng.choice([1, 1, 2, 3, 5]))
            assert text.of(ids[:end]) == tokenizer.decode(ids[:end], skip_special_tokens=True), (
                ids[:end],
                name,
            )


def test_a_round_decodes_the_same_few_tokens_late_in_a_long_output():
    tokenizer = byte_tokenizer()
    ids = tokenizer.encode("def f(x):\n    return x . 漢字 🙂\n" * 60, add_special_tokens=False)[
        :1500
    ]
    counting = CountingTokenizer(tokenizer)
    text = IncrementalText(counting)
    decoded = []  # tokens decoded in each 500 rounds: the whole output each round would be 0.1, 0.4, 0.6 M
    for end in range(1, len(ids) + 1):
        text.of(ids[:end])
        if end % 500 == 0:
            decoded.append(counting.decoded - sum(decoded))
    assert text.text == tokenizer.decode(ids)
    assert decoded[2] <= 1.1 * decoded[1] and decoded[2] < 200 * 500, decoded
