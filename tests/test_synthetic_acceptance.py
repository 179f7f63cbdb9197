"""Synthetic acceptance / hit rates (ssd_engine/testing.py, benchmarking only): outcomes drawn at a set rate.

Statistical checks use a 5-sigma binomial bound: a count X ~ Binomial(n, p) lies within
n p +- 5 sqrt(n p (1 - p)) except with probability < 6e-7 (normal approximation; n p (1 - p) is
in the hundreds here), so a test fails by chance about never, while a wrong rate (the real
acceptance of an identical draft, 1.0; an off-by-one position) lands many sigmas away."""

import math

import pytest
import torch
from test_dummy_weights import SMALL, shape_folder

from ssd_engine import LLM, SamplingParams
from ssd_engine.core.config import EngineConfig
from ssd_engine.core.structures import Proposal
from ssd_engine.saguaro.source import Source
from ssd_engine.sampling.synthetic import BernoulliDraws, verify_synthetic
from ssd_engine.speculative.ssd.draft.server import DraftServer
from ssd_engine.speculative.ssd.protocol import Speculation
from ssd_engine.testing import Synthetic


def within_5_sigma(count: int, n: int, p: float) -> bool:
    return abs(count - n * p) <= 5 * math.sqrt(n * p * (1 - p))


def _proposal(n: int, k: int, num_draft: list[int] | None = None) -> Proposal:
    tokens = torch.arange(n * k).view(n, k) % 50 + 100
    return Proposal(tokens, None, torch.tensor(num_draft if num_draft is not None else [k] * n))


def _logits(n: int, k: int, vocab: int = 64) -> torch.Tensor:
    return torch.randn(n * (k + 1), vocab, generator=torch.Generator().manual_seed(1))


def test_each_position_is_accepted_with_probability_alpha_given_the_ones_before():
    n, k, alpha = 20000, 4, 0.7
    result = verify_synthetic(
        _proposal(n, k), _logits(n, k), BernoulliDraws(alpha, seed=0, purpose="test")
    )
    accepted = result.num_accepted
    for j in range(1, k + 1):
        reached = int((accepted >= j - 1).sum())  # rows that got to draft j
        assert within_5_sigma(int((accepted >= j).sum()), reached, alpha), j
    assert [len(row) for row in result.output_tokens] == (accepted + 1).tolist()


