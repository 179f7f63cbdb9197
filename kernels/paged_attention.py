"""Triton paged attention's host side: one launch for prefill / decode / verification
(`paged_attention`) and SSD tree branches (`tree_attention`), each on the same kernel
(paged_attention_kernels.py); split-KV's key splits chosen per step shape and merged by a second
launch. K/V live in a paged cache flattened to slots [num_pages * page_size, Hk, D]."""

import torch

from ssd_engine.utils.launches import kernel_launch

try:
    import triton
except ImportError:  # CPU-only installs without triton: callers use the torch reference
    triton = None

if triton is not None:
    from ssd_engine.kernels.paged_attention_kernels import _merge_splits_kernel, _paged_attn_kernel


MAX_SPLITS = 16


def _num_splits(programs: int, device: torch.device) -> int:
    """Enough key splits for about two programs per SM, so a small decode fills the GPU. Depends
    on shapes only (CUDA graphs fix the grid)."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(MAX_SPLITS, triton.cdiv(2 * sms, programs)))


def block_config(
    group: int,
    max_query_len: int,
    head_dim: int,
    page_size: int,
    tree: bool,
    splits: int,
    fp32: bool,
    block_n: int = 32,
) -> dict:
    """The kernel's compile-time parameters for a step shape (also what `compile_check` builds)."""
    block_q = max(1, min(triton.next_power_of_2(max_query_len), max(1, 64 // group)))
    return dict(
        PAGE=page_size,
        GROUP=group,
        BLOCK_Q=block_q,
        BLOCK_M=max(16, triton.next_power_of_2(block_q * group)),
        BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        TREE=tree,
        PRECISION="ieee" if fp32 else "tf32",  # fp32 stays exact fp32 (no TF32)
        SPLITS=splits,
    )


def _launch(
    q,
    k_cache,
    v_cache,
    block_tables,
    kv_lens,
    query_start,
    max_query_len,
    page_size,
    scale,
    table_rows=None,
    path_slots=None,
    path_lens=None,
    block_n=32,
    splits=None,
):
    T, Hq, D = q.shape
    _, Hk, Dk = k_cache.shape
    assert Dk == D and v_cache.shape == k_cache.shape and Hq % Hk == 0, (
        q.shape,
        k_cache.shape,
        v_cache.shape,
    )
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    rows = kv_lens.shape[0]
    if T == 0 or rows == 0:
        return torch.empty_like(q)
    group = Hq // Hk
    tree = table_rows is not None
    config = block_config(
        group, max_query_len, D, page_size, tree, 1, q.dtype == torch.float32, block_n
    )
    q_blocks = triton.cdiv(max_query_len, config["BLOCK_Q"])
    config["SPLITS"] = splits = splits or _num_splits(rows * Hk * q_blocks, q.device)
    # one split writes the output directly; several write fp32 partials merged below
    out = torch.empty_like(q) if splits == 1 else torch.empty(splits, T, Hq, D, device=q.device)
    m = l = kv_lens  # never written with one split
    if splits > 1:
        m, l = (torch.empty(splits, T, Hq, device=q.device) for _ in range(2))
    dummy = kv_lens  # never read when TREE is off
    with kernel_launch(
        "paged_attention",
        q,
        k_cache,
        v_cache,
        out,
        m,
        l,
        block_tables,
        kv_lens,
        query_start,
        *((table_rows, path_slots, path_lens) if tree else ()),
    ):
        _paged_attn_kernel[(rows, Hk, q_blocks * splits)](
            q,
            k_cache,
            v_cache,
            out,
            m,
            l,
            block_tables,
            table_rows if tree else dummy,
            kv_lens,
            query_start,
            path_slots if tree else dummy,
            path_lens if tree else dummy,
            float(scale),
            D,
            T,
            Hq,
            q.stride(0),
            q.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            v_cache.stride(0),
            v_cache.stride(1),
            out.stride(0) if splits > 1 else 0,
            out.stride(-3),
            out.stride(-2),
            block_tables.stride(0),
            path_slots.stride(0) if tree else 0,
            **config,
        )
    if splits == 1:
        return out
    merged = torch.empty_like(q)
    with kernel_launch("merge_splits", out, m, l, merged):
        _merge_splits_kernel[(T, Hq)](
            out,
            m,
            l,
            merged,
            T,
            Hq,
            D,
            out.stride(0),
            out.stride(1),
            out.stride(2),
            merged.stride(0),
            merged.stride(1),
            SPLITS=splits,
            BLOCK_S=triton.next_power_of_2(splits),
            BLOCK_D=config["BLOCK_D"],
        )
    return merged


def paged_attention(
    q,
    k_cache,
    v_cache,
    block_tables,
    kv_lens,
    query_start,
    max_query_len: int,
    page_size: int,
    scale: float,
    splits: int | None = None,
):
    """q [T, Hq, D] (rows' queries concatenated); k_cache, v_cache [S, Hk, D] (pages flattened to
    slots, page p = slots p * page_size ...); block_tables [B, P] int32 pages per row; kv_lens [B] int32
    keys of row b (its new tokens' K/V already written); query_start [B + 1] int32. -> [T, Hq, D].
    Causal: query i of a row with qlen queries sees keys j < kv_len - qlen + i + 1."""
    return _launch(
        q,
        k_cache,
        v_cache,
        block_tables,
        kv_lens,
        query_start,
        max_query_len,
        page_size,
        scale,
        splits=splits,
    )


def tree_attention(
    q,
    k_cache,
    v_cache,
    block_tables,
    table_rows,
    kv_lens,
    path_slots,
    path_lens,
    page_size: int,
    scale: float,
    query_start=None,
    splits: int | None = None,
):
    """One query per branch row r (never seeing a sibling's path): q [R, Hq, D]; block_tables [S, P]
    trunk pages per sequence; table_rows [R] int32 the sequence of each branch; kv_lens [R] int32
    trunk keys it sees (its fork point); path_slots [R, K] its own path's slots, of which the first
    `path_lens[r]` (int32) are visible; query_start: arange(R + 1) int32, passed in when it must be
    a static buffer (CUDA graphs). -> [R, Hq, D]."""
    if query_start is None:
        query_start = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return _launch(
        q,
        k_cache,
        v_cache,
        block_tables,
        kv_lens,
        query_start,
        1,
        page_size,
        scale,
        table_rows=table_rows,
        path_slots=path_slots,
        path_lens=path_lens,
        splits=splits,
    )
