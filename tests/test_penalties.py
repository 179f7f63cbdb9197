"""min_tokens, logit_bias and the repetition / frequency / presence penalties, exact on every path.

Each changes a position's law as a function of the tokens before it; under SD and SSD a
verification row j follows the sequence's tokens and the first j drafts (sampling/penalties.py).

- Rows: `adjusted` against transformers' own processors (tests/exact_law.py `processors`:
  MinNewTokensLength, SequenceBias, RepetitionPenalty, and OpenAI's frequency / presence formula),
  each verification row scored after its own drafts.
- Law (T = 1, every penalty and a bias at once; pair and statistics of test_distribution.py): SD's
  (t1, t2, t3) with K = 2, so t3 comes from a verification row after one draft; SSD's t4 on the hit
  and just-in-time paths; unseeded and seeded. Negative control: penalties that ignore the drafts
  (a row scored after the committed tokens only) are rejected.
- Greedy: AR, SD and SSD give the same tokens, and AR equals transformers' greedy generate with
  the same repetition penalty, bias and min_new_tokens.
- Bad values are one-line errors naming the field; a logit_bias id outside the vocabulary too.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from exact_law import law_table, processors
from small_pair import DIST_PROMPT, sample_outputs
from stats_helpers import check_law, fit

from ssd_engine import LLM, SamplingParams
from ssd_engine.core.structures import Sequence
from ssd_engine.sampling import penalties

ALPHA, DESIGN_POWER, TV = 1e-3, 0.8, 0.03
STRONG = dict(
    temperature=1.0,
    repetition_penalty=1.6,
    presence_penalty=1.2,
    frequency_penalty=0.8,
    logit_bias={4: 1.5, 8: -1.0},
)


def _rows_reference(
    logits: torch.Tensor, seq: Sequence, drafts: list[int], eos: int
) -> torch.Tensor:
    chain = processors(seq.params, seq.num_prompt_tokens, [eos])
    return torch.cat(
        [
            chain(torch.tensor([seq.token_ids + drafts[:j]]), logits[j : j + 1].double())
            for j in range(logits.shape[0])
        ]
    )


@pytest.mark.parametrize(
    "params",
    [
        dict(repetition_penalty=1.4),
        dict(presence_penalty=0.7, frequency_penalty=-0.3),
        dict(logit_bias={5: 2.0, 7: -3}),
        dict(min_tokens=5, stop_token_ids=[9]),
        dict(STRONG, min_tokens=4, stop_token_ids=[9], repetition_penalty=0.8),
    ],
    ids=["repetition", "frequency+presence", "bias", "min_tokens", "all"],
)
def test_each_verification_row_is_processed_after_its_own_drafts(params):
    seq = Sequence([1, 2, 3, 4], SamplingParams(max_tokens=10, **params), block_size=4)
    seq.token_ids += [5, 6, 5]  # three output tokens so far
    drafts = [6, 9, 5]
    logits = torch.randn(len(drafts) + 1, 40, generator=torch.Generator().manual_seed(0)) * 3
    got = penalties.adjusted(logits, [seq], {2}, torch.tensor([drafts]))
    torch.testing.assert_close(
        got.double(), _rows_reference(logits, seq, drafts, eos=2), rtol=1e-6, atol=1e-5
    )  # fp32 rows
    assert not torch.equal(got, logits)


def test_a_request_without_them_keeps_its_logits_untouched():
    seq = Sequence([1, 2], SamplingParams(), block_size=4)
    logits = torch.randn(3, 10)
    assert penalties.adjusted(logits, [seq], {2}, torch.tensor([[3, 4]])) is logits


def test_a_batch_adjusts_each_row_as_it_would_alone():
    """The batch is adjusted in one pass (neutral parameters as identities, one pass per distinct
    repetition penalty): every row's bits are those of its sequence adjusted alone."""
    mixed = [
        dict(),
        dict(repetition_penalty=1.4),
        dict(repetition_penalty=0.8, logit_bias={5: 2.0}),
        dict(presence_penalty=0.7, frequency_penalty=-0.3),
        dict(min_tokens=5, stop_token_ids=[9]),
        dict(STRONG, min_tokens=4, stop_token_ids=[9]),
        dict(logit_bias={7: -3}),
    ]
    seqs = []
    for i, params in enumerate(mixed):
        seq = Sequence([1, 2, 3 + i], SamplingParams(max_tokens=10, **params), block_size=4)
        seq.token_ids += [5, 6, 5][: i % 4]
        seqs.append(seq)
    rows = 3
    logits = torch.randn(len(seqs) * rows, 40, generator=torch.Generator().manual_seed(1)) * 3
    drafts = torch.randint(0, 40, (len(seqs), rows - 1), generator=torch.Generator().manual_seed(2))
    batched = penalties.adjusted(logits, seqs, {2}, drafts)
    alone = torch.cat(
        [
            penalties.adjusted(logits[i * rows : (i + 1) * rows], [seq], {2}, drafts[i : i + 1])
            for i, seq in enumerate(seqs)
        ]
    )
    assert torch.equal(batched, alone)


# --------------------------------------------------------------------------- the law


