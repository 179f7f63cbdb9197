"""At T > 0 every path emits exactly the target's distribution, for seeded and unseeded requests.

Pair: tests/small_pair.py (16-token vocabulary, P(accept) about one half). Reference: the exact law
of the target, enumerated with transformers in float64 with its own logits warpers
(tests/exact_law.py), so no reference sample is drawn and its noise does not enter the test.

What is tested, per path:
- SD: the joint law of (t1, t2). t1 comes from the prefill, t2 is the first verified position of
  the first round: an accepted draft token or a residual bonus.
- SSD: the law of t4 with K = 1 and max_tokens = 4. The first decode round of a request is always
  a miss (no cache exists yet) and emits t2 or (t2, t3), so t4 always comes from round 2 or later,
  where the path under test answers:
  - hit: fan-out 16 at every k caches every possible bonus token, so every later round is a hit
    (tokens and q rows from the draft process's tree-decoded branches; asserted: warm hit rate 1);
  - jit / fast: fan-out 0, every round misses to the just-in-time primary (sampled drafts with
    their q rows) or to the fast backup (n-gram / random proposals verified as one-hot);
  - auto: fan-out 0 and the fallback rule choosing between them each round (b* pinned at 512,
    requests in waves of 300 and 1000, so both backups answer);
  - Saguaro sampling with C = 0.3 and C = 0: hits and just-in-time misses mixed, both from q_C.
- Variants: T = 1, top_k = 3 and top_p = 0.9, each path with unseeded requests (the engine's
  streams) and with seeded ones (request i has seed SEED_BASE + i: distinct seeds give unrelated
  streams, so the n requests are independent samples). The seeded variants are the ones that
  failed before the draft's and the verifier's streams were separated (core/streams.py). One engine
  runs a variant's unseeded batch, then its seeded one, with fresh counters: each batch is its own
  goodness-of-fit check and its own path assertions (an engine start, a draft process's included,
  costs as much as a few thousand samples; a second batch is also what a long-running engine sees).

Test: chi-square goodness of fit of the n samples against the exact law, cells with expected
count < 5 pooled; reject at ALPHA = 1e-3. Power (tests/stats_helpers.py, `gof_power`): for any
shift of total variation d on the tested cells lambda >= 4 n d^2, so n is set for power >= 0.8
against d = 0.02 (SD) / 0.03 (SSD) at the degrees of freedom each table actually gets, and each
test recomputes that power and asserts it, so a change that adds cells cannot silently weaken it.

Negative controls, through the same helper (each must be rejected at p < ALPHA):
(1) a verifier that accepts every draft token (SD, and SSD on the hit path); (2) after a rejection,
the bonus drawn from p instead of the residual (SD; total variation about 0.026); (3) the bug the
stream separation fixed: a seeded SD request whose draft samples from a generator seeded like the
verifier's, so the draft's x = F_q^-1(u) and the acceptance test read the same uniforms.

False alarms: about 30 checks at 1e-3 each (<= 3% family-wise). Seeds are fixed, so a given
checkout passes or fails deterministically. Run with -s to see the statistics.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
from exact_law import marginal, output_law
from small_pair import DIST_PROMPT, engine_options
from stats_helpers import chi2_isf, fit, gof_power, ncx2_sf

from ssd_engine import LLM, SamplingParams
from ssd_engine.core.streams import Stream, stream_generator
from ssd_engine.core.structures import Sequence
from ssd_engine.sampling import rejection, verifier

ALPHA = 1e-3
DESIGN_POWER = 0.8
SD_TV, SSD_TV = 0.02, 0.03
SEED_BASE = 1000

PARAMS = {
    "T=1": dict(temperature=1.0),
    "top_k=3": dict(temperature=1.0, top_k=3),
    "top_p=0.9": dict(temperature=1.0, top_p=0.9),
}
SD_K = {"T=1": 2, "top_k=3": 3, "top_p=0.9": 1}
SD_N = {"T=1": 22_000, "top_k=3": 20_000, "top_p=0.9": 14_000}
SEEDINGS = ("unseeded", "seeded")

SSD_TESTED, SSD_TOKENS = 3, 4  # t4
SSD_PATHS = {
    "hit": dict(ssd_fanout=16, ssd_fallback="jit"),
    "jit": dict(ssd_fanout=0, ssd_fallback="jit"),
    "fast": dict(ssd_fanout=0, ssd_fallback="fast"),
    # b* pinned between the two wave sizes below, so the rule takes both backups
    "auto": dict(ssd_fanout=0, ssd_fallback="auto", ssd_critical_batch=512),
    "saguaro C=0.3": dict(ssd_fanout=1, saguaro_c=0.3, ssd_fallback="jit"),
    "saguaro C=0": dict(ssd_fanout=2, saguaro_c=0.0, ssd_fallback="jit"),
}
AUTO_WAVES = (300, 1000)  # batch sizes below and above the pinned b*
SSD_VARIANTS = {  # (path, params): samples
    ("hit", "T=1"): 9_500,
    ("hit", "top_p=0.9"): 7_000,
    ("jit", "T=1"): 9_500,
    ("jit", "top_k=3"): 9_500,
    ("fast", "T=1"): 9_500,
    ("auto", "T=1"): 9_500,
    ("saguaro C=0.3", "T=1"): 9_500,
    ("saguaro C=0", "top_p=0.9"): 7_000,
}
NEGATIVE_CONTROL_SAMPLES = 6_000


def _params(name: str, max_tokens: int, seed: int | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=seed, **PARAMS[name])


def _reset_counters(llm: LLM) -> None:
    """Fresh speculation counters: the next batch's acceptance and hit rates are its own."""
    llm.engine.spec_metrics.reset()
    if hasattr(llm.engine.speculator, "metrics"):
        llm.engine.speculator.metrics.reset()


