"""SD's K chosen every step (`speculation_per_step="goodput"`, ssd_engine/engine/step_choice.py).

- The rule: both arms tried (a few steady steps each), then the faster; the other re-tried every EXPLORE_EVERY steps of a batch
  size (K sooner where it lost a close call); a new batch size reads the nearest one's rates; K not first tried above a batch size where it
  lost; a batch holding a seeded request runs K.
- Exactness across switches: with the choice forced to a random K or 0 every step, greedy SD gives
  AR's tokens, and at T = 1 with every penalty (history-dependent rows) SD's (t1, t2, t3) follow the
  target's law (pair, law and statistics of test_penalties.py; requests in waves, so each wave's steps
  switch in their own pattern).
- Negative control: a broken switch, whose first speculated step after a plain one reports q rows
  that are not the ones its drafts were drawn from (uniform), is rejected.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from exact_law import law_table
from small_pair import DIST_PROMPT, engine_options
from stats_helpers import check_law, fit

from ssd_engine import LLM, SamplingParams
from ssd_engine.core.structures import Sequence
from ssd_engine.engine import step_choice
from ssd_engine.engine.step_choice import StepChoice
from ssd_engine.speculative.sd import SyncDraft

STRONG = dict(
    temperature=1.0,
    repetition_penalty=1.6,
    presence_penalty=1.2,
    frequency_penalty=0.8,
    logit_bias={4: 1.5, 8: -1.0},
)
ALPHA, DESIGN_POWER, TV = 1e-3, 0.8, 0.03
K, N, WAVE = 2, 15_000, 1_500


def _seqs(n: int, seeded: bool = False) -> list[Sequence]:
    return [Sequence([1, 2], SamplingParams(seed=7 if seeded else None), 4) for _ in range(n)]


class _Draft:
    """SD's draft as the choice reads it: how far behind it is, what a token of catch-up costs."""

    def __init__(self, lag: int = 0, s_per_token: float | None = None) -> None:
        self.behind, self.catch_up_s_per_token = lag, s_per_token

    def lag(self, seqs) -> int:
        return self.behind


def test_both_arms_are_tried_then_the_faster_runs_and_the_other_is_retried():
    choice, steady = StepChoice(k=3), _Draft()
    batch = _seqs(5)
    tried = []
    # each arm runs a few steady steps before it is compared
    for _ in range(2 * step_choice.MIN_SAMPLES):
        tried.append(choice.choose(batch, steady))
        choice.record(
            tried[-1], 5, 20 if tried[-1] == 0 else 5, 1.0
        )  # plain decoding emits more per second here
    assert sorted(Counter(tried).items()) == [
        (0, step_choice.MIN_SAMPLES),
        (3, step_choice.MIN_SAMPLES),
    ]
    assert (
        tried[: step_choice.MIN_SAMPLES] == [tried[0]] * step_choice.MIN_SAMPLES
    )  # one arm's run, then the other's
    every = step_choice.EXPLORE_EVERY["speculate"]
    runs = []
    for _ in range(every):
        runs.append(choice.choose(batch, steady))
        choice.record(runs[-1], 5, 20 if runs[-1] == 0 else 5, 1.0)
    assert (
        tried[0] == 3 and runs.count(3) == 1
    )  # K ran first; re-tried once, EXPLORE_EVERY steps after its last
    assert runs.index(3) == every - step_choice.MIN_SAMPLES
    assert (
        choice.choose(_seqs(5) + _seqs(1, seeded=True), steady) == 3
    )  # a seeded request's batch runs K
    assert choice.choose(_seqs(40), steady) == 0  # a new batch size reads the nearest one's rates


