"""How many rows oneDNN's packed matmul is given. Some CPUs run one or two rows through a slower
path than three or more, so a decode step is padded with zero rows (the weight is read once either
way); only the real rows' outputs are kept. The table is measured before any model is built
(planning/row_padding_probe.py) and installed by the runner that uses it."""

import torch

_padded: dict[torch.dtype, dict[int, int]] = {}


def install(dtype: torch.dtype, table: dict[int, int]) -> None:
    """The padding of `dtype`'s matmuls in this process. The first table a process installs for a
    dtype stays: one process runs on one core set, which is what the table was measured on."""
    _padded.setdefault(dtype, dict(table))


def padded_rows(rows: int, dtype: torch.dtype) -> int:
    """The row count to run `rows` rows at (>= rows). The comparison comes first so a symbolic
    `rows` in a compiled step is not pinned to one count by the dictionary lookup."""
    table = _padded.get(dtype)
    if not table or rows > max(table):
        return rows
    return table.get(rows, rows)


def largest_padded(dtype: torch.dtype) -> int:
    """The largest row count padded for `dtype` (0: none); steps of more rows run as they are."""
    return max(_padded.get(dtype) or {0: 0})
