"""SSD with the draft as a thread of the engine process (`ssd_draft_host="thread"`, draft_thread.py).

The thread runs the draft process's loop over the same encoded messages, so everything the process
guarantees must hold: greedy output equal to transformers', seeded sampling identical to the process
host's token for token (same streams, same rounds), no child process, nothing left running after
close(), and a draft that raises mid-batch loses no request (the engine falls back).
"""

import threading

import pytest
from test_speculative_decoding import (  # noqa: F401 (fixtures)
    GREEDY,
    _prompts,
    greedy_oracle,
    noisy_draft,
    target,
    target_nopad,
)
from test_ssd import _children

from ssd_engine import LLM, SamplingParams
from ssd_engine.speculative.ssd.draft.server import DraftServer

COMMON = dict(
    num_threads=1,
    block_size=8,
    speculative_mode="ssd",
    num_speculative_tokens=3,
    ssd_fallback="jit",
)

# these run on CPU only (a GPU runs the thread in test_cuda_path.py, through scripts/gpu_check.sh); the
# placement checker fails each in CI where a host tensor would meet the device
CHECK_PLACEMENT = True


def _draft_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "ssd-draft"]


@pytest.mark.parametrize("kind", ["self_draft", "noisy"])
def test_greedy_ssd_on_a_draft_thread_matches_transformers(target, target_nopad, noisy_draft, kind):
    tgt, drf = (target_nopad, target_nopad) if kind == "self_draft" else (target, noisy_draft)
    expected = greedy_oracle(tgt)
    before = _children()
    with LLM(
        tgt,
        draft_model=drf,
        ssd_draft_host="thread",
        ssd_fanout="1,1,1,2",
        draft_dtype="fp32",
        **COMMON,
    ) as llm:
        assert llm.engine.speculator.pid is None and _children() == before  # no process was started
        assert len(_draft_threads()) == 1
        for batch in (1, 3):
            outs = llm.generate(_prompts(batch), GREEDY, use_tqdm=False)
            assert [o.token_ids for o in outs] == expected[:batch], f"batch {batch}"
        m = llm.speculation_metrics()
    assert not _draft_threads()  # close() ended it
    assert m["draft_failures"] == [] and m["cache_hit_rate"] > 0
    if kind == "self_draft":
        assert m["acceptance_rate"] == 1.0


def test_seeded_sampling_is_the_same_on_a_thread_as_in_a_process(target, noisy_draft):
    """Same seeds, same streams, same rounds: the host of the draft changes nothing in the output.

    The draft's format is pinned (auto picks one per CPU, and an int draft of this tiny pair hit no
    cache entry on one), and T = 0.3 with 32 tokens gives the hits this test is about: ~8 of ~36 rounds
    (a flatter T = 0.8 gave 0 or 1 in 16)."""
    params = [
        SamplingParams(temperature=0.3, seed=s, max_tokens=32, ignore_eos=True) for s in (1, 2, 3)
    ]
    outputs, sources = {}, {}
    for host in ("process", "thread"):
        with LLM(
            target,
            draft_model=noisy_draft,
            ssd_draft_host=host,
            ssd_fanout=4,
            draft_dtype="fp32",
            **COMMON,
        ) as llm:
            outputs[host] = [o.token_ids for o in llm.generate(_prompts(3), params, use_tqdm=False)]
            sources[host] = llm.speculation_metrics()["speculations_by_source"]
    assert sources["process"].get("hit", 0) >= 2, sources
    assert outputs["thread"] == outputs["process"] and sources["thread"] == sources["process"]


def test_a_draft_thread_that_raises_loses_no_request(target, noisy_draft, monkeypatch, caplog):
    expected = greedy_oracle(target)
    real_lookup, calls = DraftServer.lookup, []

    def failing_lookup(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("injected draft failure")
        return real_lookup(self, *args, **kwargs)

    monkeypatch.setattr(DraftServer, "lookup", failing_lookup)
    with LLM(
        target, draft_model=noisy_draft, ssd_draft_host="thread", ssd_fanout=1, **COMMON
    ) as llm:
        outs = llm.generate(_prompts(8), GREEDY, use_tqdm=False)
        m = llm.speculation_metrics()
        assert not llm.engine.speculator.alive
    assert [o.token_ids for o in outs] == expected
    assert len(m["draft_failures"]) == 1 and "injected draft failure" in m["draft_failures"][0]
    assert m["speculations_by_source"]["local"] > 0
    assert sum("local n-gram" in r.getMessage() for r in caplog.records) == 1
    assert not _draft_threads()


@pytest.mark.parametrize(
    "choice, draft, target, host",
    [
        (
            "auto",
            "cuda:0",
            "cuda",
            "thread",
        ),  # one GPU lent: the draft shares it, a stream overlaps the target
        ("auto", "cuda", "cuda:0", "thread"),
        ("auto", "cuda:1", "cuda:0", "process"),  # its own GPU: the production shape
        ("auto", "cpu", "cpu", "process"),  # its own cores
        ("process", "cuda:0", "cuda:0", "process"),
        ("thread", "cpu", "cpu", "thread"),
    ],
)
def test_auto_draft_host_is_a_thread_only_on_a_shared_gpu(choice, draft, target, host):
    from ssd_engine.speculative.setup import draft_host

    assert draft_host(choice, draft, target) == host