def test_a_catch_up_runs_only_where_the_tokens_left_pay_for_it():
    """K measured faster (30 against 20 tokens/s) but the draft 1,000 tokens behind at 10 ms a token:
    10 s of catch-up. Five sequences with 16 tokens left save 80/20 - 80/30 = 1.3 s: plain. With 1,000
    left each they save 83 s: K. A step that caught up never feeds K's steady rate; unmeasured, K runs;
    and K is re-measured once its catch-up is a small share of the time since it last ran."""
    choice = StepChoice(k=3)
    for k, rate in ((3, 30.0), (0, 20.0)):
        for _ in range(step_choice.MIN_SAMPLES):
            choice.choose(_seqs(5), _Draft())
            choice.record(k, 5, rate, 1.0)
    behind = _Draft(lag=1000, s_per_token=0.01)
    short = [Sequence([1, 2], SamplingParams(max_tokens=16), 4) for _ in range(5)]
    long = [Sequence([1, 2], SamplingParams(max_tokens=1000), 4) for _ in range(5)]
    assert choice.choose(short, behind) == 0
    assert choice.choose(long, behind) == 3 and choice.caught_up
    choice.record(3, 5, 1.0, 10.0)  # the catch-up step's own rate: 0.1 tokens/s, not K's
    assert choice.arms[(5).bit_length(), 3].rate == 30.0
    assert (
        choice.choose(long + long, behind) == 0
    )  # ten sequences: five's rates promise nothing there
    assert (
        choice.choose(short, _Draft(lag=1000)) == 3
    )  # the catch-up's cost not measured yet: K measures it
    later = (
        step_choice.time.monotonic() + 10.0 / step_choice.EXPLORE_SHARE + 1
    )  # 10 s of catch-up: a share
    with pytest.MonkeyPatch.context() as patch:  # of the time since K last ran at this batch size
        patch.setattr(step_choice.time, "monotonic", lambda: later)
        assert choice.choose(short, behind) == 3  # re-measured, although its rates say plain
    assert (
        choice.choose(short, _Draft(lag=2 * 5, s_per_token=0.01)) == 3
    )  # steady: no catch-up to pay for


def test_k_is_not_first_tried_at_a_larger_batch_than_one_where_it_lost():
    """K lost at 5 sequences (10 against 20 tokens/s): at 12 it is never first tried (its first try
    would catch the draft up over all 12); at 2, below, it is; where K won at 5, it is tried at 12."""

    def measured(k_rate: float) -> StepChoice:
        choice = StepChoice(k=3)
        for k, rate in ((3, k_rate), (0, 20.0)):
            for _ in range(step_choice.MIN_SAMPLES):
                choice.choose(_seqs(5), _Draft())
                choice.record(k, 5, rate, 1.0)
        return choice

    lost, won = measured(10.0), measured(30.0)
    assert 3 not in [lost.choose(_seqs(12), _Draft()) for _ in range(3 * step_choice.FIRST_LOOK)]
    assert 3 in [lost.choose(_seqs(2), _Draft()) for _ in range(3 * step_choice.FIRST_LOOK)]
    assert 3 in [won.choose(_seqs(12), _Draft()) for _ in range(3 * step_choice.FIRST_LOOK)]


@pytest.fixture
def random_switches(monkeypatch):
    """Every step's K drawn at random (seeded), whatever the batch; the draws made, in order."""
    rng, drawn = random.Random(5), []

    def choose(self, running):
        drawn.append(rng.choice((self.k, 0)))
        return drawn[-1]

    monkeypatch.setattr(StepChoice, "_choose", choose)
    monkeypatch.setattr(StepChoice, "_catch_up_pays", lambda *_: True)  # every drawn K runs
    return drawn


