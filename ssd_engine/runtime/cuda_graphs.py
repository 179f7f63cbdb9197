"""CUDA graphs for the fixed-shape steps: decode, verification (K + 1 per row) and SSD tree-branch
steps, since eager small-model steps are launch-bound. A step replays the graph of the smallest row
bucket holding it; padding rows are empty (no keys, K/V to a reserved slot), outputs dropped.
`capture="emulate"` runs the same static-buffer path without CUDA, for CPU tests."""

import time
from collections import Counter
from dataclasses import dataclass, replace

import torch

from ssd_engine.layers.attention import AttentionMetadata
from ssd_engine.utils.test_hooks import checked_graph


def bucket_sizes(cap: int) -> list[int]:
    sizes, n = [], 1
    while n < cap:
        sizes.append(n)
        n *= 2
    return sizes + [cap]


@dataclass
class _Family:
    """Static buffers of every row count of one step shape (kind, tokens per row): a `size`-row
    graph reads [ids | positions | slots] (size * per_row each), then size key counts."""

    columns: torch.Tensor  # int32 [3 * cap * per_row + cap]
    meta: AttentionMetadata
    # the block tables copied in last (held, so the identity check is sound): same tensor, no copy
    tables_from: torch.Tensor | None = None


def _adjacent(first: tuple, second: tuple) -> bool:
    """Whether two (destination, source) copies continue each other on both sides: one copy then."""
    (dst_a, src_a), (dst_b, src_b) = first, second
    return (
        src_a.dtype == src_b.dtype == dst_a.dtype
        and src_a.device == src_b.device
        and src_a.is_contiguous()
        and src_b.is_contiguous()
        and src_b.data_ptr() == src_a.data_ptr() + src_a.numel() * src_a.element_size()
        and src_a.untyped_storage().data_ptr() == src_b.untyped_storage().data_ptr()
        and dst_b.data_ptr() == dst_a.data_ptr() + dst_a.numel() * dst_a.element_size()
    )


def copy_runs(pairs: list[tuple]) -> None:
    """dst.copy_(src) for each (dst, src), equal sizes, 1-D; a run of pairs adjacent on both sides
    goes in one copy (one launch)."""
    i = 0
    while i < len(pairs):
        j, size = i + 1, pairs[i][1].numel()
        while j < len(pairs) and _adjacent(pairs[j - 1], pairs[j]):
            size += pairs[j][1].numel()
            j += 1
        dst, src = pairs[i]
        if j - i > 1:
            dst, src = dst.as_strided((size,), (1,)), src.as_strided((size,), (1,))
        dst.copy_(src)
        i = j


