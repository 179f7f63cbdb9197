"""SSD end to end: the draft runs in its own process (pinned to its own core), the coordinator
verifies its speculations. Greedy output must be token-identical to transformers' greedy output
in every regime, and nothing the draft process does (die, stall) may lose a request.

Regimes, each at batch 1, 3 and 8 (one engine per regime, the three batches in turn):
- forced all-hit: a self-draft (the target itself, without embedding padding so it can propose
  every token the target emits) with fan-out >= 1 at k = K: every round accepts all K drafts and
  its bonus is the draft's top-1, which the cache holds; only first rounds miss;
- forced all-miss: fan-out 0 (no cache), with the just-in-time primary and with the fast backup;
- natural: a noisy draft (the target's weights plus noise) with fan-out 1.
Also: preemption and draft block shortage; EOS / max_tokens inside an accepted run; killing the
draft by pid mid-batch; stalling it (SIGSTOP) past its deadline.
"""

import os
import signal
import time

import pytest
from cpu_features import NEEDS_BF16
from process_helpers import engine_children
from test_speculative_decoding import (  # noqa: F401 (fixtures)
    GREEDY,
    _derived,
    _prompts,
    _with_eos,
    greedy_oracle,
    noisy_draft,
    target,
    target_nopad,
)

from ssd_engine import LLM, SamplingParams

COMMON = dict(num_threads=1, block_size=8, speculative_mode="ssd")


@pytest.fixture(scope="module")
def oracles(target, target_nopad):
    return {target: greedy_oracle(target), target_nopad: greedy_oracle(target_nopad)}


def _ssd(target: str, draft: str, **options) -> LLM:
    return LLM(target, draft_model=draft, **{**COMMON, "num_speculative_tokens": 3, **options})


def _children() -> set[int]:
    return engine_children(os.getpid())


REGIMES = {
    "forced_hit": (
        "nopad",
        dict(ssd_fanout="1,1,1,2", ssd_fallback="jit", draft_dtype="fp32"),
    ),  # draft = target
    "forced_miss_jit": ("noisy", dict(ssd_fanout=0, ssd_fallback="jit")),
    "forced_miss_fast": ("noisy", dict(ssd_fanout=0, ssd_fallback="fast")),
    "natural": ("noisy", dict(ssd_fanout=1)),
}


@pytest.mark.parametrize("regime", list(REGIMES))
def test_greedy_ssd_matches_transformers(target, target_nopad, noisy_draft, oracles, regime):
    kind, options = REGIMES[regime]
    tgt, drf = (target_nopad, target_nopad) if kind == "nopad" else (target, noisy_draft)
    with _ssd(tgt, drf, **options) as llm:
        pid = llm.engine.speculator.pid
        assert pid in _children()
        for batch in (1, 3, 8):
            outs = llm.generate(_prompts(batch), GREEDY, use_tqdm=False)
            assert [o.token_ids for o in outs] == oracles[tgt][:batch], f"batch {batch}"
        m = llm.speculation_metrics()
    assert pid not in _children()  # close() reaped the draft process
    sources = m["speculations_by_source"]
    assert m["draft_failures"] == []
    if regime == "forced_hit":
        assert m["acceptance_rate"] == 1.0
        assert m["cache_hit_rate_warm"] == 1.0 and sources["hit"] > 8 * sources["jit"]
    elif regime.startswith("forced_miss"):
        assert m["cache_hit_rate"] == 0 and set(sources) == {regime.rsplit("_", 1)[1]}
    else:
        assert (
            0 < m["cache_hit_rate"] < 1
            and 0 < m["acceptance_on_hits"]
            and 0 < m["acceptance_on_misses"]
        )


@pytest.mark.parametrize("draft_dtype", [pytest.param("bf16", marks=NEEDS_BF16), "int4"])
def test_greedy_ssd_with_a_low_precision_draft_matches_transformers(
    target, noisy_draft, oracles, draft_dtype
):
    with _ssd(target, noisy_draft, ssd_fanout=2, draft_dtype=draft_dtype) as llm:
        assert llm.engine.execution()["draft_format"].startswith(draft_dtype)
        outs = llm.generate(_prompts(8), GREEDY, use_tqdm=False)
        m = llm.speculation_metrics()
    assert [o.token_ids for o in outs] == oracles[target]
    assert m["draft_failures"] == [] and 0 < m["cache_hit_rate"] and 0 < m["acceptance_on_hits"]


