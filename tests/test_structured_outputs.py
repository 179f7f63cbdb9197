"""Structured outputs (sampling/grammar.py): the grammar's mask, exact on every path.

- Law (T = 1; pair and statistics of test_distribution.py): a grammar whose allowed tokens alternate
  between two classes, so every position's mask depends on the token before it. SD's (t1, t2, t3)
  with K = 2 (the grammar combined with penalties and a bias), SSD's t4 on the hit path (unseeded),
  the just-in-time one (seeded) and the fast backup's n-gram proposals; both drafts mask their own
  rows too, for acceptance. Against
  the masked and renormalised float64 law (tests/exact_law.py, xgrammar's own matcher). Negative control: a mask blind to the drafts (every verification row
  masked as after the committed tokens) is rejected.
- Greedy: AR, SD and SSD give the same tokens, equal to transformers' greedy generate with the same
  mask, and each output matches its regex / parses as its JSON schema.
- Bad values are one-line errors naming the field, and a bad request leaves the others running.
"""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest
import torch
from exact_law import GrammarMask, law_table, marginal
from small_pair import DIST_PROMPT, sample_outputs
from stats_helpers import check_law, fit

from ssd_engine import LLM, SamplingParams
from ssd_engine.core.structured_outputs import StructuredOutputsParams
from ssd_engine.sampling.grammar import GrammarState

ALPHA, DESIGN_POWER, TV = 1e-3, 0.8, 0.03
# ids 5-8 are the bytes #$%&, ids 3, 4, 9, 10 are !"'( ; "0" (id 18) lies outside the 16-token vocabulary,
# so the grammar never ends inside the test and end-of-sequence is never allowed
ALTERNATING = dict(grammar='root ::= (a b)+ "0"\na ::= [#$%&]\nb ::= [!"\'(]')
CLASS_A, CLASS_B = {5, 6, 7, 8}, {3, 4, 9, 10}
GRAMMAR_ONLY = dict(temperature=1.0, structured_outputs=ALTERNATING)
# combined with the history's other adjustments (sampling/penalties.py)
WITH_PENALTIES = dict(
    GRAMMAR_ONLY, repetition_penalty=1.6, presence_penalty=1.2, logit_bias={6: 1.5, 3: -1.0}
)


def _sample(
    small_pair,
    mode: str,
    n: int,
    length: int,
    seeded: bool = False,
    params: dict = GRAMMAR_ONLY,
    **options,
) -> tuple[Counter, dict]:
    return sample_outputs(small_pair, mode, n, length, params, seeded, seed=37, **options)


def _check(label: str, sample: Counter, law: dict, metrics: dict) -> None:
    check_law(label, sample, law, metrics, TV, ALPHA, DESIGN_POWER, acceptance=(0.1, 0.97))


@pytest.fixture(scope="module")
def masked_law(small_pair):
    return law_table(small_pair[0], DIST_PROMPT, GRAMMAR_ONLY)


def test_sd_follows_the_masked_and_penalised_law(small_pair, masked_law):
    sample, metrics = _sample(
        small_pair, "sd", 10_000, 3, params=WITH_PENALTIES, num_speculative_tokens=2
    )
    assert all(t[0] in CLASS_A and t[1] in CLASS_B and t[2] in CLASS_A for t in sample)
    _check("SD [grammar + penalties]", sample, masked_law(3, WITH_PENALTIES), metrics)


@pytest.mark.parametrize("path", ["hit", "jit", "fast"])
def test_ssd_follows_the_masked_law(small_pair, masked_law, path):
    # four tokens are allowed at each position (the draft ranks its bonus candidates among them): a fan-out of
    # four caches every outcome
    fanout = dict(ssd_fanout=4) if path == "hit" else dict(ssd_fanout=0)
    sample, metrics = _sample(
        small_pair,
        "ssd",
        6_000,
        4,
        seeded=path == "jit",
        num_speculative_tokens=1,
        ssd_fallback="fast" if path == "fast" else "jit",
        **fanout,
    )
    fourth = Counter()
    for tokens, count in sample.items():
        fourth[(tokens[3],)] += count
    law = {(token,): p for token, p in marginal(masked_law(4), 3).items()}
    _check(f"SSD [{path}, {'seeded' if path == 'jit' else 'unseeded'}]", fourth, law, metrics)
    assert metrics["cache_hit_rate_warm"] == (1.0 if path == "hit" else 0.0)
    assert (
        set(metrics["speculations_by_source"])
        == {"hit": {"hit", "jit"}, "jit": {"jit"}, "fast": {"fast"}}[path]
    )
    # the draft process follows the grammar too (0.18 when its drafts went unmasked)
    if path != "fast":
        assert metrics["acceptance_rate"] > 0.4


def test_negative_control_a_mask_blind_to_the_drafts_is_rejected(
    small_pair, masked_law, monkeypatch
):
    real = GrammarState.along
    monkeypatch.setattr(GrammarState, "along", lambda self, drafts, rows: real(self, [], rows))
    sample, _ = _sample(small_pair, "sd", 2_000, 3, num_speculative_tokens=2)
    stat, dof, p, n = fit(sample, masked_law(3))
    print(f"\nNEGATIVE CONTROL [drafts ignored]: chi2 = {stat:.2f}, dof = {dof}, p = {p:.3g}")
    assert p < ALPHA


# --------------------------------------------------------------------------- greedy

REGEX = r"[a-c]{3}-[0-9]{1,4}(x|yy)"
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "kind": {"enum": ["cat", "dog", "emu"]}},
    "required": ["ok", "kind"],
    "additionalProperties": False,
}


