"""Paged attention through one backend interface.

Every step describes its attention with compact metadata (block tables, key counts, query offsets,
and for SSD tree-branch steps each branch's trunk row, fork point and own path slots); no backend
is handed a dense mask. Backends (`layers/attention_backends.py`):
- `torch`: the reference. Expands the metadata once per step into slot tables and a boolean mask
  (`AttentionMetadata.dense`) and runs SDPA; the oracle for the others.
- on CPU, `auto`: `row_independent_attention`, the compiled kernel kernels/cpu_attention.cpp over the
  same expanded metadata (each query alone over its own keys), where the CPU kernels build.
- `triton`: `kernels/paged_attention.py`, masks generated in the kernel; the CUDA default.
- `flash-attn`: flash_attn_with_kvcache for paged steps when it is importable (tree steps stay
  on Triton).
"""
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
    gather_slots: torch.Tensor     # [R, L] cache slot of each key each row may read (padded)
    token_to_padded: torch.Tensor | None  # [T] index of each query token in the padded [R * Lq] grid;
                                          # None when every row has Lq queries (the grid is the tokens)
    mask: torch.Tensor             # [R, Lq, L] True where the query may attend the key
    query_cells: torch.Tensor      # [T] token_to_padded, or 0..T-1 where that is None (the CPU kernel's)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor     # [T] cache slot each new token's K/V is written to
    block_tables: torch.Tensor     # [R, P] int32 KV pages of each row (tree steps: of each sequence)
    kv_lens: torch.Tensor          # [R] int32 paged keys of each row (tree steps: the trunk keys a branch sees)
    query_start: torch.Tensor      # [R + 1] int32 offsets of each row's queries among the T tokens
                                   # (a padded graph batch may hold fewer: rows past them are empty)
    max_query_len: int
    max_kv_len: int                # host copy of kv_lens.max(), so the reference needs no device sync
    block_size: int
    table_rows: torch.Tensor | None = None  # tree steps: [R] block-table row (sequence) of each branch
    path_slots: torch.Tensor | None = None  # tree steps: [R, K] cache slots of each branch's own path
    path_lens: torch.Tensor | None = None   # tree steps: [R] int32 path slots each branch sees (step + 1)
    _dense: DenseView | None = field(default=None, repr=False)

    @property
    def is_tree(self) -> bool:
        return self.table_rows is not None

    def dense(self) -> DenseView:
        """Expanded once per step (every layer shares it)."""
        if self._dense is None:
            self._dense = _expand(self)
        return self._dense


def _expand(meta: AttentionMetadata) -> DenseView:
    bs, dev = meta.block_size, meta.kv_lens.device
    rows, width, max_q = meta.kv_lens.shape[0], meta.max_kv_len, meta.max_query_len
    tables = meta.block_tables[meta.table_rows.long()] if meta.is_tree else meta.block_tables
    pages = -(-width // bs)
    # contiguous once a step: the CPU kernel reads it raw, in every layer
    gather = (tables[:, :pages].long()[:, :, None] * bs + torch.arange(bs, device=dev)).view(rows, -1)
    gather = gather[:, :width].contiguous()
    starts = meta.query_start.long()
    q_lens = starts[1:] - starts[:-1]
    limit = (meta.kv_lens.long() - q_lens)[:, None] + torch.arange(max_q, device=dev)[None, :] + 1
    mask = torch.arange(width, device=dev)[None, None, :] < limit[:, :, None]   # causal, [R, Lq, L]
    if meta.is_tree:  # then the branch's own path, its first path_lens[r] slots
        k = meta.path_slots.shape[1]
        path = (torch.arange(k, device=dev)[None, :] < meta.path_lens[:, None]).unsqueeze(1).expand(rows, max_q, k)
        gather = torch.cat([gather, meta.path_slots.long()], dim=1)
        mask = torch.cat([mask, path], dim=2)
    tokens = meta.slot_mapping.shape[0]
    if tokens == rows * max_q:  # decode, uniform verification, branch steps: nothing to pad
        return DenseView(gather, None, mask, torch.arange(tokens, device=dev))
    seq_index = torch.repeat_interleave(torch.arange(rows, device=dev), q_lens, output_size=tokens)
    token_to_padded = seq_index * max_q + torch.arange(tokens, device=dev) - starts[seq_index]
    return DenseView(gather, token_to_padded, mask, token_to_padded)


def torch_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, row_independent: bool = False) -> torch.Tensor:
    """The reference backend: gather each row's keys, SDPA with the explicit mask. -> [T, Hq, D].
    row_independent: each query's bits never depend on the step's other queries or keys (see
    `row_independent_attention`)."""
    dense = meta.dense()
    rows, lq = dense.mask.shape[0], meta.max_query_len
    heads, dim = q.shape[1], q.shape[2]
    # CPU SDPA on bf16 (a draft's activations) takes a path 3-10x slower than fp32's for decode
    # rows, so the gathered keys are attended in fp32 there (a copy of what is read anyway)
    compute = torch.float32 if q.device.type == "cpu" else q.dtype
    gather_slots, mask, run_lq = dense.gather_slots, dense.mask, lq
    if row_independent:
        gather_slots, mask, run_lq = _fixed_blocks(gather_slots, mask)
    keys = _as(k_cache[gather_slots], compute).transpose(1, 2)    # [R, Hk, L, D]
    values = _as(v_cache[gather_slots], compute).transpose(1, 2)
    if dense.token_to_padded is None:
        queries = _as(q, compute).view(rows, lq, heads, dim)
    else:
        queries = q.new_zeros(rows * lq, heads, dim, dtype=compute)
        queries[dense.token_to_padded] = _as(q, compute)
        queries = queries.view(rows, lq, heads, dim)
    if run_lq > lq:  # padding queries (zeros, attending every key: no empty softmax), dropped below
        queries = torch.cat([queries, queries.new_zeros(rows, run_lq - lq, heads, dim)], dim=1)
    out = F.scaled_dot_product_attention(queries.transpose(1, 2), keys, values, attn_mask=mask.unsqueeze(1),
                                         scale=scale, enable_gqa=heads != k_cache.shape[1])
    out = out.transpose(1, 2)
    if run_lq > lq:
        out = out[:, :lq]
    out = out.reshape(rows * lq, heads, dim)
    return _as(out if dense.token_to_padded is None else out[dense.token_to_padded], q.dtype)


