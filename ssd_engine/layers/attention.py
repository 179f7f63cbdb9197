"""Paged attention through one backend interface (`layers/attention_backends.py`).
Each step is described by compact metadata (block tables, key counts, query offsets, tree-branch
paths); only the torch reference expands it into a dense mask."""

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

import ssd_engine.layers.compiled_ops  # noqa: F401  registers torch.ops.ssd_engine.paged_attention
from ssd_engine.kernels import gguf_cpu


@dataclass
class DenseView:
    """The metadata expanded for the torch reference: padded [R, Lq] query grid over [R, L] keys."""

    gather_slots: torch.Tensor  # [R, L] cache slot of each key each row may read (padded)
    token_to_padded: torch.Tensor | None  # [T] token's cell in the [R * Lq] grid; None: no padding
    mask: torch.Tensor  # [R, Lq, L] True where the query may attend the key
    query_cells: torch.Tensor


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot each new token's K/V is written to
    block_tables: torch.Tensor  # [R, P] int32 KV pages of each row (tree steps: of each sequence)
    # [R] int32 paged keys of each row (tree steps: the trunk keys a branch sees)
    kv_lens: torch.Tensor
    query_start: torch.Tensor  # [R + 1] int32 offsets of each row's queries among the T tokens
    max_query_len: int
    max_kv_len: int  # host copy of kv_lens.max(): no device sync
    block_size: int
    # tree steps: [R] block-table row (sequence) of each branch
    table_rows: torch.Tensor | None = None
    # tree steps: [R, K] cache slots of each branch's own path
    path_slots: torch.Tensor | None = None
    # tree steps: [R] int32 path slots each branch sees (step + 1)
    path_lens: torch.Tensor | None = None
    _dense: DenseView | None = field(default=None, repr=False)

    @property
    def is_tree(self) -> bool:
        return self.table_rows is not None

    def dense(self) -> DenseView:
        if self._dense is None:
            self._dense = _expand(self)
        return self._dense


def _expand(meta: AttentionMetadata) -> DenseView:
    bs, dev = meta.block_size, meta.kv_lens.device
    rows, width, max_q = meta.kv_lens.shape[0], meta.max_kv_len, meta.max_query_len
    tables = meta.block_tables[meta.table_rows.long()] if meta.is_tree else meta.block_tables
    pages = -(-width // bs)
    gather = (tables[:, :pages].long()[:, :, None] * bs + torch.arange(bs, device=dev)).view(
        rows, -1
    )
    gather = gather[:, :width].contiguous()
    starts = meta.query_start.long()
    q_lens = starts[1:] - starts[:-1]
    limit = (meta.kv_lens.long() - q_lens)[:, None] + torch.arange(max_q, device=dev)[None, :] + 1
    mask = torch.arange(width, device=dev)[None, None, :] < limit[:, :, None]
    if meta.is_tree:
        k = meta.path_slots.shape[1]
        path = (
            (torch.arange(k, device=dev)[None, :] < meta.path_lens[:, None])
            .unsqueeze(1)
            .expand(rows, max_q, k)
        )
        gather = torch.cat([gather, meta.path_slots.long()], dim=1)
        mask = torch.cat([mask, path], dim=2)
    tokens = meta.slot_mapping.shape[0]
    if tokens == rows * max_q:
        return DenseView(gather, None, mask, torch.arange(tokens, device=dev))
    seq_index = torch.repeat_interleave(torch.arange(rows, device=dev), q_lens, output_size=tokens)
    token_to_padded = seq_index * max_q + torch.arange(tokens, device=dev) - starts[seq_index]
    return DenseView(gather, token_to_padded, mask, token_to_padded)


def torch_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    row_independent: bool = False,
) -> torch.Tensor:
    """The reference backend: SDPA over gathered keys with the explicit mask -> [T, Hq, D]."""
    dense = meta.dense()
    rows, lq = dense.mask.shape[0], meta.max_query_len
    heads, dim = q.shape[1], q.shape[2]
    # CPU SDPA on bf16 takes a much slower path than fp32, so CPU attends in fp32
    compute = torch.float32 if q.device.type == "cpu" else q.dtype
    gather_slots, mask, run_lq = dense.gather_slots, dense.mask, lq
    if row_independent:
        gather_slots, mask, run_lq = _fixed_blocks(gather_slots, mask)
    keys = _as(k_cache[gather_slots], compute).transpose(1, 2)
    values = _as(v_cache[gather_slots], compute).transpose(1, 2)
    if dense.token_to_padded is None:
        queries = _as(q, compute).view(rows, lq, heads, dim)
    else:
        queries = q.new_zeros(rows * lq, heads, dim, dtype=compute)
        queries[dense.token_to_padded] = _as(q, compute)
        queries = queries.view(rows, lq, heads, dim)
    if run_lq > lq:  # zero padding queries attend every key (no empty softmax), dropped below
        queries = torch.cat([queries, queries.new_zeros(rows, run_lq - lq, heads, dim)], dim=1)
    out = F.scaled_dot_product_attention(
        queries.transpose(1, 2),
        keys,
        values,
        attn_mask=mask.unsqueeze(1),
        scale=scale,
        enable_gqa=heads != k_cache.shape[1],
    )
    out = out.transpose(1, 2)
    if run_lq > lq:
        out = out[:, :lq]
    out = out.reshape(rows * lq, heads, dim)
    return _as(out if dense.token_to_padded is None else out[dense.token_to_padded], q.dtype)


