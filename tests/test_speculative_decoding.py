"""Speculative decoding (SD, colocated draft) end to end: exact at T = 0, seeded requests reproducible.

Greedy. SD output must be token-identical to transformers' greedy `generate` (EOS ignored, 48 new
tokens) at batch 1 / 3 / 8 with ragged prompts and K in {1, 4, 8}, under forced preemption, under
chunked prefill and with prompts served (all but one token) from the prefix cache, and under KV
pressure where the draft's private blocks run short before the target's (the draft then skips
drafting for a sequence, which takes a plain target step). The draft is a different model: the target's weights plus Gaussian noise (so it agrees
often but not always: partial acceptances occur). A self-draft accepts everything; an
unrelated random draft accepts almost nothing; neither changes a single output token. Stops (EOS,
stop_token_ids, max_tokens) that fall inside an accepted run cut it exactly where AR stops.

Distribution at T > 0 (seeded and unseeded, every path, with negative controls) is in
test_distribution.py; seeded reproducibility alone and in a batch is here.
"""

from __future__ import annotations

import json
import os
import shutil

import hf_oracle
import pytest
import torch
from cpu_features import NEEDS_BF16
from ssd_engine.kernels import gguf_cpu
from tiny_checkpoints import derived_checkpoint as _derived
from transformers import AutoTokenizer

from ssd_engine import LLM, SamplingParams
from ssd_engine.layers.weight_formats import ACTIVATION_DTYPE
from ssd_engine.speculative.sd import SyncDraft

NEW_TOKENS = 48
TOKENIZER_IDS = (
    259  # byte-level test tokenizer: 3 specials + 256 bytes (transformers' Qwen2Tokenizer
)
# adds <|endoftext|> as id 259, so len() is 260 for qwen2); models have vocab 320
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
COMMON = dict(num_threads=1, block_size=8, speculation_per_step="off")  # SD drafting every step

NEEDS_Q4K = pytest.mark.skipif(
    not gguf_cpu.panels_available(int8_activations=True),
    reason="the q4k draft format needs AVX-512 VNNI and a C++ compiler",
)


# --------------------------------------------------------------------------- checkpoints


def _prompts(n: int) -> list[list[int]]:
    """Ragged prompts of byte ids; odd ones share a 20-token prefix (more than one block)."""
    shared = [(11 * i) % 250 + 3 for i in range(20)]
    prompts = []
    for i in range(n):
        own = [(31 * i + 7 * j) % 250 + 3 for j in range(3 + 5 * i)]
        prompts.append(shared + own if i % 2 else own)
    return prompts


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
        return {
            k: v + 0.005 * torch.randn(v.shape, generator=gen) if v.dim() == 2 else v
            for k, v in state.items()
        }

    return _derived(target, str(tmp_path_factory.mktemp("noisy_draft")), perturb)


@pytest.fixture(scope="module")
def random_draft(tiny_model_dir) -> str:
    return tiny_model_dir(
        "qwen2", seed=1, num_hidden_layers=1
    )  # unrelated: different seed and depth


@pytest.fixture(scope="module")
def target_nopad(tiny_model_dir) -> str:
    return tiny_model_dir(
        "qwen2", vocab_size=TOKENIZER_IDS
    )  # no padding: a self-draft proposes anything


@pytest.fixture(scope="module")
def oracle(target) -> list[list[int]]:
    return greedy_oracle(target)


def greedy_oracle(path: str) -> list[list[int]]:
    """transformers' greedy continuation (EOS ignored) of _prompts(8); _prompts(n) is a prefix."""
    return hf_oracle.greedy(path, _prompts(8), NEW_TOKENS)


def _sd(target: str, draft: str, k: int, **options) -> LLM:
    return LLM(
        target,
        draft_model=draft,
        speculative_mode="sd",
        num_speculative_tokens=k,
        **{**COMMON, **options},
    )


