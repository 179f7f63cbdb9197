"""A step's host columns reach the device unchanged, whatever form they come in."""

import array
import random

import pytest
import torch

from ssd_engine.core.structures import new_block_table
from ssd_engine.utils.host_upload import padded_rows, upload


@pytest.mark.parametrize("dtype", [torch.int32, torch.long])
def test_every_column_form_uploads_its_values(dtype):
    """Python lists, packed tables of the dtype's kind (copied as memory) and of another kind, and
    empty columns, in one upload: each column comes back as its own values."""
    rng = random.Random(1)
    columns = [[rng.randrange(-5, 1 << 20) for _ in range(rng.randrange(4))] for _ in range(6)]
    forms = [
        columns[0],
        new_block_table(columns[1]),
        array.array("q", columns[2]),
        [],
        columns[3],
        new_block_table(),
        new_block_table(columns[4]),
        columns[5],
    ]
    out = upload(forms, "cpu", dtype)
    assert [t.dtype for t in out] == [dtype] * len(forms)
    assert [t.tolist() for t in out] == [list(f) for f in forms]


def test_padded_rows_cut_and_zero_fill_every_table():
    rng = random.Random(2)
    for _ in range(200):
        tables = [
            [rng.randrange(1, 1000) for _ in range(rng.randrange(8))]
            for _ in range(rng.randrange(1, 5))
        ]
        width = rng.randrange(0, 9)
        expected = [block for t in tables for block in t[:width] + [0] * (width - len(t[:width]))]
        packed = [new_block_table(t) if rng.random() < 0.7 else t for t in tables]
        flat = padded_rows(packed, width)
        assert flat.typecode == "i" and list(flat) == expected