def test_alpha_0_accepts_nothing_and_alpha_1_everything_drafted():
    n, k = 50, 3
    logits = _logits(n, k)
    argmax = logits.argmax(-1).view(n, k + 1)
    none = verify_synthetic(_proposal(n, k), logits, BernoulliDraws(0.0, 0, "test"))
    assert none.num_accepted.tolist() == [0] * n
    assert none.output_tokens == [[int(argmax[i, 0])] for i in range(n)]  # the target row's argmax
    drafted = [k, 1, 0] * (n // 3) + [k] * (n % 3)
    proposal = _proposal(n, k, drafted)
    every = verify_synthetic(proposal, logits, BernoulliDraws(1.0, 0, "test"))
    assert every.num_accepted.tolist() == drafted  # never past a row's real drafts
    assert every.output_tokens == [
        proposal.tokens[i, :d].tolist() + [int(argmax[i, d])] for i, d in enumerate(drafted)
    ]


@pytest.mark.parametrize(
    "options, message",
    [
        (
            dict(synthetic=Synthetic(acceptance=1.5)),
            "synthetic acceptance must be in [0, 1], got 1.5",
        ),
        (
            dict(synthetic=Synthetic(acceptance=True)),
            "synthetic acceptance must be in [0, 1], got True",
        ),
        (dict(synthetic=Synthetic(hit=-0.1)), "synthetic hit must be in [0, 1], got -0.1"),
        (dict(synthetic=0.5), "synthetic must be a Synthetic or None, got 0.5"),
        (
            dict(speculative_mode="ar", synthetic=Synthetic(acceptance=0.5)),
            "needs speculative_mode sd, ssd or auto, not ar",
        ),
        (
            dict(speculative_mode="sd", synthetic=Synthetic(hit=0.5)),
            "needs speculative_mode ssd (or auto), not sd",
        ),
    ],
)
def test_bad_synthetic_values_are_one_clear_error(options, message):
    with pytest.raises(ValueError) as error:
        EngineConfig.from_kwargs(**options)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_engine_acceptance_follows_alpha_not_the_weights(tmp_path):
    """The draft is the target (same dummy weights): real verification would accept every draft."""
    folder, k, alpha = shape_folder(tmp_path / "shape"), 4, 0.6
    with LLM(
        folder,
        draft_model=folder,
        load_format="dummy",
        speculative_mode="sd",
        num_speculative_tokens=k,
        draft_dtype="fp32",
        synthetic=Synthetic(acceptance=alpha),
        speculation_per_step="off",
        **SMALL,
    ) as llm:
        llm.generate(
            [[5, 6, 7, 8]] * 4,
            SamplingParams(temperature=0, max_tokens=160, ignore_eos=True),
            use_tqdm=False,
        )
        metrics = llm.speculation_metrics()
    rounds = metrics["rounds"]
    assert rounds > 150
    # P(accepted >= j) = alpha^j
    for j, rate in enumerate(metrics["per_position_acceptance_rate"], start=1):
        assert within_5_sigma(round(rate * rounds), rounds, alpha**j), (j, rate)


@pytest.mark.parametrize("alpha, accepted", [(0.0, 0), (1.0, 2)])
def test_engine_alpha_0_and_1(tmp_path, alpha, accepted):
    target, draft = shape_folder(tmp_path / "t"), shape_folder(tmp_path / "d", num_hidden_layers=1)
    with LLM(
        target,
        draft_model=draft,
        load_format="dummy",
        speculative_mode="sd",
        num_speculative_tokens=2,
        draft_dtype="fp32",
        synthetic=Synthetic(acceptance=alpha),
        **SMALL,
    ) as llm:
        out = llm.generate(
            [[5, 6, 7, 8]],
            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
            use_tqdm=False,
        )[0]
        metrics = llm.speculation_metrics()
    assert len(out.token_ids) == 12
    assert metrics["accepted_length_histogram"][accepted] == metrics["rounds"] > 0


def _server_with_hits(p: float | None) -> DraftServer:
    """Only the lookup rule is exercised: no model behind it."""
    draws = None if p is None else BernoulliDraws(p, 0, "cache hits")
    return DraftServer(trunk=None, builder=None, fanouts=[], seed=0, synthetic_hits=draws)


def test_synthetic_hit_overrides_what_the_cache_holds():
    built = {(1, 7): Speculation(Source.HIT, [1, 2]), (2, 9): Speculation(Source.HIT, [3, 4])}
    real, always, never = _server_with_hits(None), _server_with_hits(1.0), _server_with_hits(0.0)
    assert real._kept(built, (1, 7)) == {(1, 7): built[(1, 7)]} and real._kept(built, (0, 5)) == {}
    assert always._kept(built, (1, 7)) == {(1, 7): built[(1, 7)]}
    served = always._kept(built, (0, 5))  # not built: any built branch is served
    assert list(served) == [(0, 5)] and served[(0, 5)] in built.values()
    assert always._kept({}, (0, 5)) == {} and always._kept(built, None) == {}  # nothing to serve
    assert never._kept(built, (1, 7)) == {}  # built, yet a miss
    half = _server_with_hits(0.5)
    hits = sum(bool(half._kept(built, (1, 7))) for _ in range(4000))
    assert within_5_sigma(hits, 4000, 0.5)


@pytest.mark.parametrize("p", [1.0, 0.0])
def test_ssd_hit_rate_is_the_synthetic_one(tmp_path, p):
    target, draft = shape_folder(tmp_path / "t"), shape_folder(tmp_path / "d", num_hidden_layers=1)
    with LLM(
        target,
        draft_model=draft,
        load_format="dummy",
        speculative_mode="ssd",
        num_speculative_tokens=2,
        draft_dtype="fp32",
        synthetic=Synthetic(acceptance=0.7, hit=p),
        ssd_budget=2,
        ssd_fallback="jit",
        **SMALL,
    ) as llm:
        llm.generate(
            [[5, 6, 7, 8]] * 2,
            SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
            use_tqdm=False,
        )
        metrics = llm.speculation_metrics()
    assert metrics["lookups"] > 10 and metrics["cache_hit_rate_warm"] == p


def test_auto_predicts_with_the_synthetic_rates():
    from ssd_engine.planning.predict import Acceptance
    from ssd_engine.planning.survey import with_synthetic

    base = Acceptance.from_calibration(None)
    assert with_synthetic(base, EngineConfig()) == base
    drawn = with_synthetic(
        base, EngineConfig.from_kwargs(synthetic=Synthetic(acceptance=0.9, hit=0.8))
    )
    assert drawn.rate(1) == drawn.rate(5) == 0.9
    assert drawn.miss(1) == drawn.miss(20) == pytest.approx(0.2) and drawn.miss(0) == 1.0
    assert drawn.tokens_per_round(4) == pytest.approx((1 - 0.9**5) / (1 - 0.9))
