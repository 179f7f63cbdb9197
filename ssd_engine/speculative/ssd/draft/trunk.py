"""The draft process's view of each sequence and its trunk: the draft's own paged K/V of the
committed tokens, followed by the speculation currently being verified.

`trunk` lists the tokens whose K/V sit in slots 0..len(trunk)-1 of the sequence's blocks. After a
round's outcome arrives the trunk is cut back to its longest prefix that is still true (the
committed tokens, then the speculation just sent), so accepted draft tokens are never recomputed.
Reserving a trunk's blocks, extending it and decoding K tokens from it are paged_draft.py's, shared
with SD's colocated draft; the sampling (Saguaro's down-weighting, per-row streams) is the trunk's.
"""
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from ssd_engine.core.structures import BlockTable, new_block_table
from ssd_engine.runtime.block_manager import BlockManager
from ssd_engine.runtime.model_runner import ModelRunner
from ssd_engine.saguaro.sampling import saguaro_probs
from ssd_engine.saguaro.source import Source
from ssd_engine.sampling.grammar import GrammarState, masked_steps
from ssd_engine.sampling.processors import SamplingTensors
from ssd_engine.sampling.sampler import sample
from ssd_engine.speculative.paged_draft import PagedDraft
from ssd_engine.speculative.ssd.protocol import DraftParams, Speculation


@dataclass
class DraftSeq:  # a Paged (core/structures.py): its blocks are the draft's, its length the committed tokens'
    seq_id: int
    tokens: list[int]                         # committed tokens, as the coordinator has them
    params: DraftParams
    generator: torch.Generator | None         # draft sampling (None: greedy)
    backup_generator: torch.Generator         # the fast backup's random proposals
    block_table: BlockTable = field(default_factory=new_block_table)
    num_computed_tokens: int = 0              # BlockManager bookkeeping; the trunk is the truth
    trunk: list[int] = field(default_factory=list)
    sent: Speculation | None = None           # the speculation the target is verifying
    hit_key: tuple | None = None              # the outcome whose own cached branch `sent` is (a true hit)
    cache: Mapping = field(default_factory=dict)  # (k, t*) -> Speculation for the next round (branch_cache.py)
    planned_fanout: list[int] = field(default_factory=list)  # F_0..F_K from the Saguaro plan
    fanout: list[int] = field(default_factory=list)  # F_0..F_K this build prepares (<= planned, build_budget.py)
    fanout_table: list = field(default_factory=list)  # the plan's fan-out at budgets 1..planned ([]: scale it)
    ranked: list | None = None                # per position 1..K+1 of `sent`: the draft's top RANK_DEPTH ids
    bonus_rank: int = -1                      # the last outcome's bonus among its candidates (protocol.py)
    grammar: GrammarState | None = None       # structured outputs: the grammar after the committed output

    @property
    def outputs(self) -> list[int]:
        return self.tokens[self.params.num_prompt_tokens:]

    def __len__(self) -> int:
        return len(self.tokens)

    def cut_trunk(self, upto: int) -> None:
        """Keep the trunk's longest prefix that agrees with tokens + sent speculation, at most `upto`."""
        truth = self.tokens + (self.sent.tokens if self.sent else [])
        keep = 0
        limit = min(len(self.trunk), len(truth), upto)
        while keep < limit and self.trunk[keep] == truth[keep]:
            keep += 1
        del self.trunk[keep:]


def sampling_of(params: list[DraftParams], device) -> SamplingTensors:
    # DraftParams carries SamplingParams' names; from_params also records what the host knows
    # (filters on, greedy rows), so the probability rows are made without reading the tensors back
    return SamplingTensors.from_params(params, device)


class Trunk(PagedDraft[DraftSeq]):
    """Runs the draft model over trunks; samples draft tokens keeping their exact q rows."""

    def __init__(self, runner: ModelRunner, blocks: BlockManager, k: int, vocab: int,
                 saguaro_c: float = 1.0) -> None:
        super().__init__(runner, blocks, k)
        self.vocab, self.saguaro_c = vocab, saguaro_c

    def drop(self, seq: DraftSeq) -> None:
        super().drop(seq)
        seq.trunk = []  # its K/V went with the blocks

    def extend(self, seqs: list[DraftSeq], feeds: list[list[int]], rows: int) -> torch.Tensor:
        """Append feeds[i] to seqs[i]'s trunk; logits of the last `rows` fed positions, [n, rows, V]."""
        return self._extend(seqs, feeds, [rows] * len(seqs)).view(len(seqs), rows, -1)

    def extend_rows(self, seqs: list[DraftSeq], feeds: list[list[int]], rows: list[int]) -> torch.Tensor:
        """extend() with rows[i] logit rows for sequence i, one sequence's after another: [sum(rows), V]."""
        return self._extend(seqs, feeds, rows)

    def _extend(self, seqs: list[DraftSeq], feeds: list[list[int]], rows: list[int]) -> torch.Tensor:
        logits = self.extend_kv(seqs, [len(s.trunk) for s in seqs], feeds, rows)
        for seq, fed in zip(seqs, feeds):
            seq.trunk.extend(fed)
        return logits

    def sample(self, logits: torch.Tensor, params: list[DraftParams], generators: list[torch.Generator | None],
               fanouts: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[n, V] logits -> tokens [n] and the rows they were drawn from [n, vocab] (None if all greedy).
        fanouts[i]: the fan-out the cache will use at this position (Saguaro sampling down-weights
        that many top tokens; greedy rows are unaffected). Ids past the shared vocabulary
        (embedding padding) are never proposed."""
        logits = logits[:, :self.vocab]
        if all(p.greedy for p in params):
            return logits.argmax(dim=-1), None
        probs = sampling_of(params, logits.device).probs(logits)
        probs = saguaro_probs(probs, fanouts, self.saguaro_c)
        # every sampled row has its own stream (greedy rows: one-hot, no draw), told from the host
        return sample(probs, generators, random_rows=[not p.greedy for p in params]), probs

    def draft_jit(self, seqs: list[DraftSeq]) -> list[Speculation]:
        """The primary drafting K tokens just in time (SD-style), for sequences that missed."""
        for seq in seqs:
            seq.cut_trunk(len(seq) - 1)  # re-feed the bonus token at least: its logits start the draft
        params = [s.params for s in seqs]
        gens = [s.generator for s in seqs]
        logits = self.extend(seqs, [s.tokens[len(s.trunk):] for s in seqs], 1)[:, 0]

        def draw(step: int, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
            return self.sample(logits, params, gens, [s.fanout[step] for s in seqs])
        with masked_steps([s.grammar for s in seqs], draw) as step:
            tokens, q = self.decode(seqs, [len(s.trunk) for s in seqs], logits, step)
        tokens = tokens.tolist()  # the K drafts' one read
        for seq, drafted in zip(seqs, tokens):
            seq.trunk.extend(drafted[:self.k - 1])  # their K/V went into the blocks as they were drawn
        return [Speculation(Source.JIT, drafted, None if q is None else q[i]) for i, drafted in enumerate(tokens)]