def _run(
    llm: LLM, name: str, max_tokens: int, n: int, seeded: bool, waves: tuple[int, ...] = ()
) -> list[list[int]]:
    """n requests of one prompt through the engine loop; their output tokens. All at once, or in
    waves of the given sizes (cycled), each run to its end before the next is added."""
    engine = llm.engine
    seqs = []
    sizes = itertools.cycle(waves or (n,))
    while len(seqs) < n:
        wave = min(next(sizes), n - len(seqs))
        seqs += [
            engine.add_request(
                DIST_PROMPT,
                _params(name, max_tokens, SEED_BASE + len(seqs) + i if seeded else None),
            )
            for i in range(wave)
        ]
        while engine.has_unfinished():
            engine.step()
    assert all(len(s.output_token_ids) == max_tokens for s in seqs)
    return [s.output_token_ids for s in seqs]


@pytest.fixture(scope="module")
def exact(small_pair):
    """exact(params name, length) -> {output tuple: probability} of the target."""
    target, _ = small_pair
    cache = {}

    def get(name: str, length: int) -> dict:
        if (name, length) not in cache:
            cache[name, length] = output_law(target, DIST_PROMPT, _params(name, length), length)
        return cache[name, length]

    return get


def _check(label: str, result, tv: float, metrics: dict) -> None:
    stat, dof, p, n = result
    power = gof_power(dof, n, tv, ALPHA)
    print(
        f"\n{label}: chi2 = {stat:.2f}, dof = {dof}, p = {p:.3g}, n = {n}, power vs TV {tv} = {power:.3f}, "
        f"acceptance = {metrics['acceptance_rate']:.3f}"
    )
    assert (
        0.2 < metrics["acceptance_rate"] < 0.9
    )  # the accept and residual branches both carry mass
    assert dof >= 2 and power >= DESIGN_POWER, "too many cells for the sample size: raise n"
    assert p >= ALPHA, (
        f"{label}: the emitted law differs from the target's (chi2 = {stat:.1f}, dof = {dof}, p = {p:.2e})"
    )


