"""Saguaro in the engine: calibration files written and loaded, the fan-out they give, the
fallback switching at b*, the bonus-rank telemetry behind the miss-rate curve, and Theorem 15
(lower C, higher cache hit rate) measured through the real draft process.

The math itself (fan-out solver, b*, q_C, Theorem 15 exactly) is in test_saguaro_math.py;
exactness at T > 0 with C < 1 is in test_distribution.py.
"""

import logging
import math

import pytest
from small_pair import DIST_PROMPT
from small_pair import engine_options as _engine_options
from test_speculative_decoding import _prompts, noisy_draft, target  # noqa: F401 (fixtures)

from ssd_engine import LLM, SamplingParams, calibrate
from ssd_engine.core.config import EngineConfig
from ssd_engine.saguaro.calibration import DEFAULT_ALPHA, DEFAULT_R, Calibration, model_fingerprint
from ssd_engine.saguaro.fallback import critical_batch_size
from ssd_engine.saguaro.fanout import fanout_for_outcomes, geometric_fanout
from ssd_engine.saguaro.plan import plan_saguaro
from ssd_engine.saguaro.source import Source
from ssd_engine.utils.machine import cpu_fingerprint

COMMON = dict(num_threads=1, block_size=8, num_speculative_tokens=3, speculative_mode="ssd")


def test_calibration_on_a_tiny_pair_is_written_then_loaded(target, noisy_draft, tmp_path, caplog):
    out = tmp_path / "configs"
    argv = [
        "--model",
        target,
        "--draft-model",
        noisy_draft,
        "--temperature",
        "0",
        "--num-prompts",
        "2",
        "--new-tokens",
        "16",
        "--k",
        "3",
        "--num-threads",
        "1",
        "--block-size",
        "8",
        "--out-dir",
        str(out),
    ]
    assert calibrate.main(argv) == 0
    [path] = out.glob("saguaro-*.json")
    cal = Calibration.load(path)
    assert (cal.target, cal.draft, cal.temperature, cal.k) == (
        model_fingerprint(target),
        model_fingerprint(noisy_draft),
        0.0,
        3,
    )
    assert cal.target != cal.draft  # same architecture and sizes, other weights
    assert (
        0 < cal.alpha < 1 and cal.r > 0 and cal.budget >= 1 and cal.measured["outcomes_ranked"] > 0
    )
    assert cal.miss_by_fanout == sorted(cal.miss_by_fanout, reverse=True)  # a tail probability

    with caplog.at_level(logging.INFO, logger="ssd_engine"):
        with LLM(target, draft_model=noisy_draft, calibration_dir=str(out), **COMMON) as llm:
            summary = llm.speculation_metrics()
    assert "using calibration" in caplog.text and "no calibration" not in caplog.text
    # auto: Theorem 12 on the measured outcome distribution; geometric: on i.i.d. acceptance alpha
    assert summary["fanouts"] == {"T=0": fanout_for_outcomes(cal.outcome_probs, cal.r, cal.budget)}
    assert summary["fanouts"]["T=0"] == cal.measured["fanout_at_budget"] and sum(
        cal.outcome_probs
    ) == pytest.approx(1)
    config = EngineConfig.from_kwargs(
        model=target,
        draft_model=noisy_draft,
        num_speculative_tokens=3,
        ssd_fanout="geometric",
        calibration_dir=str(out),
    )
    assert plan_saguaro(config.speculative, target, noisy_draft).fanouts == [
        (0.0, geometric_fanout(cal.alpha, cal.r, cal.budget, 3))
    ]
    # a build cut to b rows takes the rule's own optimum at b
    auto_plan = plan_saguaro(
        config.with_options(ssd_fanout="auto").speculative, target, noisy_draft
    )
    assert auto_plan.fanout_tables == [
        (0.0, [fanout_for_outcomes(cal.outcome_probs, cal.r, b) for b in range(1, cal.budget + 1)])
    ]
    # before any round the rule's b* comes from the calibration's numbers
    assert summary["critical_batch_size"] == critical_batch_size(
        cal.p_hit, cal.e_primary, cal.e_fast, cal.t_p, cal.t_slow
    )

    caplog.clear()
    (tmp_path / "empty").mkdir()  # a folder without this pair's file (a missing folder is an error)
    with caplog.at_level(logging.INFO, logger="ssd_engine"):
        with LLM(
            target, draft_model=noisy_draft, calibration_dir=str(tmp_path / "empty"), **COMMON
        ) as llm:
            budget = (
                llm.engine.config.speculative.ssd.budget
            )  # no calibration: B from this machine's costs
            assert budget >= 1 and llm.engine.plan.choice.how.startswith("forced")
            assert llm.speculation_metrics()["fanouts"] == {
                "T=0": geometric_fanout(DEFAULT_ALPHA, DEFAULT_R, budget, 3)
            }
    assert "no calibration for this model pair" in caplog.text


@pytest.mark.parametrize("batch", [1, 2, 3, 4])
def test_fallback_switches_at_the_critical_batch_size(target, noisy_draft, batch):
    """Fan-out 0: every round misses, so every round uses the backup the rule picks for its batch.
    The rows start together, but each row's fast proposals come from its own stream, so rows may
    accept different counts and finish rounds apart: the batch can narrow in the last rounds."""
    prompts = _prompts(1) * batch
    with LLM(
        target, draft_model=noisy_draft, ssd_fanout=0, ssd_critical_batch=2.5, **COMMON
    ) as llm:
        llm.generate(
            prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False
        )
        m = llm.speculation_metrics()
        log = list(llm.engine.speculator.backup_log)  # (batch size, cold, backup, b*) per round
    assert m["critical_batch_size"] == 2.5
    assert log[0][0] == batch  # the first decode round holds every row
    assert [choice.label for _, _, choice, _ in log] == [
        "jit" if size < 2.5 else "fast" for size, *_ in log
    ]
    expected = "jit" if batch < 2.5 else "fast"
    assert m["backup_rounds"][expected] >= 1 and expected in m["speculations_by_source"]
    assert set(m["speculations_by_source"]) <= {"jit", "fast"}


