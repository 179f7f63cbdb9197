"""SamplingParams.logprobs: each emitted token's log-probability and the top N, under the law it was
drawn from (sampling/logprobs.py), the same numbers in AR, SD and SSD.

- Greedy: the chosen token's log-probability and the top N equal transformers' log-softmax at each
  position of the output (temperature 1), in every mode; the chosen token is the top one.
- T > 0 with top-k and penalties: the chosen token's value is the log of the processed law
  (transformers' processors and warpers in float64, tests/exact_law.py), a token top-k removed is
  -inf, and SD gives each verification row the law after its own drafts (seeded SD and AR draw
  different tokens, so each output is checked against the law of its own path).
- Without logprobs a request returns None; a bad value is a one-line error naming the field.
"""

import pytest
import torch
from exact_law import processors, warpers
from transformers import AutoModelForCausalLM, LogitsProcessorList

from ssd_engine import LLM, SamplingParams

PROMPTS = [[(7 * i + 3 * j) % 200 + 3 for j in range(5 + 4 * i)] for i in range(3)]
TOP = 3


def _run(target: str, mode: str, params: SamplingParams, draft: str | None = None):
    extra = {} if mode == "ar" else dict(draft_model=draft, num_speculative_tokens=3)
    with LLM(target, num_threads=1, speculative_mode=mode, **extra) as llm:
        return llm.generate(PROMPTS, params, use_tqdm=False)


def _reference(model, prompt: list[int], output: list[int], params: SamplingParams) -> torch.Tensor:
    """[len(output), V] float64 log-probabilities of the processed law along the output's path."""
    chain = LogitsProcessorList(
        [*processors(params, len(prompt), [2]), *(warpers(params) if not params.greedy else [])]
    )
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].double()
    rows = [
        torch.log_softmax(chain(ids[:, : len(prompt) + j], logits[j : j + 1]), dim=-1)[0]
        for j in range(len(output))
    ]
    return torch.stack(rows)


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    target = tiny_model_dir("qwen2")
    return (
        target,
        tiny_model_dir("qwen2", seed=1),
        AutoModelForCausalLM.from_pretrained(target, dtype=torch.float64).eval(),
    )


def test_greedy_logprobs_are_the_targets_in_every_mode(models):
    target, draft, model = models
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=TOP)
    runs = {mode: _run(target, mode, params, draft) for mode in ("ar", "sd", "ssd")}
    for i, prompt in enumerate(PROMPTS):
        ar = runs["ar"][i]
        reference = _reference(model, prompt, ar.token_ids, params)
        for mode, outs in runs.items():
            out = outs[i]
            assert out.token_ids == ar.token_ids and len(out.logprobs) == len(out.token_ids), mode
            for j, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
                assert next(iter(entry)) == token  # the chosen token first
                top = reference[j].topk(TOP)
                assert set(entry) == set(top.indices.tolist()) | {token}
                for t, value in entry.items():
                    assert value == pytest.approx(reference[j, t].item(), abs=1e-4), (mode, j, t)
                assert entry[token] == max(entry.values())


def test_sampled_logprobs_are_the_processed_law_after_each_rows_own_drafts(models):
    target, draft, model = models
    params = SamplingParams(
        temperature=0.8,
        top_k=5,
        max_tokens=12,
        ignore_eos=True,
        seed=7,
        logprobs=2,
        repetition_penalty=1.3,
        presence_penalty=0.5,
    )
    for mode in ("ar", "sd"):
        for prompt, out in zip(PROMPTS, _run(target, mode, params, draft)):
            reference = _reference(model, prompt, out.token_ids, params)
            for j, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
                assert entry[token] == pytest.approx(reference[j, token].item(), abs=1e-4), (
                    mode,
                    j,
                )
                assert all(
                    v == float("-inf") or reference[j, t] > float("-inf") for t, v in entry.items()
                )
            assert (
                sum(v == float("-inf") for e in out.logprobs for v in e.values()) == 0
            )  # top-2 of 5 survivors


def test_without_logprobs_none_and_bad_values_name_the_field(models):
    target, _, _ = models
    assert _run(target, "ar", SamplingParams(temperature=0, max_tokens=2))[0].logprobs is None
    for bad in (-1, 21, 2.5, True):
        with pytest.raises(ValueError, match=r"^logprobs must be an int in \[0, 20\]"):
            SamplingParams(logprobs=bad)