# torch's CPU flash attention (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp, torch 2.13) splits
# the queries into blocks of 32 / 64 / 256 rows (fewer than 192 / 768 / more queries) and the keys
# into blocks of 512 (512 or more keys; else one block of them all); a block's matmuls give a row
# other bits when the block has 1, 2 or 3 rows than from 4 on, and a softmax over a key block
# gives other bits when the block's (masked) length changes. With queries padded so no block has
# fewer than 4 rows, and keys padded (masked) to a multiple of 512, a query's output is the same bits
# at any query count, position and dense key length.
_MIN_QUERY_BLOCK = 4
_KEY_BLOCK = 512


def _query_split(queries: int) -> int:
    return 256 if queries >= 768 else 64 if queries >= 192 else 32


def _fixed_blocks(gather_slots: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(gather_slots, mask, query rows) padded so every query takes SDPA's blocks of one shape."""
    rows, lq, width = mask.shape
    run_lq = max(lq, _MIN_QUERY_BLOCK)
    while 0 < run_lq % _query_split(run_lq) < _MIN_QUERY_BLOCK:
        run_lq += 1
    run_width = -(-width // _KEY_BLOCK) * _KEY_BLOCK
    if run_width > width:  # slot 0 read for the padding keys, masked out
        gather_slots = torch.cat([gather_slots, gather_slots.new_zeros(rows, run_width - width)], dim=1)
        mask = torch.cat([mask, mask.new_zeros(rows, lq, run_width - width)], dim=2)
    if run_lq > lq:
        mask = torch.cat([mask, mask.new_ones(rows, run_lq - lq, run_width)], dim=1)
    return gather_slots, mask, run_lq


def cpu_kernel_attends(device: torch.device) -> bool:
    """Whether row_independent_attention runs the compiled kernel on `device` (else SDPA on fixed blocks)."""
    return device.type == "cpu" and gguf_cpu.available()


def row_independent_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Attention whose bits for a query never depend on how many queries or keys the step holds: what
    a target kept in one format for every row count needs (EngineConfig.target_dtype: AR scores a lone
    decode row, SD K + 1 verification rows). On CPU with the compiled kernels, each query walks its own
    keys in a fixed order (kernels/cpu_attention.cpp); else the torch reference runs SDPA on blocks of
    one shape, paying for up to 3 padding queries and 511 masked keys a row. One process uses one of
    the two throughout (`gguf_cpu.available()` is settled once)."""
    if cpu_kernel_attends(q.device):
        dense = meta.dense()
        out = torch.ops.ssd_engine_gguf.row_attention(_as(q, torch.float32).contiguous(), k_cache, v_cache,
                                                      dense.gather_slots, dense.mask, dense.query_cells, scale)
        return _as(out, q.dtype)
    return torch_attention(q, k_cache, v_cache, meta, scale, row_independent=True)


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in dtype; x itself when it already is (a no-op `to` still costs a dispatch)."""
    return x if x.dtype == dtype else x.to(dtype)


Backend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, float], torch.Tensor]


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        # bound by the model runner to this layer's slice of the paged cache: [num_slots, Hk, D]
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.backend: Backend = torch_attention  # the model runner picks the step's backend
        self.layer_index = 0  # its place in the model: how a compiled step's attention op finds it

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata | None) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hk, D] -> [T, Hq * D]. Inside a compiled step (runtime/compiled_model.py)
        `meta` is None: the opaque op runs `run` on the step's metadata, eagerly (layers/compiled_ops.py)."""
        if torch.compiler.is_compiling():
            return torch.ops.ssd_engine.paged_attention(q, k, v, self.layer_index)
        return self.run(q, k, v, meta)

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        self.k_cache[meta.slot_mapping] = k
        self.v_cache[meta.slot_mapping] = v
        return self.attend(q, meta)

    def attend(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q [T, Hq, D] over the cache, the step's K/V already written -> [T, Hq * D]."""
        out = self.backend(q, self.k_cache, self.v_cache, meta, self.scale)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
