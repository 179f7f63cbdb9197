"""Speculative decoding (SD, colocated draft) end to end: exact at T = 0 and in distribution at T > 0.

Greedy. SD output must be token-identical to transformers' greedy `generate` (EOS ignored, 48 new
tokens) at batch 1 / 3 / 8 with ragged prompts and K in {1, 4, 8}, under forced preemption, under
chunked prefill and with prompts served (all but one token) from the prefix cache, and under KV
pressure where the draft's private pages run short before the target's (the draft then skips
drafting for a sequence, which takes a plain target step). The draft is a different model: the target's weights plus Gaussian noise (so it agrees
often but not always: partial acceptances occur). A self-draft accepts everything; an
unrelated random draft accepts almost nothing; neither changes a single output token. Stops (EOS,
stop_token_ids, max_tokens) that fall inside an accepted run cut it exactly where AR stops.

Distribution at T > 0. The joint law of the first two generated tokens (t1, t2) must be the same
under SD as under AR. t1 comes from the prefill; t2 is the first verified position of the first SD
round, so it is an accepted draft token or a residual bonus: exactly the speculative-sampling rule.
Model: Qwen2 with vocab_size = 16, hidden 32, one layer; its lm_head is scaled by 16 (equivalently,
temperature 1/16 on the unscaled model) so that the mass sits on a few (t1, t2) cells. The draft is
the blend 0.73 * target + 0.27 * (an unrelated random model), scaled the same way: P(accept t2)
is about one half, so the accept and residual branches both carry mass. Variants: plain T = 1,
top_k = 3, top_p = 0.9. Each variant draws N_AR AR samples and N_SD SD samples, each sample one
request of max_tokens = 2 for the same prompt; all requests are unseeded, so they draw from the
engine's RNG and are independent.

Test: two-sample chi-square homogeneity test on the 2 x m table (sample x cell). Cells whose
expected count in the smaller sample is < 5 are pooled into one cell (grown with the next-smallest
cells until it reaches 5). Under H0, X^2 ~ chi2(m - 1) asymptotically; p = Q((m-1)/2, X^2/2)
(``torch.special.gammaincc``); reject at ALPHA = 1e-3.

Power. Let the two cell distributions be p_a (AR), p_b (SD), delta = p_a - p_b, total variation
d = sum|delta| / 2, sample sizes n_a, n_b, N = n_a + n_b and p_bar = (n_a p_a + n_b p_b) / N. Under
the alternative X^2 is approximately noncentral chi-square with m - 1 degrees of freedom and

    lambda = N * sum_{s,i} (pi_si - pi_s. pi_.i)^2 / (pi_s. pi_.i) = (n_a n_b / N) * sum_i delta_i^2 / p_bar_i

(pi = the 2 x m table of joint proportions, w_s = n_s / N: pi_si - pi_s. pi_.i = w_s (p_si - p_bar_i),
p_a - p_bar = w_b delta, p_b - p_bar = -w_a delta). By Cauchy-Schwarz,
(sum|delta_i|)^2 <= (sum delta_i^2 / p_bar_i)(sum p_bar_i) = sum delta_i^2 / p_bar_i, hence for ANY
shift of total variation d on the tested cells

    lambda >= 4 d^2 n_a n_b / N          (= 2 n d^2 when n_a = n_b = n),

with equality when |delta_i| is proportional to p_bar_i (the shift spread over all cells: the worst
case, whatever m is). Power = P(chi2'(m - 1, lambda) > chi2^-1_{1-ALPHA}(m - 1)). For d = 0.02 and
ALPHA = 1e-3 the noncentrality needed for power 0.9 is 25.9 / 31.8 / 37.0 / 40.4 at m - 1 = 3 / 7 /
12 / 16 degrees of freedom (0.8: 21.5 / 26.8 / 31.4 / 34.4), i.e. n = lambda / (2 d^2) = 32,400 /
39,800 / 46,300 / 50,500 samples per side for 0.9 (26,900 / 33,500 / 39,300 / 43,000 for 0.8).
After pooling, the plain T = 1 table has 13-14 cells (12-13 dof: the support has 256 cells, but the
~243 with expected count < 5 hold 0.04% of the mass and form one pooled cell), top_k = 3 has 8
(7 dof; support 9, the smallest cell is pooled into the next) and top_p = 0.9 has 4 (3 dof).
We use n_a = n_b = 48,000 / 42,000 / 34,000: lambda_min = 38.4 / 33.6 / 27.2 and power
0.917 (0.906 at 13 dof) / 0.923 / 0.919 against the least favourable shift of total variation 0.02
(248,000 requests in all). Each test recomputes the power from the degrees of freedom it actually got
(``ncx2_sf``: the Poisson mixture of central chi-square tails; checked against known values) and
asserts it is >= 0.8, so a change that adds cells cannot silently weaken the test. d is the total
variation on the tested (pooled) cells.

Negative controls, through the same helper against the same AR sample (6,000 SD samples each):
(1) the engine's `verify` replaced by one that accepts every draft token at T > 0 (it passes p := q
at the drafted positions, so u * q < p always holds): t2 then follows q, total variation 0.51 from
AR; (2) a subtler bug: after a rejection the bonus is drawn from p instead of the residual
max(0, p - q): total variation 0.026. Both must be rejected with p < 1e-3.

Family-wise false alarms: 3 homogeneity tests at 1e-3 each (<= 0.3%). Seeds are fixed, so a given
checkout passes or fails deterministically. Run with -s to see the statistics.
"""
from __future__ import annotations

