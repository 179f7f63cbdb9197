"""The sampling parameters whose effect depends on the tokens before a position: min_tokens,
logit_bias, repetition / frequency / presence penalties (vLLM's order: the first two, then the
penalties, all before temperature and the filters of processors.py).

Under SD and SSD a verification scores K + 1 positions at once, and position j follows the
sequence's tokens AND the first j drafts. The target's law there is the law after those tokens, so
each row is adjusted with its own history: the counts of the drafts before it are added to the
sequence's (a running sum of the drafts' one-hot rows). The q rows need no such care: they are
whatever the draft sampled from, and rejection sampling corrects them (docs/saguaro.md).

- min_tokens: end-of-sequence (unless ignore_eos) and stop_token_ids are -inf while fewer than
  min_tokens tokens precede the position in the output.
- logit_bias: added to the named tokens' logits.
- repetition_penalty (transformers' RepetitionPenaltyLogitsProcessor, vLLM's): a logit of a token
  in the prompt or the output so far is divided by it where positive, multiplied where not.
- frequency_penalty, presence_penalty (OpenAI's): minus the penalty times the token's count in the
  output so far, and minus the penalty once if it occurs there.
"""
from __future__ import annotations

from collections.abc import Sequence as Seq

import torch
from torch import Tensor

from ssd_engine.core.structures import Sequence


def adjusted(logits: Tensor, seqs: Seq[Sequence], eos_token_ids: set[int], drafts: Tensor | None = None) -> Tensor:
    """logits [len(seqs) * rows, V]: row j of sequence i scores the position after seqs[i]'s tokens
    and drafts[i, :j] (drafts [len(seqs), rows - 1], None for one row a sequence). A new tensor
    where some request's parameters use the history, else `logits` itself."""
    if not any(seq.params.uses_history for seq in seqs):
        return logits
    vocab = logits.shape[-1]
    rows = logits.shape[0] // len(seqs)
    out = logits.float().clone().view(len(seqs), rows, vocab)
    for i, seq in enumerate(seqs):
        params = seq.params
        if not params.uses_history:
            continue
        drafted = drafts[i, :rows - 1] if drafts is not None and rows > 1 else None
        out[i] = _adjust(out[i], seq, drafted, eos_token_ids)
    return out.view(len(seqs) * rows, vocab)


def _adjust(rows: Tensor, seq: Sequence, drafted: Tensor | None, eos_token_ids: set[int]) -> Tensor:
    params, device = seq.params, rows.device
    count, vocab = rows.shape
    if params.min_tokens:
        blocked = list(params.stop_token_ids) + ([] if params.ignore_eos else sorted(eos_token_ids))
        early = [j for j in range(count) if seq.num_output_tokens + j < params.min_tokens]
        if blocked and early:
            ids = torch.tensor(blocked, device=device)
            rows[torch.tensor(early, device=device)[:, None], ids[None, :]] = float("-inf")
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), device=device)
        rows[:, ids] += torch.tensor(list(params.logit_bias.values()), device=device)
    if params.repetition_penalty == 1 and not (params.frequency_penalty or params.presence_penalty):
        return rows
    counts = _output_counts(seq, drafted, count, vocab, device)
    if params.repetition_penalty != 1:
        seen = counts > 0
        seen[:, torch.tensor(seq.token_ids[:seq.num_prompt_tokens], dtype=torch.long, device=device)] = True
        penalty = params.repetition_penalty
        rows = torch.where(seen, torch.where(rows > 0, rows / penalty, rows * penalty), rows)
    if params.frequency_penalty or params.presence_penalty:
        rows = rows - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()
    return rows


def _output_counts(seq: Sequence, drafted: Tensor | None, count: int, vocab: int, device) -> Tensor:
    """[count, vocab] float32: how often each token occurs in the output before each row."""
    base = torch.zeros(vocab, device=device)
    outputs = seq.output_token_ids
    if outputs:
        base.index_add_(0, torch.tensor(outputs, dtype=torch.long, device=device), torch.ones(len(outputs), device=device))
    counts = base.expand(count, vocab).clone()
    if drafted is not None and count > 1:
        one_hot = torch.zeros(count - 1, vocab, device=device).scatter_(1, drafted[:count - 1, None].long(), 1.0)
        counts[1:] += one_hot.cumsum(dim=0)
    return counts
