"""A draft model over its own paged KV cache, shared by SD's draft and SSD's trunks. A sequence
whose blocks cannot be reserved drops its draft K/V rather than fail the round. Decode steps feed
draws from the device, never reading them on the host; sampling is the caller's (`StepSampler`),
so each keeps its own random-stream order and seeded requests reproduce their outputs."""

from typing import Generic, Protocol, TypeVar

import torch

from ssd_engine.core.structures import Paged
from ssd_engine.runtime.block_manager import BlockManager
from ssd_engine.runtime.decode_feed import DecodeFeed
from ssd_engine.runtime.model_runner import ModelRunner
from ssd_engine.runtime.step_inputs import StepInputs


class StepSampler(Protocol):
    def __call__(self, step: int, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Step `step` (0..K-1): fp32 logits [n, V] -> drawn tokens [n] on the device, and the exact
        rows they were drawn from [n, V'] (None: greedy, verified as one-hot)."""
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

    def extend_kv(
        self, seqs: list[S], starts: list[int], feeds: list[list[int]], rows: list[int]
    ) -> torch.Tensor:
        """Feed feeds[i] into seqs[i]'s blocks from position starts[i] -> fp32 logits of the last
        rows[i] fed positions of each, concatenated in order: [sum(rows), V]. A target wider than the
        draft (embedding padding past the tokenizer) can emit ids the draft has no row for: the draft
        reads those as id 0, which changes only its proposals, never the output (the verifier's)."""
        vocab = self.runner.config.vocab_size
        feeds = [[t if t < vocab else 0 for t in f] for f in feeds]
        return self.runner.run(
            StepInputs(
                starts,
                feeds,
                [s.block_table for s in seqs],
                [list(range(len(f) - n, len(f))) for f, n in zip(feeds, rows)],
            )
        )

    def decode(
        self,
        seqs: list[S],
        starts: list[int],
        logits: torch.Tensor,
        sample: StepSampler,
        k: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """k (default K) draft tokens per sequence from next-token `logits` [n, V]; the first k - 1
        are fed at starts[i] .. starts[i] + k - 2 (blocks reserved). -> tokens [n, k], q [n, k, V'] or
        None."""
        k = self.k if k is None else k
        feed = (
            DecodeFeed(self.runner, starts, [s.block_table for s in seqs], k - 1) if k > 1 else None
        )
        tokens, rows = [], []
        for step in range(k):
            drawn, q = sample(step, logits)
            tokens.append(drawn)
            rows.append(q)
            if step + 1 < k:
                logits = feed.step(step, drawn)
        return torch.stack(tokens, dim=1), None if rows[0] is None else torch.stack(rows, dim=1)