import json
import math
import os
import shutil
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from ssd_engine import LLM, SamplingParams
from ssd_engine.engine import llm_engine
from ssd_engine.sampling import rejection
from ssd_engine.spec.sync_draft import SyncDraft

NEW_TOKENS = 48
TOKENIZER_IDS = 259  # byte-level test tokenizer: 3 specials + 256 bytes (transformers' Qwen2Tokenizer
                     # adds <|endoftext|> as id 259, so len() is 260 for qwen2); models have vocab 320
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
COMMON = dict(num_threads=1, block_size=8)

ALPHA = 1e-3
DESIGN_TV = 0.02
DESIGN_POWER = 0.8


# --------------------------------------------------------------------------- checkpoints


def _prompts(n: int) -> list[list[int]]:
    """Ragged prompts of byte ids; odd ones share a 20-token prefix (more than one page)."""
    shared = [(11 * i) % 250 + 3 for i in range(20)]
    prompts = []
    for i in range(n):
        own = [(31 * i + 7 * j) % 250 + 3 for j in range(3 + 5 * i)]
        prompts.append(shared + own if i % 2 else own)
    return prompts


def _derived(src: str, dst: str, transform) -> str:
    """Copy checkpoint `src` to `dst`, replacing its weights by transform(state_dict)."""
    shutil.copytree(src, dst, dirs_exist_ok=True)
    state = load_file(os.path.join(src, "model.safetensors"))
    save_file(transform(state), os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


def _with_eos(src: str, dst: str, eos: int) -> str:
    """Copy of `src` whose config and generation config name `eos` as the EOS token."""
    shutil.copytree(src, dst, dirs_exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        path = os.path.join(dst, name)
        if os.path.exists(path):
            with open(path) as f:
                data = json.load(f)
            data["eos_token_id"] = eos
            with open(path, "w") as f:
                json.dump(data, f)
    return dst


@pytest.fixture(scope="module")
def target(tiny_model_dir) -> str:
    return tiny_model_dir("qwen2")  # vocab 320: ids 260..319 are embedding padding


@pytest.fixture(scope="module")
def noisy_draft(target, tmp_path_factory) -> str:
    """The target plus N(0, 0.005^2) on every matrix: a different model that often agrees."""
    gen = torch.Generator().manual_seed(1)

    def perturb(state):
        return {k: v + 0.005 * torch.randn(v.shape, generator=gen) if v.dim() == 2 else v for k, v in state.items()}
    return _derived(target, str(tmp_path_factory.mktemp("noisy_draft")), perturb)


@pytest.fixture(scope="module")
def random_draft(tiny_model_dir) -> str:
    return tiny_model_dir("qwen2", seed=1, num_hidden_layers=1)  # unrelated: different seed and depth


@pytest.fixture(scope="module")
def target_nopad(tiny_model_dir) -> str:
    return tiny_model_dir("qwen2", vocab_size=TOKENIZER_IDS)  # no padding: a self-draft proposes anything


@pytest.fixture(scope="module")
def oracle(target) -> list[list[int]]:
    return greedy_oracle(target)


def greedy_oracle(path: str) -> list[list[int]]:
    """transformers' greedy continuation (EOS ignored) of _prompts(8); _prompts(n) is a prefix."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = []
    for p in _prompts(8):
        out = model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
        outs.append(out[0, len(p):].tolist())
    return outs


def _sd(target: str, draft: str, k: int, **options) -> LLM:
    return LLM(target, draft_model=draft, speculative_mode="sd", num_speculative_tokens=k, **{**COMMON, **options})


def _check_metrics(outputs, k: int) -> None:
    """Per-request metrics are self-consistent and account for every emitted token."""
    for out in outputs:
        m = out.spec_metrics
        hist = m["accepted_length_histogram"]
        assert len(hist) == k + 1 and sum(hist) == m["rounds"] > 0
        assert sum(a * c for a, c in enumerate(hist)) == m["accepted"] and m["drafted"] == k * m["rounds"]
        assert m["acceptance_rate"] == pytest.approx(m["accepted"] / m["drafted"])
        assert m["mean_acceptance_length"] == pytest.approx(1 + m["accepted"] / m["rounds"])
        per_pos = m["per_position_acceptance_rate"]
        assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))  # accepted prefixes: non-increasing
        # the prefill gives token 1; each round a + 1 more, the last round possibly cut by a stop
        produced = 1 + m["rounds"] + m["accepted"]
        assert produced - (k + 1) < len(out.token_ids) <= produced


# --------------------------------------------------------------------------- 1. greedy = transformers


@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("k", [1, 4, 8])
def test_greedy_sd_matches_transformers(target, noisy_draft, oracle, batch, k):
    with _sd(target, noisy_draft, k) as llm:
        outputs = llm.generate(_prompts(batch), GREEDY, use_tqdm=False)
        totals = llm.speculation_metrics()
    assert [o.token_ids for o in outputs] == oracle[:batch]
    assert all(o.finish_reason == "length" for o in outputs)
    _check_metrics(outputs, k)
    assert totals["rounds"] == sum(o.spec_metrics["rounds"] for o in outputs)
    assert totals["accepted"] == sum(o.spec_metrics["accepted"] for o in outputs)
    if batch == 8:  # the noisy draft exercises partial acceptance, not just all-or-nothing
        assert 0 < totals["acceptance_rate"] < 1
        if k > 1:
            assert sum(1 for c in totals["accepted_length_histogram"][1:k] if c) >= 1


def test_greedy_sd_under_preemption(target, oracle):
    # 8 sequences of up to ~110 tokens + K slots need ~110 pages of 8; 40 force preemption by recompute.
    # The draft is the target itself (it still rejects: it never proposes the padding ids the target
    # emits) and prefix caching is off.
    with _sd(target, target, 4, num_kv_blocks=40, enable_prefix_caching=False) as llm:
        outputs = llm.generate(_prompts(8), GREEDY, use_tqdm=False)
        preemptions = llm.engine.scheduler.num_preemptions
        totals = llm.speculation_metrics()
    assert preemptions > 0
    assert [o.token_ids for o in outputs] == oracle
    assert 0 < totals["acceptance_rate"] < 1
    _check_metrics(outputs, 4)


@pytest.mark.parametrize("caching", [True, False], ids=["prefix_caching", "no_prefix_caching"])
def test_greedy_sd_under_kv_pressure(target, noisy_draft, oracle, caching):
    with _sd(target, noisy_draft, 4, num_kv_blocks=30, enable_prefix_caching=caching) as llm:
        outputs = llm.generate(_prompts(8), GREEDY, use_tqdm=False)
        preemptions = llm.engine.scheduler.num_preemptions
        totals = llm.speculation_metrics()
    assert preemptions > 0
    assert [o.token_ids for o in outputs] == oracle
    assert totals["rounds"] > 0


def test_greedy_sd_with_chunked_prefill(target, noisy_draft, oracle):
    # a step holds 7 tokens: prompts (up to 58 tokens) are prefilled in chunks, and one verification
    # of K + 1 = 5 tokens fits next to at most a 2-token prefill chunk
    with _sd(target, noisy_draft, 4, max_num_batched_tokens=7, block_size=4) as llm:
        outputs = llm.generate(_prompts(8), GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == oracle
    _check_metrics(outputs, 4)


def test_greedy_sd_with_prefix_cache_hits(target, noisy_draft, oracle):
    # the second run finds every full prompt page cached; _prompts(8)[6] has 33 = 4 * 8 + 1 tokens,
    # so it is admitted with a single token left to compute (regression: that used to be mistaken
    # for a decoding step and crash the target forward)
    assert any(len(p) % 8 == 1 for p in _prompts(8))
    with _sd(target, noisy_draft, 4) as llm:
        first = llm.generate(_prompts(8), GREEDY, use_tqdm=False)
        again = llm.generate(_prompts(8), GREEDY, use_tqdm=False)
    assert [o.token_ids for o in first] == oracle
    assert [o.token_ids for o in again] == oracle
    assert all(o.metrics.num_cached_tokens >= (len(o.prompt_token_ids) - 1) // 8 * 8 for o in again)


def test_sd_rejects_budget_below_one_verification(target, noisy_draft):
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        _sd(target, noisy_draft, 4, max_num_batched_tokens=4)


# --------------------------------------------------------------------------- 2. self-speculation


@pytest.mark.parametrize("k", [1, 4])
def test_self_speculation_accepts_everything(target_nopad, k):
    rounds = 9
    params = SamplingParams(temperature=0, max_tokens=1 + rounds * (k + 1), ignore_eos=True)  # no cut round
    prompts = _prompts(3)
    with LLM(target_nopad, **COMMON) as ar:
        expected = [o.token_ids for o in ar.generate(prompts, params, use_tqdm=False)]
    with _sd(target_nopad, target_nopad, k) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        totals = llm.speculation_metrics()
    assert [o.token_ids for o in outputs] == expected
    for out in outputs:
        m = out.spec_metrics
        assert m["acceptance_rate"] == 1.0
        assert m["mean_acceptance_length"] == k + 1
        assert m["rounds"] == rounds and m["accepted_length_histogram"] == [0] * k + [rounds]
        assert m["per_position_acceptance_rate"] == [1.0] * k
    assert totals["acceptance_rate"] == 1.0 and totals["rounds"] == 3 * rounds


def test_self_speculation_at_temperature_one_accepts_almost_everything(target_nopad):
    # p and q come from the same weights (batched differently: equal up to round-off), so every
    # test u * q < p passes but for round-off events of probability ~1e-6
    params = SamplingParams(temperature=1.0, max_tokens=41, ignore_eos=True)
    with _sd(target_nopad, target_nopad, 4) as llm:
        llm.generate(_prompts(4), params, use_tqdm=False)
        totals = llm.speculation_metrics()
    assert totals["acceptance_rate"] > 0.99


# --------------------------------------------------------------------------- 3. unrelated draft


def test_unrelated_draft_accepts_little_and_changes_nothing(target, random_draft, oracle):
    with _sd(target, random_draft, 4) as llm:
        outputs = llm.generate(_prompts(8), GREEDY, use_tqdm=False)
        totals = llm.speculation_metrics()
    print(f"\nunrelated draft: acceptance rate {totals['acceptance_rate']:.3f}, "
          f"histogram {totals['accepted_length_histogram']}")
    assert totals["acceptance_rate"] < 0.2
    assert [o.token_ids for o in outputs] == oracle
    _check_metrics(outputs, 4)


# --------------------------------------------------------------------------- 4. vocabularies


def test_draft_with_other_tokenizer_is_refused(target, noisy_draft, tmp_path):
    draft = shutil.copytree(noisy_draft, tmp_path / "other_tokenizer")
    tok = AutoTokenizer.from_pretrained(draft)
    n_target = len(tok)
    tok.add_tokens(["<extra_a>", "<extra_b>", "<extra_c>"])
    tok.save_pretrained(draft)
    n_draft = len(AutoTokenizer.from_pretrained(draft))
    assert n_draft == n_target + 3
    with pytest.raises(ValueError) as info:
        _sd(target, str(draft), 4)
    message = str(info.value)
    assert str(n_target) in message and str(n_draft) in message, message


def test_draft_never_proposes_embedding_padding(target, noisy_draft, monkeypatch):
    proposals = []
    real_propose = SyncDraft.propose

    def recording(self, batch, decoding):
        proposal = real_propose(self, batch, decoding)
        if proposal is not None:
            proposals.append(proposal)
        return proposal
    monkeypatch.setattr(SyncDraft, "propose", recording)
    sampled = SamplingParams(temperature=1.5, max_tokens=NEW_TOKENS, ignore_eos=True)
    with _sd(target, noisy_draft, 4) as llm:
        greedy_out = llm.generate(_prompts(4), GREEDY, use_tqdm=False)
        n_greedy = len(proposals)
        sampled_out = llm.generate(_prompts(4), sampled, use_tqdm=False)
    # the engine's tokenizer bounds what may be proposed: 259 byte-level ids, plus the
    # <|endoftext|> that transformers' Qwen2Tokenizer adds at id 259; the embedding has 320 rows
    bound = len(AutoTokenizer.from_pretrained(target))
    assert TOKENIZER_IDS <= bound < 320
    assert n_greedy > 0 and len(proposals) > n_greedy
    for prop in proposals:
        assert int(prop.tokens.max()) < bound
        if prop.probs is not None:  # the q rows the tokens were drawn from give padding no mass
            assert prop.probs.shape[-1] == 320
            assert float(prop.probs[..., bound:].abs().sum()) == 0.0
            assert torch.allclose(prop.probs.sum(-1), torch.ones(prop.probs.shape[:2]), atol=1e-5)
    assert any(p.probs is not None for p in proposals[n_greedy:])
    # the padding is live in these random models (the target itself emits padding ids), so the
    # draft's restriction is doing something
    emitted = [t for o in greedy_out + sampled_out for t in o.token_ids]
    assert max(emitted) >= bound


# --------------------------------------------------------------------------- 5. distribution at T > 0

SMALL = dict(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2)
SHARPNESS = 16.0   # lm_head scale: temperature 1 on the scaled model = 1/16 on the raw one
DRAFT_BLEND = 0.27  # draft = (1 - b) * target + b * unrelated: P(accept) about 1/2
DIST_PROMPT = [3, 7, 11, 5, 9]
VARIANTS = {  # name: (sampling params, K, samples per side)
    "T=1": (SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True), 2, 48_000),
    "top_k=3": (SamplingParams(temperature=1.0, top_k=3, max_tokens=2, ignore_eos=True), 3, 42_000),
    "top_p=0.9": (SamplingParams(temperature=1.0, top_p=0.9, max_tokens=2, ignore_eos=True), 1, 34_000),
}
NEGATIVE_CONTROL_SAMPLES = 6_000


@pytest.fixture(scope="module")
def small_pair(tiny_model_dir, tmp_path_factory) -> tuple[str, str]:
    base = tiny_model_dir("qwen2", **SMALL)
    other = load_file(os.path.join(tiny_model_dir("qwen2", seed=1, **SMALL), "model.safetensors"))

    def sharpen(state, blend=0.0):
        state = {k: (1 - blend) * v + blend * other[k] if v.dim() == 2 else v for k, v in state.items()}
        state["lm_head.weight"] = state["lm_head.weight"] * SHARPNESS
        return state
    tgt = _derived(base, str(tmp_path_factory.mktemp("small_target")), sharpen)
    drf = _derived(base, str(tmp_path_factory.mktemp("small_draft")), lambda s: sharpen(s, DRAFT_BLEND))
    return tgt, drf


def _sample_pairs(llm: LLM, params: SamplingParams, n: int) -> Counter:
    """n independent requests of one prompt, run through the engine loop in one go (as `generate`
    does, without building n RequestOutputs); counts of their output token tuples."""
    engine = llm.engine
    seqs = [engine.add_request(DIST_PROMPT, params) for _ in range(n)]
    while engine.has_unfinished():
        engine.step()
    assert all(len(s.output_token_ids) == params.max_tokens for s in seqs)
    return Counter(tuple(s.output_token_ids) for s in seqs)


def _engine_options(**extra) -> dict:
    # many short requests at once; a small max_model_len keeps the KV allocation small
    return dict(num_threads=1, max_num_seqs=1024, max_num_batched_tokens=1 << 16, max_model_len=16, **extra)


def homogeneity_test(a: Counter, b: Counter) -> tuple[float, int, float, int, int]:
    """Two-sample chi-square homogeneity test -> (statistic, dof, p-value, n_a, n_b)."""
    n_a, n_b = sum(a.values()), sum(b.values())
    total = n_a + n_b
    smaller = min(n_a, n_b) / total
    cells = [(a[key], b[key]) for key in sorted(set(a) | set(b))]
    small = [c for c in cells if (c[0] + c[1]) * smaller < 5]
    big = sorted((c for c in cells if (c[0] + c[1]) * smaller >= 5), key=lambda c: c[0] + c[1])
    pool = [sum(x for x, _ in small), sum(y for _, y in small)]
    while 0 < sum(pool) * smaller < 5 and big:  # grow the pooled cell with the smallest big cells
        x, y = big.pop(0)
        pool = [pool[0] + x, pool[1] + y]
    table = big + ([tuple(pool)] if sum(pool) else [])
    stat = 0.0
    for x, y in table:
        e_a, e_b = (x + y) * n_a / total, (x + y) * n_b / total
        stat += (x - e_a) ** 2 / e_a + (y - e_b) ** 2 / e_b
    dof = len(table) - 1
    return stat, dof, chi2_sf(stat, dof), n_a, n_b


def chi2_sf(x: float, dof: int) -> float:
    if dof <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(x / 2, dtype=torch.float64)))


def chi2_isf(alpha: float, dof: int) -> float:
    lo, hi = 0.0, 10.0 * dof + 100.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chi2_sf(mid, dof) > alpha else (lo, mid)
    return (lo + hi) / 2


def ncx2_sf(x: float, dof: int, lam: float) -> float:
    """P(noncentral chi2(dof, lam) > x) = sum_j Poisson(j; lam/2) * P(chi2(dof + 2j) > x)."""
    half = lam / 2
    terms = int(half + 12 * math.sqrt(half) + 30)
    j = torch.arange(terms, dtype=torch.float64)
    weights = torch.exp(-half + j * math.log(half) - torch.lgamma(j + 1)) if half > 0 else (j == 0).double()
    tails = torch.special.gammaincc((dof + 2 * j) / 2, torch.full_like(j, x / 2))
    return float((weights * tails).sum())


def design_power(dof: int, n_a: int, n_b: int, tv: float = DESIGN_TV) -> float:
    """Power against the least detectable shift of total variation `tv` (see the module docstring)."""
    lam = 4 * tv ** 2 * n_a * n_b / (n_a + n_b)
    return ncx2_sf(chi2_isf(ALPHA, max(dof, 1)), max(dof, 1), lam)


def test_power_helpers_against_known_values():
    assert chi2_isf(1e-3, 4) == pytest.approx(18.467, abs=1e-3)
    assert chi2_isf(1e-3, 12) == pytest.approx(32.909, abs=1e-3)
    assert ncx2_sf(18.467, 4, 23.1) == pytest.approx(0.80, abs=0.005)
    assert ncx2_sf(32.909, 12, 37.0) == pytest.approx(0.90, abs=0.005)
    assert design_power(8, 34_800, 34_800) == pytest.approx(0.80, abs=0.01)


@pytest.fixture(scope="module")
def ar_samples(small_pair):
    """AR reference samples per variant (shared by the SD tests and the negative controls)."""
    target, _ = small_pair
    cache = {}

    def get(name: str) -> Counter:
        if name not in cache:
            params, _, n = VARIANTS[name]
            with LLM(target, **_engine_options(seed=11)) as llm:
                cache[name] = _sample_pairs(llm, params, n)
        return cache[name]
    return get


def _sd_samples(small_pair, name: str, n: int | None = None, seed: int = 12) -> tuple[Counter, dict]:
    target, draft = small_pair
    params, k, default_n = VARIANTS[name]
    with LLM(target, **_engine_options(seed=seed, draft_model=draft, speculative_mode="sd",
                                         num_speculative_tokens=k)) as llm:
        counts = _sample_pairs(llm, params, n or default_n)
        return counts, llm.speculation_metrics()


def _report(label: str, result, metrics: dict, power: bool = True) -> None:
    stat, dof, p, n_a, n_b = result
    extra = f", power vs TV {DESIGN_TV} = {design_power(dof, n_a, n_b):.3f}" if power else ""
    print(f"\n{label}: chi2 = {stat:.2f}, dof = {dof}, p = {p:.3g}, n = {n_a} AR / {n_b} SD{extra}, "
          f"P(accept draft 1) = {metrics['per_position_acceptance_rate'][0]:.3f}")


@pytest.mark.parametrize("name", list(VARIANTS))
def test_sd_first_two_tokens_match_ar(small_pair, ar_samples, name):
    ar = ar_samples(name)
    sd, metrics = _sd_samples(small_pair, name)
    result = homogeneity_test(ar, sd)
    _report(f"SD vs AR [{name}]", result, metrics)
    stat, dof, p, n_a, n_b = result
    assert 0.2 < metrics["per_position_acceptance_rate"][0] < 0.9  # both branches carry real mass
    assert dof >= 2
    assert design_power(dof, n_a, n_b) >= DESIGN_POWER, "too many cells for the sample size: raise n"
    assert p >= ALPHA, f"SD's (t1, t2) distribution differs from AR's: chi2 = {stat:.1f}, dof = {dof}, p = {p:.2e}"


def _accept_all(draft_tokens, draft_probs, target_probs, generators, num_draft=None, default_generator=None,
                **options):
    """BROKEN on purpose: p := q at every drafted position, so every draft token is accepted."""
    k = draft_tokens.shape[1]
    forced = target_probs.clone()
    forced[:, :k] = draft_probs
    return rejection.verify(draft_tokens, draft_probs, forced, generators, num_draft, default_generator, **options)


def _bonus_from_p(draft_tokens, draft_probs, target_probs, generators, num_draft=None, default_generator=None,
                  **options):
    """BROKEN on purpose: after a rejection the bonus is drawn from p instead of max(0, p - q)."""
    result = rejection.verify(draft_tokens, draft_probs, target_probs, generators, num_draft, default_generator,
                              **options)
    rejected = [i for i, a in enumerate(result.num_accepted.tolist()) if a < draft_tokens.shape[1]]
    if rejected:
        p = target_probs[rejected, result.num_accepted[rejected]]
        redrawn = torch.multinomial(p, 1, generator=default_generator).squeeze(1).tolist()
        for i, t in zip(rejected, redrawn):
            result.output_tokens[i][-1] = t
    return result


@pytest.mark.parametrize("broken", [_accept_all, _bonus_from_p], ids=["accept_all", "bonus_from_p"])
def test_negative_control_broken_verifier_is_rejected(small_pair, ar_samples, monkeypatch, broken):
    monkeypatch.setattr(llm_engine, "verify", broken)
    ar = ar_samples("T=1")
    sd, metrics = _sd_samples(small_pair, "T=1", n=NEGATIVE_CONTROL_SAMPLES, seed=13)
    result = homogeneity_test(ar, sd)
    _report(f"NEGATIVE CONTROL [{broken.__name__}] vs AR [T=1]", result, metrics, power=False)
    assert result[2] < ALPHA


# --------------------------------------------------------------------------- 6. seeded requests


def test_seeded_sd_reproducible_alone_and_in_batch(target, noisy_draft, oracle):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=32, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=32, ignore_eos=True)
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    prompts = _prompts(5)
    with _sd(target, noisy_draft, 4) as llm:
        alone = llm.generate([prompts[1]], seeded, use_tqdm=False)[0].token_ids
        mixed = llm.generate(prompts, [other, seeded, other, greedy, other], use_tqdm=False)
    with _sd(target, noisy_draft, 4, seed=99) as fresh:  # another engine, another shared RNG state
        again = fresh.generate([prompts[0], prompts[1]], [other, seeded], use_tqdm=False)
    assert mixed[1].token_ids == alone
    assert again[1].token_ids == alone
    assert mixed[3].token_ids == oracle[3][:32]  # greedy stays exact inside a sampled SD batch
    assert len({tuple(o.token_ids) for o in (mixed[0], mixed[2], mixed[4])}) > 1 or \
        mixed[0].token_ids != again[0].token_ids  # unseeded requests really sample
    assert mixed[1].spec_metrics["rounds"] > 0


# --------------------------------------------------------------------------- 7. stops inside accepted runs

STOP_K = 4
STOP_N = 24


def _first_fresh_index(ids: list[int], candidates) -> int:
    """First index in `candidates` whose token does not occur earlier in `ids`."""
    return next(j for j in candidates if ids[j] not in ids[:j])


@pytest.mark.parametrize("draft_kind", ["self", "noisy"])
def test_stops_inside_accepted_runs_match_ar(target, target_nopad, noisy_draft, tmp_path, draft_kind):
    tgt, drf = (target_nopad, target_nopad) if draft_kind == "self" else (target, noisy_draft)
    prompts = _prompts(3)
    with LLM(tgt, **COMMON) as ar:
        refs = [o.token_ids for o in ar.generate(prompts, SamplingParams(temperature=0, max_tokens=STOP_N,
                                                                          ignore_eos=True), use_tqdm=False)]
    # With a self-draft every round accepts all K, so output index j sits at position j - 1 - (K+1)r of
    # an accepted run; indices 1..K and K+2..2K+1 are inside a run (K+1 is the first round's bonus).
    inside = [2, 3, 1, 4, 7, 8, 9, 6]
    cases = {tgt: [], None: []}  # checkpoint -> [(prompt index, params, expected cut index or None)]
    for i, ref in enumerate(refs):
        j = _first_fresh_index(ref, inside)
        cases[tgt].append((i, SamplingParams(temperature=0, max_tokens=STOP_N, stop_token_ids=[ref[j]]), j))
        cases[tgt].append((i, SamplingParams(temperature=0, max_tokens=j + 1, ignore_eos=True), j))
    # EOS: a copy of the target whose EOS is a token its greedy run emits inside an accepted run
    j = _first_fresh_index(refs[0], inside)
    eos_target = _with_eos(tgt, str(tmp_path / "eos_target"), refs[0][j])
    cases[eos_target] = [(0, SamplingParams(temperature=0, max_tokens=STOP_N), j),
                         (0, SamplingParams(temperature=0, max_tokens=STOP_N, ignore_eos=True), None)]
    del cases[None]

    for checkpoint, group in cases.items():
        batch_prompts = [prompts[i] for i, _, _ in group]
        batch_params = [params for _, params, _ in group]
        with LLM(checkpoint, **COMMON) as ar:
            wants = ar.generate(batch_prompts, batch_params, use_tqdm=False)
        with _sd(checkpoint, drf, STOP_K) as sd:
            gots = sd.generate(batch_prompts, batch_params, use_tqdm=False)
        for (i, params, j), want, got in zip(group, wants, gots):
            assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason), (params, j)
            if j is None:
                assert got.token_ids == refs[i] and got.finish_reason == "length"
                continue
            assert got.token_ids == refs[i][:j + 1]
            assert got.finish_reason == ("length" if params.max_tokens == j + 1 else "stop")
            if draft_kind == "self":  # the stop really fell inside a fully accepted run
                m = got.spec_metrics
                assert m["accepted_length_histogram"] == [0] * STOP_K + [m["rounds"]]
                assert len(got.token_ids) < 1 + m["rounds"] * (STOP_K + 1)
