"""Saguaro sampling (Definition 14): the draft samples from q_C, its row with the top-F tokens'
probabilities times C, renormalised; verification must use q_C (C = 1 or F = 0: plain sampling)."""

import torch


def saguaro_probs(
    probs: torch.Tensor, fanout: torch.Tensor | list[int] | int, c: float
) -> torch.Tensor:
    """probs [n, V] (already processed), fanout F per row -> q_C [n, V]. A row whose mass lies
    entirely in its top-F tokens is left as it is (with C = 0 nothing would be left to sample)."""
    if c >= 1:
        return probs
    n, vocab = probs.shape
    fan = torch.as_tensor(fanout, device=probs.device).expand(n).clamp(max=vocab)
    widest = int(fan.max()) if n else 0
    if widest == 0:
        return probs
    top = probs.topk(widest, dim=-1).indices
    in_top = torch.arange(widest, device=probs.device) < fan[:, None]
    weights = torch.full(in_top.shape, 1.0, dtype=probs.dtype, device=probs.device).masked_fill_(
        in_top, c
    )
    scale = torch.ones_like(probs).scatter_(1, top, weights)
    weighted = probs * scale
    total = weighted.sum(dim=-1, keepdim=True)
    keep = total > 0
    return torch.where(keep, weighted / torch.where(keep, total, 1.0), probs)
