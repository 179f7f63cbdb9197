"""Random streams: one seed gives unrelated generators per use, deterministically.

The end-to-end consequence (a draft sharing the verifier's uniforms biases the output) is tested
statistically in test_distribution.py; here: the derivation itself, and that a seeded request's
target, draft and backup generators never start alike.
"""

import torch

from ssd_engine import SamplingParams
from ssd_engine.core.streams import Stream, stream_generator, stream_seed
from ssd_engine.core.structures import Sequence


def test_stream_seeds_are_deterministic_and_distinct():
    seeds = {
        (s, stream, salt): stream_seed(s, stream, *salt)
        for s in (0, 1, 1234)
        for stream in Stream
        for salt in ((), ("engine", 7, 5), ("request", 5), ("coordinator",))
    }
    assert len(set(seeds.values())) == len(seeds)
    assert all(0 <= v < 2**63 for v in seeds.values())
    assert stream_seed(1234, Stream.DRAFT, "request", 5) == stream_seed(
        1234, Stream.DRAFT, "request", 5
    )
    assert stream_seed(1234, Stream.TARGET) != 1234  # never the user's number itself


def test_a_seeded_request_has_unrelated_target_draft_and_backup_streams():
    seq = Sequence([3, 4, 5], SamplingParams(temperature=1.0, seed=42), block_size=8)
    gens = [seq.generator, seq.draft_generator, seq.backup_generator]
    firsts = [torch.rand(8, generator=g, dtype=torch.float64) for g in gens]
    assert all(not torch.equal(a, b) for i, a in enumerate(firsts) for b in firsts[i + 1 :])
    again = Sequence([3, 4, 5], SamplingParams(temperature=1.0, seed=42), block_size=8)
    assert torch.equal(
        torch.rand(8, generator=again.generator, dtype=torch.float64), firsts[0]
    )  # reproducible
    assert (
        Sequence([3], SamplingParams(temperature=1.0), block_size=8).draft_generator is None
    )  # engine's streams


def test_draft_process_streams_differ_per_stream_and_per_readmission():
    a = stream_generator(7, Stream.DRAFT, "request", 10)
    b = stream_generator(
        7, Stream.DRAFT, "request", 12
    )  # the same sequence re-learnt with more tokens
    c = stream_generator(7, Stream.TARGET)
    draws = [torch.rand(4, generator=g) for g in (a, b, c)]
    assert not torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])
