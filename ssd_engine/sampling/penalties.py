"""History-dependent sampling parameters, in vLLM's order before temperature and the filters:
min_tokens, logit_bias, repetition / frequency / presence penalties. Row j is adjusted after the
history plus drafts[:j]; neutral parameters apply their identity (same bits): batching is exact."""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch
from torch import Tensor

from ssd_engine.core.structures import Sequence
from ssd_engine.utils.host_upload import upload


def adjusted(
    logits: Tensor, seqs: Seq[Sequence], eos_token_ids: set[int], drafts: Tensor | None = None
) -> Tensor:
    """logits [len(seqs) * rows, V]: row j of sequence i after seqs[i]'s tokens and drafts[i, :j]
    (drafts [len(seqs), rows - 1]). A new tensor where a request uses its history, else `logits`."""
    users = [i for i, seq in enumerate(seqs) if seq.params.uses_history]
    if not users:
        return logits
    vocab = logits.shape[-1]
    rows = logits.shape[0] // len(seqs)
    out = logits.float().clone().view(len(seqs), rows, vocab)
    every = len(users) == len(seqs)
    [index] = upload([users], out.device) if not every else [None]
    drafted = None
    if drafts is not None and rows > 1:
        drafted = drafts[:, : rows - 1] if every else drafts[index, : rows - 1]
    part = _adjust(out if every else out[index], [seqs[i] for i in users], drafted, eos_token_ids)
    if every:
        return part.view(len(seqs) * rows, vocab)
    out[index] = part
    return out.view(len(seqs) * rows, vocab)


def _adjust(
    rows: Tensor, seqs: list[Sequence], drafted: Tensor | None, eos_token_ids: set[int]
) -> Tensor:
    """rows [n, count, V] of n sequences that all use their history, adjusted in place or anew."""
    n, count, vocab = rows.shape
    flat = rows.view(n * count, vocab)
    blocked_rows, blocked_ids, bias_rows, bias_ids, bias_values = [], [], [], [], []
    for i, seq in enumerate(seqs):
        params = seq.params
        if params.min_tokens:
            blocked = list(params.stop_token_ids) + (
                [] if params.ignore_eos else sorted(eos_token_ids)
            )
            for j in range(min(count, max(params.min_tokens - seq.num_output_tokens, 0))):
                blocked_rows += [i * count + j] * len(blocked)
                blocked_ids += blocked
        for token, value in params.logit_bias.items():
            bias_rows += range(i * count, (i + 1) * count)
            bias_ids += [token] * count
            bias_values += [float(value)] * count
    if blocked_rows:
        at_rows, at_ids = upload([blocked_rows, blocked_ids], rows.device)
        flat[at_rows, at_ids] = float("-inf")
    if bias_rows:
        at_rows, at_ids = upload([bias_rows, bias_ids], rows.device)
        [values] = upload([bias_values], rows.device, torch.float32)
        flat[at_rows, at_ids] += (
            values  # one (row, id) pair per entry: each logit gets its bias once
        )
    penalised = [seq.params for seq in seqs]
    if all(
        p.repetition_penalty == 1 and not (p.frequency_penalty or p.presence_penalty)
        for p in penalised
    ):
        return rows
    counts = _output_counts(seqs, drafted, count, vocab, rows.device)
    penalties = sorted({p.repetition_penalty for p in penalised} - {1})
    if penalties:
        seen = counts > 0
        prompt_rows, prompt_ids = upload(
            [
                [i for i, seq in enumerate(seqs) for _ in range(seq.num_prompt_tokens)],
                [t for seq in seqs for t in seq.token_ids[: seq.num_prompt_tokens]],
            ],
            rows.device,
        )
        seen[prompt_rows, :, prompt_ids] = True
        # a Python scalar penalty: a GPU divides by it as transformers does, unlike by a tensor
        for penalty in penalties:
            [chosen] = upload(
                [[p.repetition_penalty == penalty for p in penalised]], rows.device, torch.int32
            )
            hit = seen & chosen.view(n, 1, 1).bool()
            rows = torch.where(hit, torch.where(rows > 0, rows / penalty, rows * penalty), rows)
    if any(p.frequency_penalty or p.presence_penalty for p in penalised):
        frequency, presence = (
            t.view(n, 1, 1)
            for t in upload(
                [[p.frequency_penalty for p in penalised], [p.presence_penalty for p in penalised]],
                rows.device,
                torch.float32,
            )
        )
        rows = rows - frequency * counts - presence * (counts > 0).float()
    return rows


def _output_counts(
    seqs: list[Sequence], drafted: Tensor | None, count: int, vocab: int, device
) -> Tensor:
    """[n, count, vocab] float32: how often each token occurs in each sequence's output before each row."""
    n = len(seqs)
    base = torch.zeros(n * vocab, device=device)
    outputs = [i * vocab + t for i, seq in enumerate(seqs) for t in seq.output_token_ids]
    if outputs:
        [at] = upload([outputs], device)
        base.index_add_(0, at, torch.ones(len(outputs), device=device))
    counts = base.view(n, 1, vocab).expand(n, count, vocab).clone()
    if drafted is not None and count > 1:
        one_hot = torch.zeros(n, count - 1, vocab, device=device).scatter_(
            2, drafted[:, : count - 1, None].long(), 1.0
        )
        counts[:, 1:] += one_hot.cumsum(dim=1)
    return counts
