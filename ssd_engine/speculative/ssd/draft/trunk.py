"""The draft process's view of each sequence and its trunk: the tokens whose K/V sit in slots
0..len(trunk)-1 of its blocks. After an outcome the trunk is cut back to its longest prefix still
true (committed tokens, then the speculation sent), so accepted drafts are never recomputed."""

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
class DraftSeq:  # a Paged: its blocks are the draft's, its length the committed tokens'
    seq_id: int
    tokens: list[int]
    params: DraftParams
    generator: torch.Generator | None  # draft sampling (None: greedy)
    backup_generator: torch.Generator
    block_table: BlockTable = field(default_factory=new_block_table)
    num_computed_tokens: int = 0  # BlockManager bookkeeping; the trunk is the truth
    trunk: list[int] = field(default_factory=list)
    sent: Speculation | None = None  # the speculation the target is verifying
    hit_key: tuple | None = None  # the outcome whose own cached branch `sent` is
    cache: Mapping = field(default_factory=dict)  # (k, t*) -> Speculation for the next round
    planned_fanout: list[int] = field(default_factory=list)
    fanout: list[int] = field(default_factory=list)  # F_0..F_K this build prepares (<= planned)
    fanout_table: list = field(default_factory=list)
    ranked: list | None = None  # per position 1..K+1 of `sent`: the draft's top ids
    bonus_rank: int = -1
    grammar: GrammarState | None = None

    @property
    def outputs(self) -> list[int]:
        return self.tokens[self.params.num_prompt_tokens :]

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
    return SamplingTensors.from_params(params, device)


class Trunk(PagedDraft[DraftSeq]):
    def __init__(
        self, runner: ModelRunner, blocks: BlockManager, k: int, vocab: int, saguaro_c: float = 1.0
    ) -> None:
        super().__init__(runner, blocks, k)
        self.vocab, self.saguaro_c = vocab, saguaro_c

    def drop(self, seq: DraftSeq) -> None:
        super().drop(seq)
        seq.trunk = []  # its K/V went with the blocks

    def extend(self, seqs: list[DraftSeq], feeds: list[list[int]], rows: int) -> torch.Tensor:
        """Append feeds[i] to seqs[i]'s trunk; logits of the last `rows` fed positions, [n, rows, V]."""
        return self._extend(seqs, feeds, [rows] * len(seqs)).view(len(seqs), rows, -1)

    def extend_rows(
        self, seqs: list[DraftSeq], feeds: list[list[int]], rows: list[int]
    ) -> torch.Tensor:
        """extend() with rows[i] logit rows for sequence i, concatenated: [sum(rows), V]."""
        return self._extend(seqs, feeds, rows)

    def _extend(
        self, seqs: list[DraftSeq], feeds: list[list[int]], rows: list[int]
    ) -> torch.Tensor:
        logits = self.extend_kv(seqs, [len(s.trunk) for s in seqs], feeds, rows)
        for seq, fed in zip(seqs, feeds):
            seq.trunk.extend(fed)
        return logits

    def sample(
        self,
        logits: torch.Tensor,
        params: list[DraftParams],
        generators: list[torch.Generator | None],
        fanouts: list[int],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[n, V] logits -> tokens [n] and the rows they were drawn from [n, vocab] (None if all greedy).
        fanouts[i]: the top tokens Saguaro sampling down-weights. Ids past `vocab` never drawn."""
        logits = logits[:, : self.vocab]
        if all(p.greedy for p in params):
            return logits.argmax(dim=-1), None
        probs = sampling_of(params, logits.device).probs(logits)
        probs = saguaro_probs(probs, fanouts, self.saguaro_c)
        return sample(probs, generators, random_rows=[not p.greedy for p in params]), probs

    def draft_jit(self, seqs: list[DraftSeq]) -> list[Speculation]:
        """K tokens drafted just in time, for sequences that missed."""
        for seq in seqs:
            seq.cut_trunk(len(seq) - 1)  # the bonus token's logits start the draft
        params = [s.params for s in seqs]
        gens = [s.generator for s in seqs]
        logits = self.extend(seqs, [s.tokens[len(s.trunk) :] for s in seqs], 1)[:, 0]

        def draw(step: int, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
            return self.sample(logits, params, gens, [s.fanout[step] for s in seqs])

        with masked_steps([s.grammar for s in seqs], draw) as step:
            tokens, q = self.decode(seqs, [len(s.trunk) for s in seqs], logits, step)
        tokens = tokens.tolist()
        for seq, drafted in zip(seqs, tokens):
            seq.trunk.extend(drafted[: self.k - 1])  # their K/V were written as they were drawn
        return [
            Speculation(Source.JIT, drafted, None if q is None else q[i])
            for i, drafted in enumerate(tokens)
        ]
