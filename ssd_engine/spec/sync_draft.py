"""SD: a colocated draft model proposes K tokens per decoding sequence, autoregressively.

The draft has its own ModelRunner and paged KV cache managed by the same BlockManager code.
Each sequence has a `DraftView`: the target sequence's tokens with the draft's own page table and
computed count. The draft's KV is valid for a prefix of the sequence; each round it first
catches up (the bonus token, plus the last draft token after a fully accepted round), then
decodes K tokens, keeping for each the exact probability row it was sampled from.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ssd_engine.engine.block_manager import BlockManager
from ssd_engine.engine.model_runner import ModelRunner
from ssd_engine.engine.scheduler import ScheduledBatch
from ssd_engine.engine.sequence import Sequence
from ssd_engine.sampling.processors import SamplingTensors
from ssd_engine.sampling.sampler import sample


class DraftView:
    """What the block manager and model runner need of a sequence, on the draft's side."""

    def __init__(self, seq: Sequence) -> None:
        self.seq = seq
        self.block_table: list[int] = []
        self.num_computed_tokens = 0

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids

    def __len__(self) -> int:
        return len(self.seq.token_ids)


@dataclass
class Proposal:
    tokens: torch.Tensor                 # [n, K] draft tokens of the decoding sequences
    probs: torch.Tensor | None           # [n, K, V] rows they were sampled from; None when all greedy


class SyncDraft:
    def __init__(self, runner: ModelRunner, num_blocks: int, block_size: int, k: int,
                 proposable_vocab: int, generator: torch.Generator) -> None:
        self.runner = runner
        self.k = k
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.views: dict[int, DraftView] = {}
        self.proposable_vocab = proposable_vocab  # ids past the tokenizer are embedding padding
        self.generator = generator

    @property
    def lookahead(self) -> int:
        return self.k

    def view(self, seq: Sequence) -> DraftView:
        if seq.seq_id not in self.views:
            self.views[seq.seq_id] = DraftView(seq)
        return self.views[seq.seq_id]

    def release(self, seq: Sequence) -> None:
        view = self.views.pop(seq.seq_id, None)
        if view is not None:
            self.blocks.deallocate(view)

    def propose(self, batch: ScheduledBatch, decoding: list[bool]) -> Proposal | None:
        """Catch the draft up with every scheduled sequence's target progress; then draft K
        tokens for the decoding ones."""
        views, ends = [], []
        for seq, n, dec in zip(batch.seqs, batch.num_new_tokens, decoding):
            view = self.view(seq)
            end = len(seq) if dec else seq.num_computed_tokens + n
            if view.num_computed_tokens > end:  # target was preempted and recomputes: so must we
                self.blocks.deallocate(view)
            if end > view.num_computed_tokens:
                views.append(view)
                ends.append(end)
        dec_views = [self.view(s) for s, d in zip(batch.seqs, decoding) if d]
        if not dec_views:
            self._extend(views, ends, [], [])
            return None
        params = [v.seq.params for v in dec_views]
        greedy = all(p.greedy for p in params)
        sampling = None if greedy else SamplingTensors.from_params(params, self.runner.device)
        generators = [v.seq.generator for v in dec_views]
        tokens, rows = [], []
        dec_ids = {id(v) for v in dec_views}
        logits = self._extend(views, ends, [[e - v.num_computed_tokens - 1] if id(v) in dec_ids else []
                                            for v, e in zip(views, ends)], dec_views)
        for step in range(self.k):
            logits = logits[:, :self.proposable_vocab]
            if greedy:
                drawn = logits.argmax(dim=-1)
            else:
                probs = sampling.probs(logits)
                drawn = sample(probs, generators, self.generator)
                rows.append(F.pad(probs, (0, self.runner.config.vocab_size - probs.shape[-1])))
            tokens.append(drawn)
            if step + 1 < self.k:
                logits = self._decode_one(dec_views, drawn.tolist(), offset=step)
        return Proposal(torch.stack(tokens, dim=1), torch.stack(rows, dim=1) if rows else None)

    def _extend(self, views: list[DraftView], ends: list[int], logit_rows, dec_views) -> torch.Tensor:
        """Compute draft KV for views[i] up to ends[i]; logits ordered like dec_views."""
        if not views:
            return torch.empty(0)
        for view, end in zip(views, ends):
            self.blocks.grow(view, end + self.k)
        batch = ScheduledBatch(views, [e - v.num_computed_tokens for v, e in zip(views, ends)])
        logits = self.runner.forward(batch, logit_rows)
        for view, end in zip(views, ends):
            view.num_computed_tokens = end
        order = [i for i, rows in enumerate(logit_rows) if rows]
        index = {id(views[i]): j for j, i in enumerate(order)}
        return logits[[index[id(v)] for v in dec_views]] if dec_views else logits

    def _decode_one(self, views: list[DraftView], tokens: list[int], offset: int) -> torch.Tensor:
        """Feed draft token `offset` of each view (position len(seq) + offset)."""
        batch = ScheduledBatch(views, [1] * len(views))
        for view in views:
            view.num_computed_tokens = len(view.seq) + offset
        logits = self.runner.forward(batch, [[0]] * len(views), token_ids=[[t] for t in tokens])
        for view in views:
            view.num_computed_tokens = len(view.seq) + offset + 1
        return logits

    def accept(self, seq: Sequence, num_kept: int) -> None:
        """After verification: the draft KV is valid up to the accepted prefix of `seq`."""
        view = self.views.get(seq.seq_id)
        if view is not None:
            view.num_computed_tokens = min(view.num_computed_tokens, num_kept)
            self.blocks.trim(view)  # pages holding only rejected drafts go back to the pool