SPECS = {
    "regex": dict(regex=REGEX),
    "json": dict(json=SCHEMA),
    "choice": dict(choice=["yes", "no", '"maybe"']),
}
PROMPTS = ["hello", "def f(x):", "1, 2, 3,"]


def _parses(kind: str, text: str) -> bool:
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in SPECS["choice"]["choice"]
    value = json.loads(text)
    return (
        set(value) == {"ok", "kind"}
        and isinstance(value["ok"], bool)
        and value["kind"] in ("cat", "dog", "emu")
    )


def test_greedy_is_the_same_in_every_mode_matches_transformers_and_parses(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessorList

    target = tiny_model_dir("qwen2")
    draft = tiny_model_dir("qwen2", seed=1)
    outputs = {}
    for mode in ("ar", "sd", "ssd"):
        extra = {} if mode == "ar" else dict(draft_model=draft, num_speculative_tokens=3)
        with LLM(target, num_threads=1, speculative_mode=mode, **extra) as llm:
            for kind, spec in SPECS.items():
                params = SamplingParams(temperature=0, max_tokens=160, structured_outputs=spec)
                outputs[mode, kind] = llm.generate(PROMPTS, params, use_tqdm=False)
    for kind in SPECS:
        tokens = {mode: [o.token_ids for o in outputs[mode, kind]] for mode in ("ar", "sd", "ssd")}
        assert tokens["sd"] == tokens["ar"] == tokens["ssd"], kind
        for out in outputs["ar", kind]:
            # each grammar ends within 160 tokens (JSON's whitespace runs are capped)
            assert out.finish_reason == "stop" and _parses(kind, out.text), (kind, out.text)
    tokenizer = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    choice = "root ::= " + " | ".join(json.dumps(c) for c in SPECS["choice"]["choice"])
    for kind, spec in (
        ("regex", StructuredOutputsParams(regex=REGEX)),
        ("choice", StructuredOutputsParams(grammar=choice)),
    ):
        # the oracle compiles regexes and grammars
        for prompt, out in zip(PROMPTS, outputs["ar", kind]):
            ids = tokenizer.encode(prompt)
            mask = GrammarMask(spec, tokenizer, len(ids), [2])
            theirs = model.generate(
                torch.tensor([ids]),
                max_new_tokens=160,
                do_sample=False,
                pad_token_id=0,
                logits_processor=LogitsProcessorList([mask]),
            )
            assert out.token_ids == theirs[0, len(ids) :].tolist()


# --------------------------------------------------------------------------- bad values


@pytest.mark.parametrize(
    "value,message",
    [
        (dict(), "structured_outputs must set exactly one of"),
        (dict(regex="a", choice=["b"]), "structured_outputs must set exactly one of"),
        (dict(choice="yes"), "structured_outputs.choice must be a non-empty list"),
        (dict(schema={}), "structured_outputs has unknown field(s) schema"),
    ],
)
def test_bad_shapes_are_one_line_errors(value, message):
    with pytest.raises(ValueError) as error:
        SamplingParams(structured_outputs=value)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_a_grammar_that_does_not_compile_is_refused_and_others_run(tiny_qwen2):
    with LLM(tiny_qwen2, num_threads=1, speculative_mode="ar") as llm:
        for spec, field in (
            (dict(regex="[a-"), "regex"),
            (dict(json='{"type": "object", "properties": 3}'), "json"),
            (dict(grammar="root ::= missing_rule"), "grammar"),
        ):
            with pytest.raises(ValueError) as error:
                llm.generate(["hi"], SamplingParams(structured_outputs=spec), use_tqdm=False)
            assert str(error.value).startswith(
                f"structured_outputs.{field} does not compile"
            ) and "\n" not in str(error.value)
        out = llm.generate(
            ["hi", "ho"],
            [
                SamplingParams(
                    temperature=0, max_tokens=8, structured_outputs=dict(choice=["left", "right"])
                ),
                SamplingParams(temperature=0, max_tokens=4),
            ],
            use_tqdm=False,
        )
        assert out[0].text in ("left", "right") and out[1].finish_reason is not None


def test_the_cli_takes_the_structure_n_and_logprobs_flags(tiny_qwen2, capsys):
    from ssd_engine.generate import main

    main(
        [
            "--model",
            tiny_qwen2,
            "--prompt",
            "hello",
            "--n",
            "2",
            "--max-tokens",
            "6",
            "--temperature",
            "0",
            "--structured-outputs-choice",
            "yes",
            "--structured-outputs-choice",
            "no",
            "--logprobs",
            "1",
            "--no-progress",
        ]
    )
    printed = capsys.readouterr().out
    samples = re.findall(
        r"^--- \[\d+\.(\d)\] finish=stop\n(.*)$", printed, re.M
    )  # [request id.sample index]
    assert [index for index, _ in samples] == ["0", "1"] and all(
        text in ("yes", "no") for _, text in samples
    )
    assert printed.count("\nlogprobs ") >= 2
    with pytest.raises(SystemExit) as exit_code:
        main(
            [
                "--model",
                tiny_qwen2,
                "--prompt",
                "hi",
                "--structured-outputs-regex",
                "[a-",
                "--no-progress",
            ]
        )
    error = capsys.readouterr().err.strip()
    assert exit_code.value.code == 2 and error.startswith(
        "error: structured_outputs.regex does not compile"
    )
    assert "\n" not in error
