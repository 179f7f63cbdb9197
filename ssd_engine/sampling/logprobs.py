"""Log-probabilities of emitted tokens under the law each was drawn from (the processed target row;
greedy rows at temperature 1), the same in every mode; a token a filter removed gets -inf."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from ssd_engine.core.structures import Sequence
from ssd_engine.sampling.processors import SamplingTensors


def emitted_logprobs(seq: Sequence, rows: Tensor, tokens: list[int]) -> list[dict[int, float]]:
    """Per emitted token j (row j, `processed`): {token: logprob}, then the top params.logprobs."""
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