def test_greedy_sd_switching_at_random_steps_gives_ars_tokens(tiny_model_dir, random_switches):
    target, draft = tiny_model_dir("qwen2"), tiny_model_dir("qwen2", seed=1)
    prompts = [list(range(5, 12)), list(range(40, 75)), [7, 8, 9]]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3)
    with LLM(target, num_threads=1) as llm:
        expected = [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    with LLM(
        target,
        draft_model=draft,
        speculative_mode="sd",
        num_speculative_tokens=3,
        num_threads=1,
        speculation_per_step="goodput",
    ) as llm:
        assert [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == expected
        steps = llm.engine.speculation_metrics()["steps_by_k"]
        llm.engine.reset_speculation_metrics()
        assert llm.engine.speculation_metrics()["steps_by_k"] == {}
    assert steps.get(0, 0) > 0 and steps.get(3, 0) > 0 and set(random_switches) == {0, 3}


def _sample_in_waves(small_pair) -> tuple[Counter, dict]:
    target, draft = small_pair
    params = SamplingParams(max_tokens=3, ignore_eos=True, **STRONG)
    options = engine_options(
        seed=41,
        draft_model=draft,
        speculative_mode="sd",
        num_speculative_tokens=K,
        speculation_per_step="goodput",
    )
    outputs = []
    with LLM(target, **options) as llm:
        engine = llm.engine
        for _ in range(N // WAVE):
            seqs = [engine.add_request(DIST_PROMPT, params) for _ in range(WAVE)]
            while engine.has_unfinished():
                engine.step()
            outputs += [tuple(s.output_token_ids) for s in seqs]
        return Counter(outputs), llm.speculation_metrics()


@pytest.fixture(scope="module")
def penalised_law(small_pair):
    return law_table(small_pair[0], DIST_PROMPT, STRONG)


def test_sd_switching_at_random_steps_follows_the_penalised_law(
    small_pair, penalised_law, random_switches
):
    sample, metrics = _sample_in_waves(small_pair)
    assert set(metrics["steps_by_k"]) == {0, K}
    check_law(
        "SD, K or 0 at random steps",
        sample,
        penalised_law(3),
        metrics,
        TV,
        ALPHA,
        DESIGN_POWER,
        acceptance=(0.1, 0.95),
    )


def test_negative_control_a_switch_reporting_other_q_rows_is_rejected(
    small_pair, penalised_law, random_switches, monkeypatch
):
    real = SyncDraft.propose

    def propose(self, batch, decoding):
        proposal = real(self, batch, decoding)
        after_plain = len(random_switches) >= 2 and random_switches[-2] == 0
        if proposal is not None and proposal.probs is not None and after_plain:
            uniform = torch.full_like(proposal.probs, 0.0)
            uniform[..., : self.proposable_vocab] = 1.0 / self.proposable_vocab
            proposal = type(proposal)(proposal.tokens, uniform, proposal.num_draft)
        return proposal

    monkeypatch.setattr(SyncDraft, "propose", propose)
    sample, _ = _sample_in_waves(small_pair)
    stat, dof, p, _ = fit(sample, penalised_law(3))
    print(
        f"\nNEGATIVE CONTROL [q rows not the drafts' after a switch]: chi2 = {stat:.2f}, dof = {dof}, p = {p:.3g}"
    )
    assert p < ALPHA


def test_an_arms_first_steps_one_time_costs_do_not_decide_it():
    """K's first step at a batch size is 50x slow (a GPU compiling its kernels); then K is faster per
    token than plain decoding. After both arms' first runs, K is chosen."""
    choice, steady = StepChoice(k=3), _Draft()
    batch = _seqs(1)
    first_k = True
    runs = []
    for _ in range(4 * step_choice.MIN_SAMPLES):
        runs.append(choice.choose(batch, steady))
        seconds = 1.0
        if runs[-1] and first_k:
            seconds, first_k = 50.0, False
        choice.record(
            runs[-1], 1, 3 if runs[-1] else 1, seconds
        )  # K: 3 tokens a step, plain 1, same time
    assert runs[-2 * step_choice.MIN_SAMPLES :] == [3] * (2 * step_choice.MIN_SAMPLES)


def test_k_losing_a_close_call_is_retried_sooner():
    """K's first steps came out 5% slower than plain decoding's (a speculated step's tokens are a draw):
    K is re-tried within a quarter of EXPLORE_EVERY's steps, not after all of them."""
    choice, steady = StepChoice(k=3), _Draft()
    batch = _seqs(1)
    runs = []
    for _ in range(2 * step_choice.MIN_SAMPLES + step_choice.EXPLORE_EVERY["speculate"] // 4):
        runs.append(choice.choose(batch, steady))
        choice.record(runs[-1], 1, 1, 1.0 if runs[-1] == 0 else 1.05)  # K: 1 token a step in 1.05 s
    first_look = 2 * step_choice.MIN_SAMPLES
    assert sorted(Counter(runs[:first_look]).values()) == [step_choice.MIN_SAMPLES] * 2
    assert 3 in runs[first_look:]


def test_a_step_that_reads_prompt_tokens_decodes_plainly_unless_a_seeded_request_runs():
    """K is chosen where it was measured, on decode-only steps; a step reading a prompt's chunk
    decodes plainly, so the drafts do not hold back that prompt's first token."""
    choice, steady = StepChoice(k=3), _Draft()
    assert choice.choose(_seqs(4), steady, prefill=True) == 0
    assert choice.choose(_seqs(4), steady) == 3  # nothing measured yet: K first
    assert choice.choose(_seqs(4) + _seqs(1, seeded=True), steady, prefill=True) == 3
    assert choice.summary()["steps_by_k"] == {0: 1, 3: 2}


def test_the_scheduler_says_when_the_next_step_reads_prompt_tokens(tiny_model_dir):
    with LLM(tiny_model_dir("qwen2"), max_num_seqs=2, num_threads=1) as llm:
        scheduler = llm.engine.scheduler
        assert not scheduler.prefill_pending()
        for prompt in ([5, 6, 7], [8, 9], [10, 11, 12]):
            llm.engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=4))
        assert scheduler.prefill_pending()  # waiting requests and room in the batch
        llm.engine.step()  # both places taken, each prompt read whole
        assert not scheduler.prefill_pending()  # the third waits for a place
