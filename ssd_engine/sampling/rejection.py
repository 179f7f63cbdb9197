"""Exact speculative-sampling verification (Leviathan et al. 2023, Chen et al. 2023); q must be the
exact row each draft was sampled from. Row i draws num_draft[i] + 1 uniforms from its own generator,
so a seeded row's outcome is the same alone or in any batch, whatever the padding width K."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ssd_engine.sampling.sampler import draw_uniforms, inverse_cdf
from ssd_engine.utils.host_upload import to_device


@dataclass
class VerifyResult:
    num_accepted: Tensor  # [n] int64: accepted draft tokens per row
    bonus_tokens: Tensor  # [n] int64: the last entry of each output_tokens row (t* of the outcome)
    packed: Tensor  # [n, K + 2] int64 on the device: each row's drafts, accepted count, bonus
    _tokens: list[list[int]] | None = field(default=None, repr=False)  # output_tokens, once read

    @property
    def output_tokens(self) -> list[list[int]]:
        """Per row: the accepted draft tokens, then the bonus token (read at the first use)."""
        if self._tokens is None:
            self._tokens = _emitted(self.packed.tolist())
        return self._tokens

    def read_with(self, other: Tensor) -> list[int]:
        """Reads the packed rows and `other` ([m] int64) in one transfer -> other's values."""
        n, width = self.packed.shape
        values = torch.cat([self.packed.flatten(), other.to(torch.int64)]).tolist()
        self._tokens = _emitted([values[i * width : (i + 1) * width] for i in range(n)])
        return values[n * width :]


def _emitted(packed_rows: list[list[int]]) -> list[list[int]]:
    return [row[: row[-2]] + [row[-1]] for row in packed_rows]


def verify(
    draft_tokens: Tensor,
    draft_probs: Tensor | None,
    target_probs: Tensor,
    generators: Sequence[torch.Generator | None],
    num_draft: Tensor | None = None,
    default_generator: torch.Generator | None = None,
    one_hot_rows: Tensor | None = None,
    random_rows: Sequence[bool] | None = None,
) -> VerifyResult:
    """draft_tokens [n, K] int64; draft_probs [n, K, V] (the draft's normalised sampling rows)
    or None: q = one-hot(x); target_probs [n, K+1, V] normalised; num_draft [n] real drafts per row.
    one_hot_rows [n] bool: rows verified as q = one-hot(x) although draft_probs is given.
    random_rows [n] (host): the rows that draw (the others must have one-hot target rows; num_draft
    should then be a host tensor); None finds them by reading the target rows on the host."""
    n, k_max = draft_tokens.shape
    device = target_probs.device
    draft_tokens = _on(device, draft_tokens, torch.int64)
    nd = _num_draft(num_draft, n, k_max, device)
    rows = torch.arange(n, device=device)
    valid = torch.arange(k_max, device=device).unsqueeze(0) < nd.unsqueeze(1)
    x = torch.where(valid, draft_tokens, 0)  # padding may hold anything, e.g. -1

    if random_rows is None:
        # A row whose target rows (up to its bonus position) are all one-hot has a fixed outcome.
        used = torch.arange(k_max + 1, device=device).unsqueeze(0) <= nd.unsqueeze(1)
        one_hot = (target_probs > 0).sum(dim=-1) == 1
        deterministic = (one_hot | ~used).all(dim=1)
        counts = torch.where(deterministic, 0, nd + 1).tolist()
    else:
        drafts = [k_max] * n if num_draft is None else num_draft.tolist()
        counts = [d + 1 if r else 0 for d, r in zip(drafts, random_rows)]
    # rows drawing nothing keep u = 0, which gives a one-hot target row's outcome
    u = draw_uniforms(generators, counts, k_max + 1, device, default_generator)

    p_x = target_probs[:, :k_max].gather(2, x.unsqueeze(2)).squeeze(2).double()
    one_hot_q = (
        None
        if draft_probs is None or one_hot_rows is None
        else _on(device, one_hot_rows).unsqueeze(1)
    )
    if draft_probs is None:
        q_x = torch.ones(n, k_max, dtype=torch.float64, device=device)
    else:
        q_x = draft_probs.gather(2, x.unsqueeze(2)).squeeze(2).double()
        q_x = q_x if one_hot_q is None else torch.where(one_hot_q, 1.0, q_x)
    # u < p/q without dividing (q may be 0 for malformed input; then any p > 0 accepts).
    accepted = (u[:, :k_max] * q_x < p_x) & valid
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)

    p_bonus = target_probs[rows, num_accepted].float()
    dist = p_bonus
    if k_max > 0:
        at = num_accepted.clamp(max=k_max - 1)
        if draft_probs is None or one_hot_q is not None:
            without_x = p_bonus.scatter(1, x[rows, at].unsqueeze(1), 0.0)  # one-hot q: p without x
        if draft_probs is not None:
            sampled = (p_bonus - draft_probs[rows, at].float()).clamp_min(0.0)
        residual = (
            without_x
            if draft_probs is None
            else (sampled if one_hot_q is None else torch.where(one_hot_q, without_x, sampled))
        )
        # an empty residual (p == q up to round-off) means a round-off rejection: fall back to p
        use_p = (num_accepted == nd) | (residual.sum(dim=-1) <= 0)
        dist = torch.where(use_p.unsqueeze(1), p_bonus, residual)
    bonus = inverse_cdf(dist, u.gather(1, nd.unsqueeze(1)).squeeze(1))
    return result_of(draft_tokens, num_accepted, bonus)


def verify_greedy(
    draft_tokens: Tensor, target_argmax: Tensor, num_draft: Tensor | None = None
) -> VerifyResult:
    """All greedy: accept while x_j == argmax p_j ([n, K] vs [n, K+1]); bonus = argmax there."""
    n, k_max = draft_tokens.shape
    device = target_argmax.device
    draft_tokens = _on(device, draft_tokens, torch.int64)
    target_argmax = target_argmax.to(torch.int64)
    nd = _num_draft(num_draft, n, k_max, device)
    valid = torch.arange(k_max, device=device).unsqueeze(0) < nd.unsqueeze(1)
    match = (draft_tokens == target_argmax[:, :k_max]) & valid
    num_accepted = match.long().cumprod(dim=1).sum(dim=1)
    bonus = target_argmax.gather(1, num_accepted.unsqueeze(1)).squeeze(1)
    return result_of(draft_tokens, num_accepted, bonus)


def _num_draft(num_draft: Tensor | None, n: int, k_max: int, device: torch.device) -> Tensor:
    if num_draft is None:
        return torch.full((n,), k_max, dtype=torch.int64, device=device)
    return _on(device, num_draft, torch.int64)


def _on(device: torch.device, tensor: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """`tensor` on `device`; a host one by a non-blocking copy (blocking waits for the stream)."""
    tensor = tensor.to(dtype) if dtype is not None else tensor
    return tensor.to(device) if tensor.device.type != "cpu" else to_device(tensor, device)


def result_of(draft_tokens: Tensor, num_accepted: Tensor, bonus: Tensor) -> VerifyResult:
    """[n, K] drafts, [n] accepted, [n] bonus (int64, one device) -> result packed for one read."""
    packed = torch.cat([draft_tokens, num_accepted.unsqueeze(1), bonus.unsqueeze(1)], dim=1)
    return VerifyResult(num_accepted=num_accepted, bonus_tokens=bonus, packed=packed)
