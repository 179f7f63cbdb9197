"""Benchmarking only: speculation outcomes drawn at a set rate instead of computed from weights,
while every forward runs at its real shapes. The output is then NOT the target's."""

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


def verify_synthetic(
    proposal: Proposal, target_logits: torch.Tensor, draws: BernoulliDraws
) -> VerifyResult:
    """Accept each row's drafts by `draws` (up to the first failure and num_draft); the next token
    is the argmax of the target's row after them. target_logits: [n * (K + 1), V]."""
    n, k = proposal.tokens.shape
    came_up = draws.draw(n, k)
    leading = came_up.to(torch.int64).cumprod(dim=1).sum(dim=1)  # draws before the first failure
    accepted = torch.minimum(leading, proposal.num_draft.to(torch.int64).cpu())  # both on the host
    argmax = target_logits.argmax(dim=-1).view(n, k + 1)
    accepted = accepted.to(argmax.device)
    bonus = argmax.gather(1, accepted.unsqueeze(1)).squeeze(1)
    return result_of(proposal.tokens.to(argmax.device, torch.int64), accepted, bonus)