def _sample(
    small_pair, mode: str, n: int, length: int, seeded: bool, **options
) -> tuple[Counter, dict]:
    return sample_outputs(
        small_pair, mode, n, length, dict(ignore_eos=True, **STRONG), seeded, seed=31, **options
    )


def _check(label: str, sample: Counter, law: dict, metrics: dict) -> None:
    check_law(label, sample, law, metrics, TV, ALPHA, DESIGN_POWER, acceptance=(0.1, 0.95))


@pytest.fixture(scope="module")
def penalised_law(small_pair):
    return law_table(small_pair[0], DIST_PROMPT, STRONG)


@pytest.mark.parametrize("seeded", [False, True], ids=["unseeded", "seeded"])
def test_sd_follows_the_penalised_law(small_pair, penalised_law, seeded):
    sample, metrics = _sample(small_pair, "sd", 15_000, 3, seeded, num_speculative_tokens=2)
    _check(f"SD [{'seeded' if seeded else 'unseeded'}]", sample, penalised_law(3), metrics)


@pytest.mark.parametrize("path", ["hit", "jit"])
def test_ssd_follows_the_penalised_law(small_pair, penalised_law, path):
    from exact_law import marginal

    fanout = dict(ssd_fanout=16) if path == "hit" else dict(ssd_fanout=0)
    sample, metrics = _sample(
        small_pair, "ssd", 10_500, 4, False, num_speculative_tokens=1, ssd_fallback="jit", **fanout
    )
    fourth = Counter()
    for tokens, count in sample.items():
        fourth[(tokens[3],)] += count
    law = {(token,): p for token, p in marginal(penalised_law(4), 3).items()}
    _check(f"SSD [{path}]", fourth, law, metrics)


def test_negative_control_penalties_blind_to_the_drafts_are_rejected(
    small_pair, penalised_law, monkeypatch
):
    real = penalties._output_counts
    monkeypatch.setattr(
        penalties, "_output_counts", lambda seq, drafted, *rest: real(seq, None, *rest)
    )
    sample, _ = _sample(small_pair, "sd", 6_000, 3, False, num_speculative_tokens=2)
    stat, dof, p, n = fit(sample, penalised_law(3))
    print(f"\nNEGATIVE CONTROL [drafts ignored]: chi2 = {stat:.2f}, dof = {dof}, p = {p:.3g}")
    assert p < ALPHA


# --------------------------------------------------------------------------- greedy


GREEDY = dict(
    temperature=0,
    max_tokens=24,
    ignore_eos=True,
    repetition_penalty=1.3,
    logit_bias={40: 2.5, 41: -4},
    presence_penalty=0.5,
    frequency_penalty=0.4,
)


def test_greedy_is_the_same_in_every_mode_and_matches_transformers(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    target = tiny_model_dir("qwen2")
    draft = tiny_model_dir("qwen2", seed=1)
    prompts = [[(7 * i + 3 * j) % 200 + 3 for j in range(6 + 3 * i)] for i in range(3)]
    outputs = {}
    for mode in ("ar", "sd", "ssd"):
        extra = {} if mode == "ar" else dict(draft_model=draft, num_speculative_tokens=3)
        with LLM(target, num_threads=1, speculative_mode=mode, **extra) as llm:
            outputs[mode] = [
                o.token_ids for o in llm.generate(prompts, SamplingParams(**GREEDY), use_tqdm=False)
            ]
    assert outputs["sd"] == outputs["ar"] == outputs["ssd"]
    plain = dict(GREEDY, presence_penalty=0.0, frequency_penalty=0.0, min_tokens=0)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    with LLM(target, num_threads=1, speculative_mode="ar") as llm:
        ours = [o.token_ids for o in llm.generate(prompts, SamplingParams(**plain), use_tqdm=False)]
    for prompt, out in zip(prompts, ours):
        theirs = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=24,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            repetition_penalty=1.3,
            sequence_bias=[[[40], 2.5], [[41], -4.0]],
        )
        assert out == theirs[0, len(prompt) :].tolist()
    assert outputs["ar"] != ours  # the output penalties changed the path


# --------------------------------------------------------------------------- bad values


@pytest.mark.parametrize(
    "values,named",
    [
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-3), "frequency_penalty"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=20, max_tokens=10), "min_tokens"),
        (dict(logit_bias={"x": 1}), "logit_bias"),
        (dict(logit_bias={3: 500}), "logit_bias"),
    ],
)
def test_bad_values_are_one_line_errors_naming_the_field(values, named):
    with pytest.raises(ValueError) as error:
        SamplingParams(**values)
    assert str(error.value).startswith(named) and "\n" not in str(error.value)


def test_a_bias_outside_the_vocabulary_is_refused_and_others_run(tiny_model_dir):
    with LLM(tiny_model_dir("qwen2"), num_threads=1, speculative_mode="ar") as llm:
        with pytest.raises(
            ValueError, match=r"logit_bias / stop_token_ids: token id 100000 is outside"
        ):
            llm.generate([[3, 4, 5]], SamplingParams(logit_bias={100000: 1.0}), use_tqdm=False)
        out = llm.generate(
            [[3, 4, 5]],
            SamplingParams(max_tokens=4, logit_bias={"7": 100}, temperature=0),
            use_tqdm=False,
        )
        assert out[0].token_ids == [7, 7, 7, 7]
