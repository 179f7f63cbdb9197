"""SSD at T > 0 emits exactly the target's distribution, on the cache-hit path and on the miss paths.

Same model pair, prompt, homogeneity test and power analysis as the SD test (see
test_speculative_decoding.py's docstring: vocab 16, sharpened; draft = 0.73 target + 0.27 unrelated).
What differs is the position tested. The first decode round of a request is always a miss (no
cache exists yet), so we test the pair (t4, t5) with max_tokens = 5 and K = 1: t1 is the prefill's
token and round 1 emits t2 or (t2, t3), so t4 and t5 always come from round 2 or later.
- forced hit: fan-out 16 at every k, i.e. every possible bonus token is cached (the vocabulary has
  16 tokens), so every round after the first is a hit: its tokens and q rows come from the draft
  process's tree-decoded branches (checked: the hit rate after the first round is 1);
- forced miss: fan-out 0, every round is a miss, with the just-in-time primary (sampled drafts,
  q rows) and with the fast backup (n-gram / random proposals verified as one-hot).
Variants: plain T = 1 (hit, miss-jit, miss-fast) and top_p = 0.9 (hit); Saguaro sampling with
C = 0.3 (T = 1, fan-out 1) and C = 0 (top_p = 0.9, fan-out 2), mixing hits and just-in-time misses. AR draws the reference
(t4, t5) sample once per variant. Negative control: the accept-everything verifier on the hit path
must be rejected at p < 1e-3.
"""
from collections import Counter

import pytest

from ssd_engine import LLM, SamplingParams
from ssd_engine.engine import llm_engine
from test_speculative_decoding import (ALPHA, DESIGN_POWER, DIST_PROMPT, _accept_all, _engine_options,
                                       design_power, homogeneity_test, small_pair)  # noqa: F401 (fixture)

TESTED = 3  # t4
MAX_TOKENS = 4
PARAMS = {
    "T=1": SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True),
    "top_p=0.9": SamplingParams(temperature=1.0, top_p=0.9, max_tokens=MAX_TOKENS, ignore_eos=True),
}
PATHS = {"hit": dict(ssd_fanout=16, ssd_fallback="jit"), "miss_jit": dict(ssd_fanout=0, ssd_fallback="jit"),
         "miss_fast": dict(ssd_fanout=0, ssd_fallback="fast"),
         # Saguaro sampling: drafts (cached and just-in-time) come from q_C, and q_C is what is verified
         "saguaro_c0.3": dict(ssd_fanout=1, saguaro_c=0.3, ssd_fallback="jit"),
         "saguaro_c0": dict(ssd_fanout=2, saguaro_c=0.0, ssd_fallback="jit")}
VARIANTS = {  # name: (params, path, samples per side)
    "hit T=1": ("T=1", "hit", 20_000),
    "hit top_p=0.9": ("top_p=0.9", "hit", 20_000),
    "miss_jit T=1": ("T=1", "miss_jit", 20_000),
    "miss_fast T=1": ("T=1", "miss_fast", 20_000),
    "saguaro C=0.3 T=1": ("T=1", "saguaro_c0.3", 20_000),
    "saguaro C=0 top_p=0.9": ("top_p=0.9", "saguaro_c0", 20_000),
}
NEGATIVE_CONTROL_SAMPLES = 6_000
SSD_DESIGN_TV = 0.03


def _tested_pairs(llm: LLM, params: SamplingParams, n: int) -> Counter:
    engine = llm.engine
    seqs = [engine.add_request(DIST_PROMPT, params) for _ in range(n)]
    while engine.has_unfinished():
        engine.step()
    assert all(len(s.output_token_ids) == MAX_TOKENS for s in seqs)
    return Counter(s.output_token_ids[TESTED] for s in seqs)


@pytest.fixture(scope="module")
def ar_samples(small_pair):
    target, _ = small_pair
    cache = {}

    def get(name: str, n: int) -> Counter:
        if name not in cache:
            with LLM(target, **_engine_options(seed=21, speculative_mode="ar")) as llm:
                cache[name] = _tested_pairs(llm, PARAMS[name], n)
        return cache[name]
    return get


def _ssd_samples(small_pair, params: str, path: str, n: int, seed: int = 22) -> tuple[Counter, dict]:
    target, draft = small_pair
    options = _engine_options(seed=seed, draft_model=draft, speculative_mode="ssd", num_speculative_tokens=1,
                              **PATHS[path])
    with LLM(target, **options) as llm:
        counts = _tested_pairs(llm, PARAMS[params], n)
        return counts, llm.speculation_metrics()


@pytest.mark.parametrize("name", list(VARIANTS))
def test_ssd_tokens_match_ar_in_distribution(small_pair, ar_samples, name):
    params, path, n = VARIANTS[name]
    ar = ar_samples(params, max(v[2] for v in VARIANTS.values() if v[0] == params))
    ssd, metrics = _ssd_samples(small_pair, params, path, n)
    stat, dof, p, n_a, n_b = homogeneity_test(ar, ssd)
    power = design_power(dof, n_a, n_b, SSD_DESIGN_TV)
    print(f"\nSSD [{name}] vs AR: chi2 = {stat:.2f}, dof = {dof}, p = {p:.3g}, n = {n_a} AR / {n_b} SSD, "
          f"power vs TV {SSD_DESIGN_TV} = {power:.3f}, hit rate after round 1 = {metrics['cache_hit_rate_warm']:.3f}, "
          f"acceptance = {metrics['acceptance_rate']:.3f}, speculations = {metrics['speculations_by_source']}")
    assert metrics["draft_failures"] == []
    if path == "hit":
        assert metrics["cache_hit_rate_warm"] == 1.0
    elif path.startswith("saguaro"):
        assert 0 < metrics["cache_hit_rate_warm"] < 1  # both the cached and the just-in-time q_C rows are tested
    else:
        assert metrics["cache_hit_rate"] == 0.0 and set(metrics["speculations_by_source"]) == {path[5:]}
    assert 0.2 < metrics["acceptance_rate"] < 0.9  # accept and residual branches both carry mass
    assert dof >= 2 and power >= DESIGN_POWER, "too many cells for the sample size: raise n"
    assert p >= ALPHA, f"SSD's t4 distribution differs from AR's: chi2 = {stat:.1f}, dof = {dof}, p = {p:.2e}"


def test_negative_control_broken_verifier_on_the_hit_path_is_rejected(small_pair, ar_samples, monkeypatch):
    monkeypatch.setattr(llm_engine, "verify", _accept_all)
    ar = ar_samples("T=1", 40_000)
    ssd, metrics = _ssd_samples(small_pair, "T=1", "hit", NEGATIVE_CONTROL_SAMPLES, seed=23)
    stat, dof, p, _, _ = homogeneity_test(ar, ssd)
    print(f"\nNEGATIVE CONTROL [accept_all, hit path]: chi2 = {stat:.2f}, dof = {dof}, p = {p:.3g}")
    assert metrics["cache_hit_rate_warm"] == 1.0
    assert p < ALPHA
