"""Vocabulary-parallel token embedding: each rank holds a span of the vocabulary's rows.

A rank looks up the ids in its span, writes zeros for the rest, and the all-reduce sums the
ranks' partial results into the full embedding. The tied LM head shares this same span.

On CPU the table is mapped from the checkpoint file instead of copied (`map_from`): a lookup reads
a few hundred of its ~150k rows, so a copy would hold ~1 GB (the 1.5B default) of which a
request touches a few MB. A tied head reads every row, which then become resident like a copy.
"""
import torch
import torch.nn.functional as F
from torch import nn

from ssd_engine.distributed.comm import TPGroup
from ssd_engine.distributed.partition import Span
from ssd_engine.utils.memory import map_rows


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, rows: Span, tp: TPGroup) -> None:
        super().__init__()
        self.rows, self.tp = rows, tp
        self.weight = nn.Parameter(torch.empty(rows.size, hidden_size), requires_grad=False)

    def load(self, loaded: torch.Tensor, shard: str | None = None, is_bias: bool = False) -> None:
        self.weight.copy_(loaded.narrow(0, self.rows.start, self.rows.size))

    def map_from(self, path: str, name: str) -> bool:
        """Point the weight at this rank's rows of the checkpoint file; False: copy it instead
        (another device or dtype than the file's)."""
        if self.weight.device.type != "cpu":
            return False
        mapped = map_rows(path, name, self.rows.start, self.rows.size)
        if mapped is None or mapped.dtype != self.weight.dtype or mapped.shape != self.weight.shape:
            return False
        self.weight.data = mapped  # the same Parameter object: a tied head follows
        return True

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        inside = (input_ids >= self.rows.start) & (input_ids < self.rows.end)
        local = torch.where(inside, input_ids - self.rows.start, 0)
        out = F.embedding(local, self.weight) * inside.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(out)
