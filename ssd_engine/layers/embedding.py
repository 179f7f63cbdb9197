"""Vocabulary-parallel token embedding: each rank holds a span of the vocabulary's rows (shared
by a tied LM head); ids outside it give zeros and the all-reduce sums the ranks' parts.
On CPU the table is mapped from the checkpoint rather than copied: a lookup touches few rows."""

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
        """Point the weight at this rank's rows of the checkpoint file; False: copy it instead."""
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