def test_automatic_fallback_follows_the_computed_critical_batch_size(target, noisy_draft, tmp_path):
    """No pin: b* comes from a calibration's estimates (here p_hit 0.9, E_p 3, E_fast 1.2, T_p 0.5,
    so b* = 1.30) and is then recomputed from the running estimates. A sweep over batch sizes 1..4
    must use the just-in-time backup exactly in the rounds whose batch was below the b* of the
    moment (rounds with no sequence in its first round, which no cache can serve), and both
    backups must occur."""
    cal = Calibration(
        model_fingerprint(target),
        model_fingerprint(noisy_draft),
        0.0,
        3,
        alpha=0.8,
        outcome_probs=[0.2, 0.16, 0.13, 0.51],
        r=1.0,
        miss_coeff=0.4,
        miss_by_fanout=[0.4, 0.2],
        budget=4,
        budget_fits=4,
        t_p=0.5,
        e_primary=3.0,
        e_fast=1.2,
        p_hit=0.9,
        measured={"cpu_fingerprint": cpu_fingerprint()},
    )  # this CPU's: its timing stands
    cal.save(tmp_path)
    assert 1 < critical_batch_size(0.9, 3.0, 1.2, 0.5) < 3
    with LLM(target, draft_model=noisy_draft, calibration_dir=str(tmp_path), **COMMON) as llm:
        for batch in (1, 2, 3, 4):
            llm.generate(
                _prompts(1) * batch,
                SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                use_tqdm=False,
            )
        log = list(llm.engine.speculator.backup_log)
    warm = [(batch, choice, b_star) for batch, cold, choice, b_star in log if cold == 0]
    assert {choice for _, choice, _ in warm} == {Source.JIT, Source.FAST}
    assert all(
        choice == (Source.JIT if batch < b_star else Source.FAST) for batch, choice, b_star in warm
    )
    # a first round is a certain miss: E_p / (1 + T_p) = 2 beats the fast backup's E_fast = 1.2
    assert all(choice == Source.JIT for batch, cold, choice, _ in log if cold == batch)


def test_bonus_ranks_account_for_every_hit_and_miss(target, noisy_draft):
    """A lookup hits iff its bonus token's rank among the draft's candidates is below F_k: the
    rank telemetry (which gives the miss rate at every fan-out) must agree with the cache."""
    fanout = [2, 1, 0, 3]
    with LLM(
        target,
        draft_model=noisy_draft,
        ssd_fanout=",".join(map(str, fanout)),
        ssd_fallback="jit",
        **COMMON,
    ) as llm:
        llm.generate(_prompts(4), SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
        metrics = llm.engine.speculator.metrics
    for k, f in enumerate(fanout):
        ranks = metrics.bonus_ranks_by_accepted[k]
        assert sum(ranks) == metrics.lookups_by_accepted[k + 1]  # every warm lookup was ranked
        assert sum(ranks[:f]) == metrics.hits_by_accepted[k + 1]
    assert 0 < sum(metrics.hits_by_accepted) < sum(metrics.lookups_by_accepted)


def _hit_rate(pair, c: float, n: int) -> tuple[float, int, float]:
    target, draft = pair
    # an fp32 draft: the effect size this test was sized for (an int4 draft's rows are flatter)
    options = _engine_options(
        seed=5,
        draft_model=draft,
        speculative_mode="ssd",
        num_speculative_tokens=1,
        draft_dtype="fp32",
        ssd_fanout=1,
        ssd_fallback="jit",
        saguaro_c=c,
    )
    params = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)
    with LLM(target, **options) as llm:
        engine = llm.engine
        for _ in range(n):
            engine.add_request(DIST_PROMPT, params)
        while engine.has_unfinished():
            engine.step()
        m = llm.speculation_metrics()
        rejected = engine.speculator.metrics.lookups_by_accepted[
            1
        ]  # outcome k = 0: the bonus came from the residual
        hits = engine.speculator.metrics.hits_by_accepted[1]
    return hits / rejected, rejected, m["acceptance_rate"]


def test_lower_c_raises_the_cache_hit_rate_in_the_engine(small_pair):
    """Theorem 15 through the real draft process (fan-out 1, K = 1, T = 1): C = 0.3 down-weights the
    draft's top token, so a rejection's bonus (drawn from the residual) is the cached token more
    often; acceptance drops. Hit rates after rejections (outcome k = 0) are compared; the difference
    must exceed 4 standard errors of the difference of two proportions."""
    plain, n_plain, acc_plain = _hit_rate(small_pair, 1.0, 1500)
    saguaro, n_saguaro, acc_saguaro = _hit_rate(small_pair, 0.3, 1500)
    se = math.sqrt(plain * (1 - plain) / n_plain + saguaro * (1 - saguaro) / n_saguaro)
    print(
        f"\nhit rate C=1: {plain:.3f} (n={n_plain}), C=0.3: {saguaro:.3f} (n={n_saguaro}); "
        f"acceptance {acc_plain:.3f} -> {acc_saguaro:.3f}"
    )
    assert saguaro - plain > 4 * se
    assert acc_saguaro < acc_plain
