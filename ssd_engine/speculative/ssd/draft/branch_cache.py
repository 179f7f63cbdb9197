"""One sequence's built speculation cache: (k, t*) -> the Speculation of that branch.

A build decodes every branch of every sequence at once (at a large batch, hundreds of thousands
of rows) and a round reads one entry per sequence: the entries are made when read, from the
build's shared tensors, and stay the same objects once made (server.py compares them by identity).
"""
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from ssd_engine.saguaro.source import Source
from ssd_engine.speculative.ssd.protocol import Speculation


@dataclass(frozen=True)
class DecodedBranches:
    """One decode pass's branches: row r's K sampled tokens and the [K, vocab] rows they came from."""
    tokens: list[list[int]]
    q: torch.Tensor | None  # [rows, K, vocab]; None: every branch greedy


class BranchCache(Mapping):
    def __init__(self, greedy: bool) -> None:
        self.greedy = greedy  # a greedy sequence's drafts are verified as one-hot: no q rows kept
        self.rows: dict[tuple[int, int], tuple[DecodedBranches, int]] = {}  # filled by the builder
        self._made: dict[tuple[int, int], Speculation] = {}

    def __getitem__(self, key: tuple[int, int]) -> Speculation:
        if key not in self._made:
            branches, row = self.rows[key]
            q = None if self.greedy or branches.q is None else branches.q[row]
            self._made[key] = Speculation(Source.HIT, branches.tokens[row], q)
        return self._made[key]

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __contains__(self, key) -> bool:
        return key in self.rows
