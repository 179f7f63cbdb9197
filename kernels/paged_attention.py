"""Triton paged attention, one kernel for prefill / decode / verification and SSD tree branches. K/V
live in a paged cache flattened to slots [num_pages * page_size, Hk, D]; the mask is generated in
the kernel. A program takes one row, one KV head and BLOCK_Q queries, the GROUP query heads stacked
into M so each K/V tile is read once for all (`tl.dot` needs M, N, D >= 16, hence the padding)."""
import torch

from ssd_engine.utils.launches import kernel_launch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs without triton: callers use the torch reference
    triton = None

if triton is not None:

    @triton.jit
    def _paged_attn_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, m_ptr, l_ptr,
        table_ptr, table_row_ptr, kv_len_ptr, q_start_ptr, path_ptr,
        path_len_ptr, scale, D, T, HQ,
        sq_t, sq_h, sk_s, sk_h, sv_s, sv_h, so_s, so_t, so_h, st_b, sp_r,
        PAGE: tl.constexpr, GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TREE: tl.constexpr, PRECISION: tl.constexpr,
        SPLITS: tl.constexpr,
    ):
        row = tl.program_id(0)
        kvh = tl.program_id(1)
        q_block = tl.program_id(2) // SPLITS
        split = tl.program_id(2) % SPLITS
        q_first = tl.load(q_start_ptr + row)
        q_len = tl.load(q_start_ptr + row + 1) - q_first
        kv_len = tl.load(kv_len_ptr + row)
        if TREE:
            table_row = tl.load(table_row_ptr + row).to(tl.int64)
        else:
            table_row = row.to(tl.int64)

        offs_m = tl.arange(0, BLOCK_M)
        q_idx = q_block * BLOCK_Q + offs_m // GROUP
        head = kvh * GROUP + offs_m % GROUP
        row_ok = (offs_m < BLOCK_Q * GROUP) & (q_idx < q_len)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        tok = (q_first + q_idx).to(tl.int64)
        q = tl.load(q_ptr + tok[:, None] * sq_t + head[:, None] * sq_h + offs_d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        limit = kv_len - q_len + q_idx + 1                      # causal: keys j < limit per query
        last_q = tl.minimum(q_len, (q_block + 1) * BLOCK_Q)
        kv_end = tl.where(q_block * BLOCK_Q < q_len, kv_len - q_len + last_q, 0)
        # split-KV: this program takes one of SPLITS equal tile-aligned spans of the keys
        chunk = tl.cdiv(tl.cdiv(kv_end, SPLITS), BLOCK_N) * BLOCK_N
        kv_lo = split * chunk
        kv_hi = tl.minimum(kv_end, kv_lo + chunk)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)   # running max
        l_i = tl.zeros([BLOCK_M], tl.float32)                  # running softmax denominator
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for start in range(kv_lo, kv_hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            n_ok = offs_n < kv_hi
            page = tl.load(table_ptr + table_row * st_b + offs_n // PAGE, mask=n_ok, other=0).to(tl.int64)
            slot = page * PAGE + offs_n % PAGE
            visible = row_ok[:, None] & (offs_n[None, :] < limit[:, None])
            m_i, l_i, acc = _attend(q, k_ptr, v_ptr, slot, n_ok, visible, offs_d, d_ok, sk_s, sk_h, sv_s, sv_h,
                                    kvh, scale, m_i, l_i, acc, PRECISION)
        if TREE:  # the branch's own path: scratch slots 0 .. path_len - 1
            path_len = tl.where(split == SPLITS - 1, tl.load(path_len_ptr + row), 0)  # one split reads it
            for start in range(0, path_len, BLOCK_N):
                offs_n = start + tl.arange(0, BLOCK_N)
                n_ok = offs_n < path_len
                slot = tl.load(path_ptr + row.to(tl.int64) * sp_r + offs_n, mask=n_ok, other=0).to(tl.int64)
                visible = row_ok[:, None] & n_ok[None, :]
                m_i, l_i, acc = _attend(q, k_ptr, v_ptr, slot, n_ok, visible, offs_d, d_ok, sk_s, sk_h, sv_s, sv_h,
                                        kvh, scale, m_i, l_i, acc, PRECISION)

        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + split * so_s + tok[:, None] * so_t + head[:, None] * so_h + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        if SPLITS > 1:  # each split's running max and denominator, for the merge
            stat = (split * T + tok) * HQ + head
            tl.store(m_ptr + stat, m_i, mask=row_ok)
            tl.store(l_ptr + stat, l_i, mask=row_ok)

    @triton.jit
    def _attend(q, k_ptr, v_ptr, slot, n_ok, visible, offs_d, d_ok, sk_s, sk_h, sv_s, sv_h, kvh, scale,
                m_i, l_i, acc, PRECISION: tl.constexpr):
        """One tile of keys: online-softmax update of (max, denominator, accumulator)."""
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + slot[:, None] * sk_s + kvh * sk_h + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet: no NaN
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        v = tl.load(v_ptr + slot[:, None] * sv_s + kvh * sv_h + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        return m_new, alpha * l_i + tl.sum(p, axis=1), acc

    @triton.jit
    def _merge_splits_kernel(part_ptr, m_ptr, l_ptr, out_ptr, T, HQ, D, sp_s, sp_t, sp_h, so_t, so_h,
                             SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
        """One (token, head): the splits' normalised outputs weighted by their shares of the softmax
        denominator (split-KV's second pass, in one launch)."""
        tok = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        offs_s = tl.arange(0, BLOCK_S)
        s_ok = offs_s < SPLITS
        stat = (offs_s * T + tok) * HQ + head
        m = tl.load(m_ptr + stat, mask=s_ok, other=float("-inf"))
        l = tl.load(l_ptr + stat, mask=s_ok, other=0.0)
        top = tl.max(m, axis=0)
        top = tl.where(top == float("-inf"), 0.0, top)  # every split empty: weights 0, output 0
        weight = tl.where(s_ok, l * tl.exp(m - top), 0.0)
        total = tl.sum(weight, axis=0)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        part = tl.load(part_ptr + offs_s[:, None] * sp_s + tok * sp_t + head * sp_h + offs_d[None, :],
                       mask=s_ok[:, None] & d_ok[None, :], other=0.0)
        merged = tl.sum(part * weight[:, None], axis=0) / tl.where(total > 0, total, 1.0)
        tl.store(out_ptr + tok * so_t + head * so_h + offs_d, merged.to(out_ptr.dtype.element_ty), mask=d_ok)


MAX_SPLITS = 16


def _num_splits(programs: int, device: torch.device) -> int:
    """Enough key splits for about two programs per SM, so a small decode fills the GPU. Depends
    on shapes only (CUDA graphs fix the grid)."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(MAX_SPLITS, triton.cdiv(2 * sms, programs)))


def block_config(group: int, max_query_len: int, head_dim: int, page_size: int, tree: bool, splits: int,
                 fp32: bool, block_n: int = 32) -> dict:
    """The kernel's compile-time parameters for a step shape (also what `compile_check` builds)."""
    block_q = max(1, min(triton.next_power_of_2(max_query_len), max(1, 64 // group)))
    return dict(PAGE=page_size, GROUP=group, BLOCK_Q=block_q, BLOCK_M=max(16, triton.next_power_of_2(block_q * group)),
                BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(head_dim)), TREE=tree,
                PRECISION="ieee" if fp32 else "tf32",  # fp32 stays exact fp32 (no TF32)
                SPLITS=splits)


def _launch(q, k_cache, v_cache, block_tables, kv_lens, query_start, max_query_len, page_size, scale,
            table_rows=None, path_slots=None, path_lens=None, block_n=32, splits=None):
    T, Hq, D = q.shape
    _, Hk, Dk = k_cache.shape
    assert Dk == D and v_cache.shape == k_cache.shape and Hq % Hk == 0, (q.shape, k_cache.shape, v_cache.shape)
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    rows = kv_lens.shape[0]
    if T == 0 or rows == 0:
        return torch.empty_like(q)
    group = Hq // Hk
    tree = table_rows is not None
    config = block_config(group, max_query_len, D, page_size, tree, 1, q.dtype == torch.float32, block_n)
    q_blocks = triton.cdiv(max_query_len, config["BLOCK_Q"])
    config["SPLITS"] = splits = splits or _num_splits(rows * Hk * q_blocks, q.device)
    # one split writes the output directly; several write fp32 partials merged below
    out = torch.empty_like(q) if splits == 1 else torch.empty(splits, T, Hq, D, device=q.device)
    m = l = kv_lens  # never written with one split
    if splits > 1:
        m, l = (torch.empty(splits, T, Hq, device=q.device) for _ in range(2))
    dummy = kv_lens  # never read when TREE is off
    with kernel_launch("paged_attention", q, k_cache, v_cache, out, m, l, block_tables, kv_lens, query_start,
                       *((table_rows, path_slots, path_lens) if tree else ())):
        _paged_attn_kernel[(rows, Hk, q_blocks * splits)](
            q, k_cache, v_cache, out, m, l,
            block_tables, table_rows if tree else dummy, kv_lens, query_start, path_slots if tree else dummy,
            path_lens if tree else dummy, float(scale), D, T, Hq,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
            out.stride(0) if splits > 1 else 0, out.stride(-3), out.stride(-2), block_tables.stride(0),
            path_slots.stride(0) if tree else 0, **config,
        )
    if splits == 1:
        return out
    merged = torch.empty_like(q)
    with kernel_launch("merge_splits", out, m, l, merged):
        _merge_splits_kernel[(T, Hq)](out, m, l, merged, T, Hq, D, out.stride(0), out.stride(1), out.stride(2),
                                      merged.stride(0), merged.stride(1), SPLITS=splits,
                                      BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=config["BLOCK_D"])
    return merged


def paged_attention(q, k_cache, v_cache, block_tables, kv_lens, query_start, max_query_len: int,
                    page_size: int, scale: float, splits: int | None = None):
    """q [T, Hq, D] (rows' queries concatenated); k_cache, v_cache [S, Hk, D] (pages flattened to
    slots, page p = slots p * page_size ...); block_tables [B, P] int32 pages per row; kv_lens [B] int32
    keys of row b (its new tokens' K/V already written); query_start [B + 1] int32. -> [T, Hq, D].
    Causal: query i of a row with qlen queries sees keys j < kv_len - qlen + i + 1."""
    return _launch(q, k_cache, v_cache, block_tables, kv_lens, query_start, max_query_len, page_size, scale,
                   splits=splits)


def tree_attention(q, k_cache, v_cache, block_tables, table_rows, kv_lens, path_slots, path_lens,
                   page_size: int, scale: float, query_start=None, splits: int | None = None):
    """One query per branch row r (never seeing a sibling's path): q [R, Hq, D]; block_tables [S, P]
    trunk pages per sequence; table_rows [R] int32 the sequence of each branch; kv_lens [R] int32
    trunk keys it sees (its fork point); path_slots [R, K] its own path's slots, of which the first
    `path_lens[r]` (int32) are visible; query_start: arange(R + 1) int32, passed in when it must be
    a static buffer (CUDA graphs). -> [R, Hq, D]."""
    if query_start is None:
        query_start = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return _launch(q, k_cache, v_cache, block_tables, kv_lens, query_start, 1, page_size, scale,
                   table_rows=table_rows, path_slots=path_slots, path_lens=path_lens, splits=splits)