class GraphRunner:
    def __init__(
        self,
        forward,
        *,
        cap: int,
        max_blocks: int,
        block_size: int,
        pad_slot: int,
        device: torch.device,
        capture: str,
        recorded: bool = True,
    ) -> None:
        self.forward = forward  # (input_ids, positions, meta) -> hidden [T, H]
        # emulated replays are checked (utils/test_hooks.py) unless the forward is compiled
        self.recorded = recorded
        self.sizes = bucket_sizes(cap)
        self.max_blocks, self.block_size, self.pad_slot, self.device = (
            max_blocks,
            block_size,
            pad_slot,
            device,
        )
        self.capture = capture
        self.shapes: set[tuple] = set()  # the (kind, width) keys the engine named
        self.families: dict[tuple, _Family] = {}
        self.graphs: dict[tuple, tuple] = {}  # (family key, rows) -> (replay, static output)
        self.replayed: Counter = Counter()  # (family key, rows) -> replays
        self.replay_seconds = 0.0
        self.pool = None

    def family_key(self, meta: AttentionMetadata, tokens: int) -> tuple | None:
        """Which static family a step belongs to, or None when it must run eagerly."""
        rows = meta.kv_lens.shape[0]
        if rows > self.sizes[-1] or tokens != rows * meta.max_query_len:
            return None
        if meta.block_tables.shape[1] > self.max_blocks:
            return None
        if meta.is_tree:
            key = (
                ("tree", meta.path_slots.shape[1])
                if meta.block_tables.shape[0] <= self.sizes[-1]
                else None
            )
        else:
            key = ("paged", meta.max_query_len)
        return key if key in self.shapes else None

    def add_shapes(self, keys: list[tuple]) -> None:
        self.shapes.update(keys)

    @torch.inference_mode()
    def capture_all(self, keys: list[tuple]) -> None:
        """Capture every row bucket of each (kind, width) key now, on empty static buffers; largest
        first, so smaller graphs reuse the shared pool's memory."""
        self.add_shapes(keys)
        for key in keys:
            family = self._family(key)
            for size in reversed(self.sizes):
                if (key, size) not in self.graphs:
                    self._empty(family, size)
                    self.graphs[(key, size)] = self._capture(family, size)

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, key: tuple
    ):
        rows = meta.kv_lens.shape[0]
        size = next(n for n in self.sizes if n >= rows)
        family = self._family(key)
        self._fill(family, input_ids, positions, meta, size)
        graph = self.graphs.get((key, size))
        if graph is None:
            graph = self.graphs[(key, size)] = self._capture(family, size)
        replay, out = graph
        started = time.perf_counter()
        replay()
        self.replay_seconds += time.perf_counter() - started
        self.replayed[(key, size)] += 1
        return out[: input_ids.shape[0]]

    def _family(self, key: tuple) -> _Family:
        if key not in self.families:
            self.families[key] = self._new_family(key)
        return self.families[key]

    def _new_family(self, key: tuple) -> _Family:
        kind, width = key
        cap, dev = self.sizes[-1], self.device
        per_row = width if kind == "paged" else 1
        i32 = dict(dtype=torch.int32, device=dev)
        meta = AttentionMetadata(
            slot_mapping=torch.zeros(0, **i32),
            block_tables=torch.zeros(cap, self.max_blocks, **i32),
            kv_lens=torch.zeros(0, **i32),
            query_start=torch.arange(cap + 1, **i32) * per_row,
            max_query_len=per_row,
            max_kv_len=0,
            block_size=self.block_size,
        )
        if kind == "tree":
            meta = replace(
                meta,
                table_rows=torch.zeros(cap, **i32),
                path_lens=torch.zeros(cap, **i32),
                path_slots=torch.full((cap, width), self.pad_slot, dtype=torch.long, device=dev),
            )
        return _Family(torch.zeros(3 * cap * per_row + cap, **i32), meta)

    @staticmethod
    def _columns(family: _Family, size: int) -> tuple:
        """A `size`-row graph's ids, positions, slots and key counts: views of the family's buffer."""
        n = size * family.meta.max_query_len
        c = family.columns
        return c[:n], c[n : 2 * n], c[2 * n : 3 * n], c[3 * n : 3 * n + size]

    def _fill(
        self, family: _Family, input_ids, positions, meta: AttentionMetadata, size: int
    ) -> None:
        """Copy the step in; rows past it up to `size` become empty rows."""
        static, tokens, rows = family.meta, input_ids.shape[0], meta.kv_lens.shape[0]
        ids, pos, slots, kv_lens = self._columns(family, size)
        copy_runs(
            [
                (ids[:tokens], input_ids),
                (pos[:tokens], positions),
                (slots[:tokens], meta.slot_mapping),
                (kv_lens[:rows], meta.kv_lens),
            ]
        )
        # padding rows: no keys, K/V to the padding slot; ids and positions in range
        if rows < size:
            ids[tokens:].zero_()
            pos[tokens:].zero_()
            slots[tokens:].fill_(self.pad_slot)
            kv_lens[rows:].zero_()
        tables = meta.block_tables
        if tables is not family.tables_from:
            static.block_tables[: tables.shape[0], : tables.shape[1]].copy_(tables)
            family.tables_from = tables
        if meta.is_tree:
            static.table_rows[:rows].copy_(meta.table_rows)
            static.table_rows[rows:size].zero_()
            static.path_slots[:rows].copy_(meta.path_slots)
            static.path_lens[:rows].copy_(meta.path_lens)
            static.path_lens[rows:size].zero_()

    def _empty(self, family: _Family, size: int) -> None:
        """Every row of a `size`-row graph empty (no keys, K/V to the padding slot)."""
        ids, pos, slots, kv_lens = self._columns(family, size)
        ids.zero_(), pos.zero_(), slots.fill_(self.pad_slot), kv_lens.zero_()
        family.meta.block_tables.zero_()
        family.tables_from = None
        if family.meta.is_tree:
            family.meta.table_rows.zero_(), family.meta.path_lens.zero_()
            family.meta.path_slots.fill_(self.pad_slot)

    def _view(self, family: _Family, size: int):
        static = family.meta
        ids, pos, slots, kv_lens = self._columns(family, size)
        meta = replace(
            static,
            slot_mapping=slots,
            kv_lens=kv_lens,
            query_start=static.query_start[: size + 1],
            _dense=None,
        )
        if static.is_tree:
            meta = replace(
                meta,
                table_rows=static.table_rows[:size],
                path_slots=static.path_slots[:size],
                path_lens=static.path_lens[:size],
            )
        else:
            meta = replace(meta, block_tables=static.block_tables[:size])
        return ids, pos, meta

    def _capture(self, family: _Family, size: int):
        input_ids, positions, meta = self._view(family, size)
        run = lambda: self.forward(input_ids, positions, meta)
        if self.capture == "emulate":
            if self.recorded:
                kind = "tree" if family.meta.is_tree else "paged"
                run = checked_graph(
                    run, f"{family.meta.max_query_len}-token {kind} step x {size} rows"
                )
            out = run()
            return (lambda: out.copy_(run())), out
        side = torch.cuda.Stream(self.device)  # warm-up off the capture stream
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = run()
        self.pool = graph.pool()
        return graph.replay, out