@pytest.mark.parametrize("num_kv_blocks", [14, 18])
def test_greedy_ssd_under_preemption_and_draft_block_shortage(
    target, noisy_draft, oracles, num_kv_blocks
):
    """Few blocks: the target preempts (the draft forgets the sequence and relearns it) and the
    draft's trunks run short (it replies 'no speculation' for a sequence: a plain target step)."""
    with _ssd(target, noisy_draft, num_kv_blocks=num_kv_blocks, ssd_fanout=1) as llm:
        outs = llm.generate(_prompts(8), GREEDY, use_tqdm=False)
        assert llm.engine.scheduler.num_preemptions > 0
        sources = llm.speculation_metrics()["speculations_by_source"]
    assert [o.token_ids for o in outs] == oracles[target]
    # at 18 blocks the draft (no prefix sharing: prompts 1, 3, 5, 7 share 20 tokens on the target)
    # also runs short, and those sequences take plain target steps
    assert num_kv_blocks != 18 or sources.get("none", 0) > 0


def test_stops_inside_accepted_runs_match_ar(target_nopad, oracles, tmp_path):
    """Self-draft accepts whole runs; EOS and max_tokens that fall inside one cut it where AR stops."""
    reference = oracles[target_nopad]
    eos = reference[1][10]  # appears mid-output: the run containing it must stop there
    with_eos = _with_eos(target_nopad, str(tmp_path / "eos"), eos)
    params = [SamplingParams(temperature=0, max_tokens=m) for m in (7, 13, 29)]
    prompts = _prompts(3)
    with LLM(with_eos, **{**COMMON, "speculative_mode": "ar"}) as llm:
        expected = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with _ssd(with_eos, with_eos, ssd_fanout=2) as llm:
        got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == expected
    assert any(o.finish_reason == "stop" for o in got) and any(
        o.finish_reason == "length" for o in got
    )


def _run_with_fault(llm: LLM, prompts, fault, after_steps: int = 4):
    engine = llm.engine
    seqs = [engine.add_request(p, GREEDY) for p in prompts]
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if steps == after_steps:
            fault(engine.speculator.pid)
    return [s.output_token_ids for s in seqs]


def test_killing_the_draft_mid_batch_loses_nothing(target, noisy_draft, oracles, caplog):
    with _ssd(target, noisy_draft, ssd_fanout=1) as llm:
        client = llm.engine.speculator
        outs = _run_with_fault(llm, _prompts(8), lambda pid: os.kill(pid, signal.SIGKILL))
        m = llm.speculation_metrics()
        assert not client.alive and client.process.poll() is not None
    assert outs == oracles[target]
    assert len(m["draft_failures"]) == 1 and "pid" in m["draft_failures"][0]
    assert m["speculations_by_source"]["local"] > 0
    assert sum("local n-gram" in r.getMessage() for r in caplog.records) == 1  # one warning
    assert client.pid not in _children()


def test_a_stalled_draft_is_abandoned_after_its_deadline(target, noisy_draft, oracles):
    started = time.monotonic()
    with _ssd(target, noisy_draft, ssd_fanout=1, draft_timeout_s=1.0) as llm:
        client = llm.engine.speculator
        outs = _run_with_fault(llm, _prompts(3), lambda pid: os.kill(pid, signal.SIGSTOP))
        m = llm.speculation_metrics()
    assert outs == oracles[target][:3]
    assert len(m["draft_failures"]) == 1 and "imed out" in m["draft_failures"][0]
    assert client.pid not in _children()  # a stopped process is killed and reaped too
    assert time.monotonic() - started < 60


def test_ssd_needs_a_matching_tokenizer_and_reports_a_failed_start(target, noisy_draft, tmp_path):
    broken = _derived(
        noisy_draft,
        str(tmp_path / "broken"),
        lambda s: {k: v for k, v in s.items() if "lm_head" not in k and "layers.0." not in k},
    )
    before = _children()
    with pytest.raises(RuntimeError, match="draft process .* exited with code"):
        _ssd(target, broken)
    assert _children() <= before


@pytest.mark.parametrize("fallback", ["jit", "fast"])
def test_seeded_ssd_reproducible_alone_and_in_batch(target, noisy_draft, fallback):
    """A seeded request's tokens depend on its seed alone: not on the batch around it nor on the
    engine's seed. (Under ssd_fallback="auto" the backup chosen for a round depends on the batch
    size and on measured timings, so a seeded request reproduces for a fixed fallback.)"""
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    prompts = _prompts(4)
    options = dict(ssd_fanout=1, ssd_fallback=fallback)
    with _ssd(target, noisy_draft, **options) as llm:
        alone = llm.generate([prompts[1]], seeded, use_tqdm=False)[0]
        mixed = llm.generate(prompts, [other, seeded, other, other], use_tqdm=False)
        metrics = llm.speculation_metrics()
    with _ssd(target, noisy_draft, seed=99, **options) as fresh:
        again = fresh.generate([prompts[3], prompts[1]], [other, seeded], use_tqdm=False)
    assert mixed[1].token_ids == alone.token_ids == again[1].token_ids
    assert alone.spec_metrics["rounds"] > 0 and metrics["draft_failures"] == []
    assert (
        len({tuple(o.token_ids) for o in (mixed[0], mixed[2], mixed[3], again[0])}) > 1
    )  # unseeded ones sample
