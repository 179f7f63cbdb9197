"""Log-probabilities of emitted tokens (SamplingParams.logprobs), under the law each was drawn from.

That law is the processed target row: the history's adjustments (penalties.py), temperature, then
top-k / top-p / min-p (processors.py); a greedy row is taken at temperature 1 (vLLM's processed
log-probabilities), so its numbers are those of the distribution whose argmax it emitted. A
verification's row j is the target's law after the sequence's tokens and the first j drafts:
the very law AR would compute at that position, so every mode gives the same numbers (up to the
last bits of the forward). A token a filter removed has log-probability -inf.
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from ssd_engine.core.structures import Sequence
from ssd_engine.sampling.processors import SamplingTensors


def emitted_logprobs(seq: Sequence, rows: Tensor, tokens: list[int]) -> list[dict[int, float]]:
    """For each emitted token (row j of `rows` scored it, already processed for its history: the
    verifier's `processed`): {token: log-probability} with the chosen token first, then the
    params.logprobs most likely tokens."""
    params = replace(seq.params, temperature=1.0) if seq.params.greedy else seq.params
    law = SamplingTensors.from_params([params], rows.device, times=len(tokens)).probs(rows).log()
    chosen = law.gather(1, torch.tensor(tokens, device=law.device)[:, None])[:, 0].tolist()
    top = law.topk(seq.params.logprobs, dim=-1) if seq.params.logprobs else None
    top_ids = top.indices.tolist() if top is not None else [[] for _ in tokens]
    top_values = top.values.tolist() if top is not None else [[] for _ in tokens]
    out = []
    for token, value, ids, values in zip(tokens, chosen, top_ids, top_values):
        entry = {token: value}
        for index, top_value in zip(ids, values):
            entry.setdefault(index, top_value)
        out.append(entry)
    return out
