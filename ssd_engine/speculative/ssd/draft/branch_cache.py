"""One sequence's built speculation cache: (k, t*) -> the Speculation of that branch. It holds only
its rows' spans in the build's shared tensors; entries are made when read and stay the same objects
once made (server.py compares them by identity)."""

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from ssd_engine.saguaro.source import Source
from ssd_engine.speculative.ssd.protocol import Speculation


@dataclass(frozen=True)
class DecodedBranches:
    """One decode pass's branches: row r's outcome (k, t*), K tokens and their [K, vocab] rows."""

    keys: list[tuple[int, int]]
    tokens: torch.Tensor  # [rows, K] on the host
    q: torch.Tensor | None  # [rows, K, vocab]; None: every branch greedy


def find_row(keys: list[tuple[int, int]], start: int, stop: int, key) -> int | None:
    """The row in [start, stop) whose outcome is `key`."""
    for row in range(start, stop):
        if keys[row] == key:
            return row
    return None


class BranchCache(Mapping):
    def __init__(self, greedy: bool) -> None:
        self.greedy = greedy  # verified as one-hot: no q rows kept
        self.spans: list[tuple[DecodedBranches, int, int]] = []
        self._made: dict[tuple[int, int], Speculation] = {}

    def add(self, branches: DecodedBranches, start: int, stop: int) -> None:
        if stop > start:
            self.spans.append((branches, start, stop))

    def _row(self, key) -> tuple[DecodedBranches, int] | None:
        for branches, start, stop in self.spans:
            row = find_row(branches.keys, start, stop, key)
            if row is not None:
                return branches, row
        return None

    def __getitem__(self, key: tuple[int, int]) -> Speculation:
        if key not in self._made:
            found = self._row(key)
            if found is None:
                raise KeyError(key)
            branches, row = found
            q = None if self.greedy or branches.q is None else branches.q[row]
            self._made[key] = Speculation(Source.HIT, branches.tokens[row].tolist(), q)
        return self._made[key]

    def __iter__(self) -> Iterator[tuple[int, int]]:
        for branches, start, stop in self.spans:
            yield from branches.keys[start:stop]

    def __len__(self) -> int:
        return sum(stop - start for _, start, stop in self.spans)

    def __contains__(self, key) -> bool:
        return key in self._made or self._row(key) is not None
