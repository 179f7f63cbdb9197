"""Saguaro sampling (Definition 14): the draft samples from q_C, its distribution with the top-F
tokens' probabilities multiplied by C and renormalised. The residual max(0, p - q_C) then leans
towards those F tokens, which are the cached bonus candidates, so a rejection's bonus token lands
in the cache more often (Theorem 15), at some cost in acceptance. q_C is the row verification
must use. C = 1 or F = 0 is plain sampling.
"""
import torch


def saguaro_probs(probs: torch.Tensor, fanout: torch.Tensor | list[int] | int, c: float) -> torch.Tensor:
    """probs [n, V] (temperature / top-k / top-p already applied), fanout F per row -> q_C [n, V].

    A row whose mass lies entirely inside its top-F tokens (so C would only rescale it) is left
    as it is; with C = 0 there would be nothing left to sample otherwise."""
    if c >= 1:
        return probs
    n, vocab = probs.shape
    fan = torch.as_tensor(fanout, device=probs.device).expand(n).clamp(max=vocab)
    widest = int(fan.max()) if n else 0
    if widest == 0:
        return probs
    top = probs.topk(widest, dim=-1).indices                       # [n, widest]
    in_top = torch.arange(widest, device=probs.device) < fan[:, None]
    weights = torch.full(in_top.shape, 1.0, dtype=probs.dtype, device=probs.device).masked_fill_(in_top, c)
    scale = torch.ones_like(probs).scatter_(1, top, weights)
    weighted = probs * scale
    total = weighted.sum(dim=-1, keepdim=True)
    keep = total > 0
    return torch.where(keep, weighted / torch.where(keep, total, 1.0), probs)