def test_power_helpers_against_known_values():
    assert chi2_isf(1e-3, 4) == pytest.approx(18.467, abs=1e-3)
    assert chi2_isf(1e-3, 12) == pytest.approx(32.909, abs=1e-3)
    assert ncx2_sf(18.467, 4, 23.1) == pytest.approx(0.80, abs=0.005)
    assert ncx2_sf(32.909, 12, 37.0) == pytest.approx(0.90, abs=0.005)
    assert gof_power(8, 34_800 // 2, 0.02, 1e-3) == pytest.approx(0.80, abs=0.01)


def test_exact_law_is_a_distribution_and_matches_plain_ar(small_pair, exact):
    """The oracle itself: sums to 1, and plain AR sampling fits it (unseeded and seeded)."""
    law = exact("T=1", 2)
    assert sum(law.values()) == pytest.approx(1.0, abs=1e-12)
    target, _ = small_pair
    with LLM(target, **engine_options(seed=11)) as llm:
        for seeded in (False, True):
            sample = Counter(map(tuple, _run(llm, "T=1", 2, 12_000, seeded)))
            stat, dof, p, n = fit(sample, law)
            assert dof >= 2 and p >= ALPHA, (seeded, stat, dof, p)


# --------------------------------------------------------------------------- SD


def _sd(
    small_pair, name: str, n: int, seedings: tuple[str, ...], seed: int = 12
) -> list[tuple[Counter, dict]]:
    """Per seeding, in order and through one engine: (sample of (t1, t2), that batch's metrics)."""
    target, draft = small_pair
    with LLM(
        target,
        **engine_options(
            seed=seed, draft_model=draft, speculative_mode="sd", num_speculative_tokens=SD_K[name]
        ),
    ) as llm:
        batches = []
        for seeding in seedings:
            _reset_counters(llm)
            batches.append(
                (
                    Counter(map(tuple, _run(llm, name, 2, n, seeding == "seeded"))),
                    llm.speculation_metrics(),
                )
            )
        return batches


@pytest.mark.parametrize("name", PARAMS)
def test_sd_first_two_tokens_follow_the_target(small_pair, exact, name):
    for seeding, (sample, metrics) in zip(SEEDINGS, _sd(small_pair, name, SD_N[name], SEEDINGS)):
        _check(f"SD [{name}, {seeding}]", fit(sample, exact(name, 2)), SD_TV, metrics)


def _accept_all(
    draft_tokens,
    draft_probs,
    target_probs,
    generators,
    num_draft=None,
    default_generator=None,
    **options,
):
    """BROKEN on purpose: p := q at every drafted position, so every draft token is accepted."""
    k = draft_tokens.shape[1]
    forced = target_probs.clone()
    forced[:, :k] = draft_probs
    return rejection.verify(
        draft_tokens, draft_probs, forced, generators, num_draft, default_generator, **options
    )


def _bonus_from_p(
    draft_tokens,
    draft_probs,
    target_probs,
    generators,
    num_draft=None,
    default_generator=None,
    **options,
):
    """BROKEN on purpose: after a rejection the bonus is drawn from p instead of max(0, p - q)."""
    result = rejection.verify(
        draft_tokens, draft_probs, target_probs, generators, num_draft, default_generator, **options
    )
    rejected = [i for i, a in enumerate(result.num_accepted.tolist()) if a < draft_tokens.shape[1]]
    if rejected:
        p = target_probs[rejected, result.num_accepted[rejected]]
        redrawn = torch.multinomial(p, 1, generator=default_generator).squeeze(1).tolist()
        for i, t in zip(rejected, redrawn):
            result.output_tokens[i][-1] = t
    return result


@pytest.mark.parametrize("broken", [_accept_all, _bonus_from_p], ids=["accept_all", "bonus_from_p"])
def test_negative_control_broken_verifier_is_rejected(small_pair, exact, monkeypatch, broken):
    monkeypatch.setattr(verifier, "verify", broken)
    [(sample, _)] = _sd(small_pair, "T=1", NEGATIVE_CONTROL_SAMPLES, ("unseeded",), seed=13)
    stat, dof, p, _ = fit(sample, exact("T=1", 2))
    print(
        f"\nNEGATIVE CONTROL [{broken.__name__}, SD]: chi2 = {stat:.2f}, dof = {dof}, p = {p:.3g}"
    )
    assert p < ALPHA


def test_negative_control_draft_sharing_the_verifier_stream_is_rejected(
    small_pair, exact, monkeypatch
):
    """The seeded-request bug: the draft's generator seeded like the target's (same uniforms)."""

    def shared(self):
        if "_shared" not in self.__dict__:
            self._shared = stream_generator(self.params.seed, Stream.TARGET)
        return self._shared

    monkeypatch.setattr(Sequence, "draft_generator", property(shared))
    [(sample, _)] = _sd(small_pair, "T=1", NEGATIVE_CONTROL_SAMPLES, ("seeded",), seed=13)
    stat, dof, p, _ = fit(sample, exact("T=1", 2))
    print(
        f"\nNEGATIVE CONTROL [draft on the verifier's stream, SD seeded]: chi2 = {stat:.2f}, dof = {dof}, p = {p:.3g}"
    )
    assert p < ALPHA


# --------------------------------------------------------------------------- SSD


def _ssd(
    small_pair, path: str, name: str, n: int, seedings: tuple[str, ...], seed: int = 22
) -> list[tuple[Counter, dict]]:
    """Per seeding, in order and through one engine: (sample of t4, that batch's metrics)."""
    target, draft = small_pair
    options = engine_options(
        seed=seed,
        draft_model=draft,
        speculative_mode="ssd",
        num_speculative_tokens=1,
        **SSD_PATHS[path],
    )
    with LLM(target, **options) as llm:
        waves = AUTO_WAVES if path == "auto" else ()
        batches = []
        for seeding in seedings:
            _reset_counters(llm)
            outputs = _run(llm, name, SSD_TOKENS, n, seeding == "seeded", waves)
            batches.append(
                (Counter(tokens[SSD_TESTED] for tokens in outputs), llm.speculation_metrics())
            )
        return batches


def _check_path(path: str, metrics: dict) -> None:
    assert metrics["draft_failures"] == []
    sources = set(metrics["speculations_by_source"])
    if path == "hit":
        assert metrics["cache_hit_rate_warm"] == 1.0
    elif path.startswith("saguaro"):
        assert (
            0 < metrics["cache_hit_rate_warm"] < 1
        )  # both the cached and the just-in-time q_C rows are tested
    elif path == "auto":
        assert metrics["cache_hit_rate"] == 0.0 and sources == {"jit", "fast"}
    else:
        assert metrics["cache_hit_rate"] == 0.0 and sources == {path}


@pytest.mark.parametrize("path,name", SSD_VARIANTS, ids=[f"{a}-{b}" for a, b in SSD_VARIANTS])
def test_ssd_fourth_token_follows_the_target(small_pair, exact, path, name):
    law = marginal(exact(name, SSD_TOKENS), SSD_TESTED)
    for seeding, (sample, metrics) in zip(
        SEEDINGS, _ssd(small_pair, path, name, SSD_VARIANTS[path, name], SEEDINGS)
    ):
        print(
            f"\n{seeding}: speculations {metrics['speculations_by_source']}, "
            f"warm hit rate {metrics['cache_hit_rate_warm']:.3f}"
        )
        _check_path(path, metrics)
        _check(f"SSD [{path}, {name}, {seeding}]", fit(sample, law), SSD_TV, metrics)


def test_negative_control_broken_verifier_on_the_hit_path_is_rejected(
    small_pair, exact, monkeypatch
):
    monkeypatch.setattr(verifier, "verify", _accept_all)
    [(sample, metrics)] = _ssd(
        small_pair, "hit", "T=1", NEGATIVE_CONTROL_SAMPLES // 2, ("unseeded",), seed=23
    )
    stat, dof, p, _ = fit(sample, marginal(exact("T=1", SSD_TOKENS), SSD_TESTED))
    print(
        f"\nNEGATIVE CONTROL [accept_all, SSD hit path]: chi2 = {stat:.2f}, dof = {dof}, p = {p:.3g}"
    )
    assert metrics["cache_hit_rate_warm"] == 1.0
    assert p < ALPHA
