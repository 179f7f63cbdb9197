"""A draft model over its own paged KV cache: what SD's colocated draft (sd.py) and the SSD draft
process's trunks (ssd/draft/trunk.py) share.

- blocks: a draft's blocks are private copies (the target may share prefix blocks), so under memory
  pressure the draft can run short where the target fits. A sequence whose blocks cannot be
  reserved drops its draft K/V rather than fail the round; it is prefilled again once blocks free up;
- extend: one forward over each sequence's newly fed tokens (a prefill, or the catch-up with what
  the target committed), keeping the logits of its last rows;
- decode: K autoregressive steps from the extend's logits. Each step's draws stay on the device and
  are fed to the next from there, with every step's positions and slots uploaded once before the
  first (runtime/decode_feed.py): a host read or a host-built step would make the host wait on the
  device K times a round.

How a step samples is the caller's (`StepSampler`), because the two must each consume their random
streams exactly as they always have (seeded requests reproduce their outputs): SD draws a round's
uniforms in one block from each request's draft stream; SSD down-weights Saguaro's fan-out and
draws per step from each row's own generator.
"""
from typing import Generic, Protocol, TypeVar

import torch

from ssd_engine.core.structures import Paged
from ssd_engine.runtime.block_manager import BlockManager
from ssd_engine.runtime.decode_feed import DecodeFeed
from ssd_engine.runtime.model_runner import ModelRunner
from ssd_engine.runtime.step_inputs import StepInputs


class StepSampler(Protocol):
    def __call__(self, step: int, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft step `step` (0..K-1): fp32 logits [n, V] -> drawn tokens [n], left on the device,
        and the exact rows they were drawn from [n, V'] (None: greedy, verified as one-hot)."""
        ...


S = TypeVar("S", bound=Paged)


class PagedDraft(Generic[S]):
    def __init__(self, runner: ModelRunner, blocks: BlockManager, k: int) -> None:
        self.runner, self.blocks, self.k = runner, blocks, k

    def reserve(self, seq: S, num_tokens: int) -> bool:
        """Blocks for `num_tokens` of `seq`'s draft tokens; False (its draft K/V dropped) on shortage."""
        if self.blocks.slots_needed(seq, num_tokens) > self.blocks.num_free_blocks:
            self.drop(seq)
            return False
        self.blocks.grow(seq, num_tokens)
        return True

    def drop(self, seq: S) -> None:
        self.blocks.deallocate(seq)

    def extend_kv(self, seqs: list[S], starts: list[int], feeds: list[list[int]], rows: list[int]) -> torch.Tensor:
        """Feed feeds[i] into seqs[i]'s blocks from position starts[i] -> fp32 logits of the last
        rows[i] fed positions of each, concatenated in order: [sum(rows), V]."""
        return self.runner.run(StepInputs(starts, feeds, [s.block_table for s in seqs],
                                          [list(range(len(f) - n, len(f))) for f, n in zip(feeds, rows)]))

    def decode(self, seqs: list[S], starts: list[int], logits: torch.Tensor,
               sample: StepSampler) -> tuple[torch.Tensor, torch.Tensor | None]:
        """K draft tokens per sequence from `logits` [n, V] (each one's next-token logits). The
        first K - 1 drawn are fed at positions starts[i] .. starts[i] + K - 2, whose blocks must be
        reserved. -> tokens [n, K] and their q rows [n, K, V'] (None when greedy), on the device."""
        feed = DecodeFeed(self.runner, starts, [s.block_table for s in seqs], self.k - 1) if self.k > 1 else None
        tokens, rows = [], []
        for step in range(self.k):
            drawn, q = sample(step, logits)
            tokens.append(drawn)
            rows.append(q)
            if step + 1 < self.k:
                logits = feed.step(step, drawn)
        return torch.stack(tokens, dim=1), None if rows[0] is None else torch.stack(rows, dim=1)