def _check_metrics(outputs, k: int, preemptions: int = 0) -> None:
    """Per-request metrics are self-consistent and account for every emitted token. A sequence
    preempted by recompute reads its tokens again, and that prefill emits its next token outside any
    round: each of the run's `preemptions` may add one token to some request."""
    for out in outputs:
        m = out.spec_metrics
        hist = m["accepted_length_histogram"]
        assert len(hist) == k + 1 and sum(hist) == m["rounds"] > 0
        assert (
            sum(a * c for a, c in enumerate(hist)) == m["accepted"]
            and m["drafted"] == k * m["rounds"]
        )
        assert m["acceptance_rate"] == pytest.approx(m["accepted"] / m["drafted"])
        assert m["mean_acceptance_length"] == pytest.approx(1 + m["accepted"] / m["rounds"])
        per_pos = m["per_position_acceptance_rate"]
        assert all(
            a >= b for a, b in zip(per_pos, per_pos[1:])
        )  # accepted prefixes: non-increasing
        # the prefill gives token 1; each round a + 1 more, the last round possibly cut by a stop
        produced = 1 + m["rounds"] + m["accepted"]
        assert produced - (k + 1) < len(out.token_ids) <= produced + preemptions


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


@pytest.mark.parametrize(
    "draft_dtype",
    [pytest.param("bf16", marks=NEEDS_BF16), "int4", pytest.param("q4k", marks=NEEDS_Q4K)],
)
def test_greedy_sd_with_a_low_precision_draft_matches_transformers(
    target, noisy_draft, oracle, draft_dtype
):
    """The draft in bf16, int4 (bf16 activations, bf16 KV) or q4k (int8-rounded activations): its q
    rows change, the output does not."""
    with _sd(target, noisy_draft, 3, draft_dtype=draft_dtype) as llm:
        assert llm.engine.plan.draft_format.name == draft_dtype
        assert llm.engine.execution()["draft_format"].startswith(draft_dtype)
        draft = llm.engine.speculator.runner
        assert (
            draft.dtype == ACTIVATION_DTYPE[draft_dtype]
            and llm.engine.runner.dtype == torch.float32
        )  # the target stays fp32
        outputs = llm.generate(_prompts(8), GREEDY, use_tqdm=False)
        assert 0 < llm.speculation_metrics()["acceptance_rate"] < 1
    assert [o.token_ids for o in outputs] == oracle


def test_greedy_sd_under_preemption(target, oracle):
    # 8 sequences of up to ~110 tokens + K slots need ~110 blocks of 8; 40 force preemption by recompute.
    # The draft is the target itself (it still rejects: it never proposes the padding ids the target
    # emits) and prefix caching is off.
    with _sd(target, target, 4, num_kv_blocks=40, enable_prefix_caching=False) as llm:
        outputs = llm.generate(_prompts(8), GREEDY, use_tqdm=False)
        preemptions = llm.engine.scheduler.num_preemptions
        totals = llm.speculation_metrics()
    assert preemptions > 0
    assert [o.token_ids for o in outputs] == oracle
    assert 0 < totals["acceptance_rate"] < 1
    _check_metrics(outputs, 4, preemptions)


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
    params = SamplingParams(
        temperature=0, max_tokens=1 + rounds * (k + 1), ignore_eos=True
    )  # no cut round
    prompts = _prompts(3)
    with LLM(target_nopad, **COMMON) as ar:
        expected = [o.token_ids for o in ar.generate(prompts, params, use_tqdm=False)]
    # the draft is the target, bit for bit
    with _sd(target_nopad, target_nopad, k, draft_dtype="fp32") as llm:
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
    # p and q come from the same fp32 weights (batched differently: equal up to round-off), so every
    # test u * q < p passes but for round-off events of probability ~1e-6; a lower-precision draft
    # (what draft_dtype=auto may pick on a busy machine) would reject ~1% for real
    params = SamplingParams(temperature=1.0, max_tokens=41, ignore_eos=True)
    with _sd(target_nopad, target_nopad, 4, draft_dtype="fp32") as llm:
        llm.generate(_prompts(4), params, use_tqdm=False)
        totals = llm.speculation_metrics()
    assert totals["acceptance_rate"] > 0.99


# --------------------------------------------------------------------------- 3. unrelated draft


def test_unrelated_draft_accepts_little_and_changes_nothing(target, random_draft, oracle):
    with _sd(target, random_draft, 4) as llm:
        outputs = llm.generate(_prompts(8), GREEDY, use_tqdm=False)
        totals = llm.speculation_metrics()
    print(
        f"\nunrelated draft: acceptance rate {totals['acceptance_rate']:.3f}, "
        f"histogram {totals['accepted_length_histogram']}"
    )
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

    def recording(self, batch, decoding, k):
        proposal = real_propose(self, batch, decoding, k)
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
            assert torch.allclose(
                prop.probs.sum(-1),
                torch.ones(prop.probs.shape[:2], device=prop.probs.device),
                atol=1e-5,
            )
    assert any(p.probs is not None for p in proposals[n_greedy:])
    # the padding is live in these random models (the target itself emits padding ids), so the
    # draft's restriction is doing something
    emitted = [t for o in greedy_out + sampled_out for t in o.token_ids]
    assert max(emitted) >= bound


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
    assert (
        len({tuple(o.token_ids) for o in (mixed[0], mixed[2], mixed[4])}) > 1
        or mixed[0].token_ids != again[0].token_ids
    )  # unseeded requests really sample
    assert mixed[1].spec_metrics["rounds"] > 0