# torch's CPU flash attention splits queries into blocks of 32/64/256 rows and keys into blocks of
# 512; a row's bits change when its query block has under 4 rows or its key block's length changes.
# Padding queries so no block has under 4 rows, and keys to a multiple of 512, fixes the bits.
_MIN_QUERY_BLOCK = 4
_KEY_BLOCK = 512


def _query_split(queries: int) -> int:
    return 256 if queries >= 768 else 64 if queries >= 192 else 32


def _fixed_blocks(
    gather_slots: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(gather_slots, mask, query rows) padded so every query takes SDPA's blocks of one shape."""
    rows, lq, width = mask.shape
    run_lq = max(lq, _MIN_QUERY_BLOCK)
    while 0 < run_lq % _query_split(run_lq) < _MIN_QUERY_BLOCK:
        run_lq += 1
    run_width = -(-width // _KEY_BLOCK) * _KEY_BLOCK
    if run_width > width:  # padding keys read slot 0, masked out
        gather_slots = torch.cat(
            [gather_slots, gather_slots.new_zeros(rows, run_width - width)], dim=1
        )
        mask = torch.cat([mask, mask.new_zeros(rows, lq, run_width - width)], dim=2)
    if run_lq > lq:
        mask = torch.cat([mask, mask.new_ones(rows, run_lq - lq, run_width)], dim=1)
    return gather_slots, mask, run_lq


def cpu_kernel_attends(device: torch.device) -> bool:
    """Whether row_independent_attention runs the compiled kernel on `device` (else SDPA on fixed blocks)."""
    return device.type == "cpu" and gguf_cpu.available()


def row_independent_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention whose bits for a query never depend on how many queries or keys the step holds:
    the compiled CPU kernel where available, else SDPA on fixed-shape blocks (one per process)."""
    if cpu_kernel_attends(q.device):
        dense = meta.dense()
        out = torch.ops.ssd_engine_gguf.row_attention(
            _as(q, torch.float32).contiguous(),
            k_cache,
            v_cache,
            dense.gather_slots,
            dense.mask,
            dense.query_cells,
            scale,
        )
        return _as(out, q.dtype)
    return torch_attention(q, k_cache, v_cache, meta, scale, row_independent=True)


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x if x.dtype == dtype else x.to(dtype)


Backend = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, float], torch.Tensor
]


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = (
            num_heads,
            num_kv_heads,
            head_dim,
            scale,
        )
        # bound by the model runner to this layer's slice of the paged cache: [num_slots, Hk, D]
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.backend: Backend = torch_attention
        self.layer_index = 0  # how a compiled step's attention op finds this layer

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata | None
    ) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hk, D] -> [T, Hq * D]. Inside a compiled step `meta` is None and
        an opaque op runs `run` eagerly on the step's metadata (layers/compiled_ops.py)."""
        if torch.compiler.is_compiling():
            return torch.ops.ssd_engine.paged_attention(q, k, v, self.layer_index)
        return self.run(q, k, v, meta)

    def run(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        self.k_cache[meta.slot_mapping] = k
        self.v_cache[meta.slot_mapping] = v
        return self.attend(q, meta)

    def attend(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q [T, Hq, D] over the cache, the step's K/V already written -> [T, Hq * D]."""
        out = self.backend(q, self.k_cache, self.v_cache, meta, self.scale)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
