"""SD's K chosen every step (`speculation_per_step="goodput"`, ssd_engine/engine/step_choice.py).

- The rule: the starting K, then plain decoding, run a few steady steps each; then the K predicted
  fastest (a row's tokens from the running acceptance over its step time, measured or interpolated)
  runs, and its neighbours and plain decoding are re-tried now and then (sooner after a close call);
  a new batch size reads the nearest one's rates; no K first tried above a batch size where plain
  won; a batch holding a seeded request drafts the starting K; a catch-up runs where it pays.
- Exactness across switches: with the choice forced to a random K from 0 up every step, greedy SD
  gives AR's tokens, and at T = 1 with every penalty (history-dependent rows) SD's (t1, t2, t3)
  follow the target's law (pair, law and statistics of test_penalties.py; requests in waves, so each
  wave's steps switch in their own pattern).
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


def _run(choice: StepChoice, rows: int, steps: int, step_s, accepted, draft=None) -> list[int]:
    """`steps` steps of a batch of `rows`: K = k takes step_s(k) seconds, and each row accepts
    accepted(k) of its k drafts; -> the K chosen at each step."""
    draft, batch, runs = draft or _Draft(), _seqs(rows), []
    for _ in range(steps):
        k = choice.choose(batch, draft)
        runs.append(k)
        choice.record(k, rows, step_s(k), [(min(accepted(k), k), k)] * rows if k else [])
    return runs


def test_the_start_then_plain_then_the_predicted_best_runs_and_its_neighbours_are_retried():
    """Drafts always accepted, a draft token costing a fifth of a plain step: tokens per second
    (k + 1) / (1 + 0.2 k) grow with k. The starting K = 1 and plain decoding each run a few steps;
    K = 3, never run but predicted best from them, runs next and stays; its neighbour K = 2 and
    plain decoding are re-tried now and then."""
    choice = StepChoice(k=3, start=1)
    runs = _run(choice, 5, 24 + 300, lambda k: 1 + 0.2 * k, lambda k: k)
    few = step_choice.MIN_SAMPLES
    assert runs[:few] == [1] * few and runs[few : 2 * few] == [0] * few
    assert runs[2 * few : 3 * few] == [3] * few
    later = Counter(runs[3 * few :])
    assert later[2] == few and 1 <= later[0] <= 300 // step_choice.EXPLORE_EVERY["plain"] + 1
    assert later.most_common(1)[0][0] == 3 and set(later) == {0, 2, 3}
    assert choice.choose(_seqs(5) + _seqs(1, seeded=True), _Draft()) == 1  # seeded: the start
    assert choice.choose(_seqs(40), _Draft()) == 3  # a new batch size reads the nearest one's rates


def test_plain_decoding_runs_where_drafts_fail_and_speculation_is_still_retried():
    """Every draft rejected: K = 3 measured, then plain decoding, which wins and stays; the K next
    to it, predicted a fifth slower, is tried within EXPLORE_EVERY's steps but not within half of
    them (for a few steps, being new there)."""
    choice = StepChoice(k=3)
    every = step_choice.EXPLORE_EVERY["speculate"]
    runs = _run(choice, 5, 16 + every + 20, lambda k: 1 + 0.2 * k, lambda k: 0)
    few = step_choice.MIN_SAMPLES
    assert runs[:few] == [3] * few and set(runs[few : 2 * few + every // 2]) == {0}
    assert runs.count(1) == few and 2 not in runs and 3 not in runs[few:]


def test_a_row_emits_the_bonus_and_each_accepted_prefix():
    """Position 1 accepted 3 times in 4, position 2 once in the 3 rows that reached it: a row
    emits 1 + a1 + a1 a2 tokens at K = 2; a position never reached reads as the one before."""
    acceptance = step_choice.Acceptance(3)
    acceptance.add([(2, 2), (1, 2), (1, 2), (0, 2)])
    decay, prior = step_choice.ACCEPTANCE_DECAY, step_choice.PRIOR_WEIGHT
    assert decay < 1  # counts added after the decay: the first step's are whole
    a1 = (3 + prior * step_choice.PRIOR_ACCEPTANCE) / (4 + prior)
    a2 = (1 + prior * a1) / (3 + prior)
    assert acceptance.tokens(0) == 1.0
    assert acceptance.tokens(2) == pytest.approx(1 + a1 + a1 * a2)
    assert acceptance.tokens(3) == pytest.approx(1 + a1 + a1 * a2 + a1 * a2 * a2)


def test_a_catch_up_runs_only_where_the_tokens_left_pay_for_it():
    """K = 3 measured faster (5 rows, every draft accepted: about 4 tokens a row in 1 s, plain 1 in
    0.5 s) but the draft 1,000 tokens behind at 10 ms a token: 10 s of catch-up. Five sequences with
    16 tokens left save about 80 / 10 - 80 / 20 = 4 s: plain. With 1,000 left each they save far
    more: K. A step that caught up never feeds K's steady time; unmeasured, K runs; and K is re-
    measured once its catch-up is a small share of the time since it last ran."""
    choice = StepChoice(k=3)
    _run(choice, 5, 2 * step_choice.MIN_SAMPLES, lambda k: 1.0 if k else 0.5, lambda k: k)
    assert choice.arms[(5).bit_length(), 3].step_s == 1.0
    behind = _Draft(lag=1000, s_per_token=0.01)
    short = [Sequence([1, 2], SamplingParams(max_tokens=16), 4) for _ in range(5)]
    long = [Sequence([1, 2], SamplingParams(max_tokens=1000), 4) for _ in range(5)]
    assert choice.choose(short, behind) == 0
    assert choice.choose(long, behind) == 3 and choice.caught_up
    choice.record(3, 5, 10.0, [(3, 3)] * 5)  # the catch-up step's own time: not K's
    assert choice.arms[(5).bit_length(), 3].step_s == 1.0
    assert (
        choice.choose(long + long, behind) == 0
    )  # ten sequences: five's rates promise nothing there
    assert (
        choice.choose(short, _Draft(lag=1000)) == 3
    )  # the catch-up's cost not measured: K measures it
    later = step_choice.time.monotonic() + 10.0 / step_choice.EXPLORE_SHARE + 1  # 10 s: a share
    with pytest.MonkeyPatch.context() as patch:  # of the time since K last ran at this batch size
        patch.setattr(step_choice.time, "monotonic", lambda: later)
        assert choice.choose(short, behind) == 3  # re-measured, although its rates say plain
    assert choice.choose(short, _Draft(lag=2 * 5, s_per_token=0.01)) == 3  # steady: no catch-up


def test_k_is_not_first_tried_at_a_larger_batch_than_one_where_it_lost():
    """Plain decoding beat every K at 5 sequences (drafts rejected): at 12 no K is first tried (its
    first try would catch the draft up over all 12); at 2, below, one is; where K won at 5, it is
    tried at 12."""

    def measured(accepted: int) -> StepChoice:
        choice = StepChoice(k=3)
        _run(choice, 5, 2 * step_choice.MIN_SAMPLES, lambda k: 1 + 0.2 * k, lambda k: accepted)
        return choice

    def tried(choice: StepChoice, rows: int, accepted: int) -> set[int]:
        steps = 2 * step_choice.FIRST_LOOK + step_choice.MIN_SAMPLES
        return set(_run(choice, rows, steps, lambda k: 1 + 0.2 * k, lambda k: accepted))

    lost, won = measured(0), measured(3)
    assert tried(lost, 12, 0) == {0} and tried(lost, 2, 0) > {0} and tried(won, 12, 3) > {0}


@pytest.fixture
def random_switches(monkeypatch):
    """Every step's K drawn at random (seeded), whatever the batch; the draws made, in order."""
    rng, drawn = random.Random(5), []

    def choose(self, running):
        drawn.append(rng.choice(range(self.k + 1)))
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
    assert set(steps) == set(random_switches) == {0, 1, 2, 3}


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
    assert set(metrics["steps_by_k"]) == set(range(K + 1))
    check_law(
        "SD, any K from 0 up at random steps",
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

    def propose(self, batch, decoding, k):
        proposal = real(self, batch, decoding, k)
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
    """K = 3's first step at a batch size is 50x slow (a GPU compiling its kernels); then it is as
    fast as a plain step and its drafts are accepted. After both arms' first runs, K = 3 is
    chosen."""
    choice, slow = StepChoice(k=3), [50.0]
    runs = _run(
        choice,
        1,
        4 * step_choice.MIN_SAMPLES,
        lambda k: slow.pop() if k and slow else 1.0,
        lambda k: k,
    )
    assert runs[-2 * step_choice.MIN_SAMPLES :] == [3] * (2 * step_choice.MIN_SAMPLES)


def test_a_k_losing_a_close_call_is_retried_sooner():
    """Drafts rejected, K = 1's step 5% slower than a plain one: K = 1 is re-tried within a
    quarter of EXPLORE_EVERY's steps, not after all of them."""
    choice = StepChoice(k=1)
    few = step_choice.MIN_SAMPLES
    runs = _run(
        choice,
        1,
        2 * few + step_choice.EXPLORE_EVERY["speculate"] // 4,
        lambda k: 1.05 if k else 1.0,
        lambda k: 0,
    )
    assert sorted(Counter(runs[: 2 * few]).values()) == [few] * 2
    assert 1 in runs[2 * few :]


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
