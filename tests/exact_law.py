"""The exact law of a request's first output tokens, computed with transformers (the oracle).

`output_law(model_dir, prompt, params, length)` enumerates every continuation of `length` tokens
with non-zero probability under the target and returns {tokens: probability}, computed in float64
with transformers' own logits warpers (temperature, top-k, top-p) on the Hugging Face model. It is
meant for the tiny-vocabulary models of the distribution tests (16 tokens: at most 16^length
cells). `marginal(law, index)` sums it down to one position.
"""
from __future__ import annotations

from collections import defaultdict

import torch
from transformers import AutoModelForCausalLM, LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, \
    TopPLogitsWarper

from ssd_engine import SamplingParams


def warpers(params: SamplingParams) -> LogitsProcessorList:
    chain = LogitsProcessorList([TemperatureLogitsWarper(params.temperature)])
    if params.top_k > 0:
        chain.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1:
        chain.append(TopPLogitsWarper(params.top_p))
    return chain


@torch.no_grad()
def output_law(model_dir: str, prompt: list[int], params: SamplingParams, length: int) -> dict[tuple, float]:
    if params.min_p > 0 or params.temperature <= 0:
        raise ValueError("output_law covers temperature > 0 with top-k / top-p only")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    chain = warpers(params)
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


def marginal(law: dict[tuple, float], index: int) -> dict[int, float]:
    out: dict[int, float] = defaultdict(float)
    for tokens, p in law.items():
        out[tokens[index]] += p
    return dict(out)