# --------------------------------------------------------------------------- 7. stops inside accepted runs

STOP_K = 4
STOP_N = 24


def _first_fresh_index(ids: list[int], candidates) -> int:
    """First index in `candidates` whose token does not occur earlier in `ids`."""
    return next(j for j in candidates if ids[j] not in ids[:j])


@pytest.mark.parametrize("draft_kind", ["self", "noisy"])
def test_stops_inside_accepted_runs_match_ar(
    target, target_nopad, noisy_draft, tmp_path, draft_kind
):
    tgt, drf = (target_nopad, target_nopad) if draft_kind == "self" else (target, noisy_draft)
    prompts = _prompts(3)
    with LLM(tgt, **COMMON) as ar:
        refs = [
            o.token_ids
            for o in ar.generate(
                prompts,
                SamplingParams(temperature=0, max_tokens=STOP_N, ignore_eos=True),
                use_tqdm=False,
            )
        ]
    # With a self-draft every round accepts all K, so output index j sits at position j - 1 - (K+1)r of
    # an accepted run; indices 1..K and K+2..2K+1 are inside a run (K+1 is the first round's bonus).
    inside = [2, 3, 1, 4, 7, 8, 9, 6]
    cases = {
        tgt: [],
        None: [],
    }  # checkpoint -> [(prompt index, params, expected cut index or None)]
    for i, ref in enumerate(refs):
        j = _first_fresh_index(ref, inside)
        cases[tgt].append(
            (i, SamplingParams(temperature=0, max_tokens=STOP_N, stop_token_ids=[ref[j]]), j)
        )
        cases[tgt].append((i, SamplingParams(temperature=0, max_tokens=j + 1, ignore_eos=True), j))
    # EOS: a copy of the target whose EOS is a token its greedy run emits inside an accepted run
    j = _first_fresh_index(refs[0], inside)
    eos_target = _with_eos(tgt, str(tmp_path / "eos_target"), refs[0][j])
    cases[eos_target] = [
        (0, SamplingParams(temperature=0, max_tokens=STOP_N), j),
        (0, SamplingParams(temperature=0, max_tokens=STOP_N, ignore_eos=True), None),
    ]
    del cases[None]

    for checkpoint, group in cases.items():
        batch_prompts = [prompts[i] for i, _, _ in group]
        batch_params = [params for _, params, _ in group]
        with LLM(checkpoint, **COMMON) as ar:
            wants = ar.generate(batch_prompts, batch_params, use_tqdm=False)
        with _sd(
            checkpoint, drf, STOP_K, draft_dtype="fp32" if draft_kind == "self" else "auto"
        ) as sd:
            gots = sd.generate(batch_prompts, batch_params, use_tqdm=False)
        for (i, params, j), want, got in zip(group, wants, gots):
            assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason), (
                params,
                j,
            )
            if j is None:
                assert got.token_ids == refs[i] and got.finish_reason == "length"
                continue
            assert got.token_ids == refs[i][: j + 1]
            assert got.finish_reason == ("length" if params.max_tokens == j + 1 else "stop")
            if draft_kind == "self":  # the stop really fell inside a fully accepted run
                m = got.spec_metrics
                assert m["accepted_length_histogram"] == [0] * STOP_K + [m["rounds"]]
                assert len(got.token_ids) < 1 + m["rounds"] * (STOP_K + 1)


def test_a_draft_narrower_than_the_target_reads_ids_it_cannot_embed(target, tiny_model_dir, oracle):
    """The target emits embedding-padding ids (260..319) the draft has no rows for (vocab 261): the
    draft reads them as another id, and the output stays the target's."""
    narrow = tiny_model_dir("qwen2", seed=1, num_hidden_layers=1, vocab_size=TOKENIZER_IDS + 2)
    assert any(t >= TOKENIZER_IDS + 2 for row in oracle for t in row)  # the case arises
    with _sd(target, narrow, 2) as llm:
        outputs = llm.generate(_prompts(8), GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == oracle
