"""One-token decode steps of the same rows (the SD draft's steps after catch-up), with every step's
positions, slots and key counts uploaded in one copy so no step waits on host work."""

import torch

from ssd_engine.layers.attention import AttentionMetadata
from ssd_engine.utils.host_upload import padded_rows, upload


class DecodeFeed:
    def __init__(
        self, runner, starts: list[int], block_tables: list[list[int]], steps: int
    ) -> None:
        """Row i feeds position starts[i] + s at step s (s < steps); its blocks must already cover it."""
        self.runner, self.block_size = runner, runner.block_size
        bs, rows = runner.block_size, len(starts)
        positions = [[start + s for start in starts] for s in range(steps)]
        slots = [
            [table[p // bs] * bs + p % bs for p, table in zip(step, block_tables)]
            for step in positions
        ]
        blocks = -(-(max(starts) + steps) // bs)
        # per step [positions | slots | key counts]: the CUDA graphs' static buffer order, one copy
        columns = [
            column
            for s in range(steps)
            for column in (positions[s], slots[s], [p + 1 for p in positions[s]])
        ]
        *per_step, tables_t, query_start_t = upload(
            columns + [padded_rows(block_tables, blocks), list(range(rows + 1))],
            runner.device,
            torch.int32,
        )
        self.positions, self.slots, self.kv_lens = per_step[0::3], per_step[1::3], per_step[2::3]
        self.block_tables, self.query_start = tables_t.view(rows, blocks), query_start_t
        self.max_kv_lens = [max(starts) + s + 1 for s in range(steps)]

    def step(self, s: int, tokens: torch.Tensor) -> torch.Tensor:
        """Feed `tokens` [rows] (on the device) at step s -> fp32 logits [rows, V]."""
        meta = AttentionMetadata(
            slot_mapping=self.slots[s],
            block_tables=self.block_tables,
            kv_lens=self.kv_lens[s],
            query_start=self.query_start,
            max_query_len=1,
            max_kv_len=self.max_kv_lens[s],
            block_size=self.block_size,
        )
        return self.runner.run_metadata(tokens, self.positions[s], meta)
