"""The exact law of a request's first output tokens, computed with transformers (the oracle).

`output_law(model_dir, prompt, params, length)` enumerates every continuation of `length` tokens
with non-zero probability under the target and returns {tokens: probability}, computed in float64
with transformers' own logits processors (min_tokens, logit_bias, repetition penalty; frequency and
presence penalties by OpenAI's formula; a grammar's mask by xgrammar's own matcher) and warpers
(temperature, top-k, top-p) on the Hugging Face model. It is meant for the tiny-vocabulary models of
the distribution tests (16 tokens: at most 16^length cells). `law_table` memoizes it for a module's
tests; `marginal(law, index)` sums it down to one position.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from transformers import (
    AutoModelForCausalLM,
    LogitsProcessor,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from ssd_engine import SamplingParams


class OutputPenalties(LogitsProcessor):
    """OpenAI's frequency and presence penalties over the generated ids (transformers has none)."""

    def __init__(self, prompt_length: int, frequency: float, presence: float) -> None:
        self.prompt_length, self.frequency, self.presence = prompt_length, frequency, presence

    def __call__(self, input_ids, scores):
        counts = torch.zeros_like(scores)
        counts.scatter_add_(
            1,
            input_ids[:, self.prompt_length :],
            torch.ones_like(input_ids[:, self.prompt_length :], dtype=scores.dtype),
        )
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


class GrammarMask(LogitsProcessor):
    """structured_outputs (a `grammar` or `regex`): tokens xgrammar's own matcher forbids after each
    row's output get -inf (a fresh matcher a row); after the grammar's end, only end-of-sequence."""

    def __init__(self, spec, tokenizer, prompt_length: int, eos_token_ids: list[int]) -> None:
        self.spec, self.tokenizer, self.prompt_length, self.eos = (
            spec,
            tokenizer,
            prompt_length,
            eos_token_ids,
        )
        self.compiled = None

    def __call__(self, input_ids, scores):
        import xgrammar as xgr

        if self.compiled is None:
            info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=scores.shape[-1], stop_token_ids=self.eos
            )
            compiler = xgr.GrammarCompiler(info)
            self.compiled = (
                compiler.compile_regex(self.spec.regex)
                if self.spec.regex
                else compiler.compile_grammar(self.spec.grammar)
            )
        allowed = torch.zeros_like(scores, dtype=torch.bool)
        for row, ids in enumerate(input_ids[:, self.prompt_length :].tolist()):
            matcher = xgr.GrammarMatcher(self.compiled)
            assert all(matcher.accept_token(t) for t in ids if not matcher.is_terminated())
            if matcher.is_terminated():
                allowed[row, self.eos] = True
                continue
            bitmask = xgr.allocate_token_bitmask(1, scores.shape[-1])
            matcher.fill_next_token_bitmask(bitmask)
            bits = (bitmask[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
            allowed[row] = bits.view(-1)[: scores.shape[-1]].bool()
        return scores.masked_fill(~allowed, float("-inf"))


def processors(
    params: SamplingParams, prompt_length: int, eos_token_ids: list[int], tokenizer=None
) -> LogitsProcessorList:
    """transformers' processors for the history-dependent parameters, in vLLM's order (min_tokens,
    logit_bias, then the penalties); the temperature and filters come after (`warpers`). A grammar
    (structured_outputs, which needs the `tokenizer`) masks last."""
    chain = LogitsProcessorList()
    if params.min_tokens:
        blocked = list(params.stop_token_ids) + ([] if params.ignore_eos else eos_token_ids)
        chain.append(MinNewTokensLengthLogitsProcessor(prompt_length, params.min_tokens, blocked))
    if params.logit_bias:
        chain.append(
            SequenceBiasLogitsProcessor(
                [[[token], bias] for token, bias in params.logit_bias.items()]
            )
        )
    if params.repetition_penalty != 1:
        chain.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if params.frequency_penalty or params.presence_penalty:
        chain.append(
            OutputPenalties(prompt_length, params.frequency_penalty, params.presence_penalty)
        )
    if params.structured_outputs is not None:
        chain.append(
            GrammarMask(params.structured_outputs, tokenizer, prompt_length, eos_token_ids)
        )
    return chain


def warpers(params: SamplingParams) -> LogitsProcessorList:
    chain = LogitsProcessorList([TemperatureLogitsWarper(params.temperature)])
    if params.top_k > 0:
        chain.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1:
        chain.append(TopPLogitsWarper(params.top_p))
    return chain


@torch.no_grad()
def output_law(
    model_dir: str, prompt: list[int], params: SamplingParams, length: int
) -> dict[tuple, float]:
    if params.min_p > 0 or params.temperature <= 0:
        raise ValueError("output_law covers temperature > 0 with top-k / top-p only")
    from transformers import AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    chain = LogitsProcessorList(
        [
            *processors(
                params,
                len(prompt),
                [model.config.eos_token_id],
                AutoTokenizer.from_pretrained(model_dir),
            ),
            *warpers(params),
        ]
    )
    law: dict[tuple, float] = {(): 1.0}
    for _ in range(length):
        prefixes = list(law)
        ids = torch.tensor([prompt + list(p) for p in prefixes])
        logits = model(ids).logits[:, -1].double()
        probs = torch.softmax(chain(ids, logits), dim=-1)
        grown = {}
        for prefix, row in zip(prefixes, probs.tolist()):
            for token, p in enumerate(row):
                if p > 0:
                    grown[prefix + (token,)] = law[prefix] * p
        law = grown
    return law


def law_table(model_dir: str, prompt: list[int], default: dict):
    """output_law memoized by (length, params): get(length, params=default), params the SamplingParams fields."""
    cache = {}

    def get(length: int, params: dict | None = None) -> dict[tuple, float]:
        params = default if params is None else params
        key = (length, repr(sorted(params.items())))
        if key not in cache:
            cache[key] = output_law(
                model_dir, prompt, SamplingParams(max_tokens=length, **params), length
            )
        return cache[key]

    return get


def marginal(law: dict[tuple, float], index: int) -> dict[int, float]:
    out: dict[int, float] = defaultdict(float)
    for tokens, p in law.items():
        out[tokens[index]] += p
    return dict(out)
