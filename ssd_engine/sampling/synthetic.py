"""Benchmarking only: speculation outcomes drawn at a set rate instead of computed from weights.

With random weights (load_format="dummy") a draft and a target agree on nothing, so measured
speed would be that of a pair with no acceptance. These draws stand in for a pair's acceptance
(`synthetic_acceptance` = alpha) and for SSD's cache hits (`synthetic_hit` = p) while every
forward still runs at its real shapes: the speedup a pair with that alpha and p would get, the
i.i.d. model of the SSD paper's Theorem 7. The output is then NOT the target's.

- Acceptance: draft token j is accepted iff the first j draws all came up (the first rejection
  ends the round, as in real verification), so a round accepts a ~ truncated geometric: P(a = j)
  = alpha^j (1 - alpha) for j < K and alpha^K for j = K. The token after the accepted ones (the
  bonus or the correction) is the argmax of the target's row at that position, for greedy and
  sampled requests alike: no draw from the request's own streams, which stay untouched.
- Draws come from a generator of their own (core/streams.py's SYNTHETIC stream, from the
  engine's seed), so runs repeat and no request stream shifts.
"""
import torch

from ssd_engine.core.streams import Stream, stream_generator
from ssd_engine.core.structures import Proposal
from ssd_engine.sampling.rejection import VerifyResult, result_of


class BernoulliDraws:
    """Independent True-with-probability-p draws from one seeded generator."""

    def __init__(self, probability: float, seed: int, purpose: str) -> None:
        self.probability = probability
        self.generator = stream_generator(seed, Stream.SYNTHETIC, purpose)

    def draw(self, *shape: int) -> torch.Tensor:
        # u in [0, 1): p = 1 always comes up, p = 0 never does
        return torch.rand(*shape, generator=self.generator) < self.probability


def synthetic_draws(probability: float | None, seed: int, purpose: str) -> BernoulliDraws | None:
    """None when the option is unset (the real outcome decides)."""
    return None if probability is None else BernoulliDraws(probability, seed, purpose)


def synthetic_acceptance(alpha: float | None, seed: int) -> BernoulliDraws | None:
    return synthetic_draws(alpha, seed, "acceptance")


def verify_synthetic(proposal: Proposal, target_logits: torch.Tensor, draws: BernoulliDraws) -> VerifyResult:
    """Accept each row's drafts by `draws` (stop at the first rejection, never past num_draft); the
    next token is the argmax of the target's row right after the accepted ones.
    target_logits: [n * (K + 1), V], K + 1 rows per sequence."""
    n, k = proposal.tokens.shape
    came_up = draws.draw(n, k)
    leading = came_up.to(torch.int64).cumprod(dim=1).sum(dim=1)  # draws before the first failure
    accepted = torch.minimum(leading, proposal.num_draft.to(torch.int64).cpu())  # both on the host
    argmax = target_logits.argmax(dim=-1).view(n, k + 1)
    accepted = accepted.to(argmax.device)
    bonus = argmax.gather(1, accepted.unsqueeze(1)).squeeze(1)
    # like real verification, one read of the emitted tokens (the drafts stay on the device)
    return result_of(proposal.tokens.to(argmax.device, torch.int64), accepted, bonus)
