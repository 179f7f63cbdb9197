"""Triton paged attention's kernels: one for prefill / decode / verification and SSD tree branches
(the mask generated in the kernel), and split-KV's merge. A program takes one row, one KV head and
BLOCK_Q queries, the GROUP query heads stacked into M so each K/V tile is read once for all
(`tl.dot` needs M, N, D >= 16, hence the padding). Launched by paged_attention.py."""

try:
    import triton
    import triton.language as tl
# CPU-only installs without triton: no kernels (callers use the torch reference)
except ImportError:
    triton = None

if triton is not None:

    @triton.jit
    def _paged_attn_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        out_ptr,
        m_ptr,
        l_ptr,
        table_ptr,
        table_row_ptr,
        kv_len_ptr,
        q_start_ptr,
        path_ptr,
        path_len_ptr,
        scale,
        D,
        T,
        HQ,
        sq_t,
        sq_h,
        sk_s,
        sk_h,
        sv_s,
        sv_h,
        so_s,
        so_t,
        so_h,
        st_b,
        sp_r,
        PAGE: tl.constexpr,
        GROUP: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        TREE: tl.constexpr,
        PRECISION: tl.constexpr,
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
        q = tl.load(
            q_ptr + tok[:, None] * sq_t + head[:, None] * sq_h + offs_d[None, :],
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        limit = kv_len - q_len + q_idx + 1  # causal: keys j < limit per query
        last_q = tl.minimum(q_len, (q_block + 1) * BLOCK_Q)
        kv_end = tl.where(q_block * BLOCK_Q < q_len, kv_len - q_len + last_q, 0)
        # split-KV: this program takes one of SPLITS equal tile-aligned spans of the keys
        chunk = tl.cdiv(tl.cdiv(kv_end, SPLITS), BLOCK_N) * BLOCK_N
        kv_lo = split * chunk
        kv_hi = tl.minimum(kv_end, kv_lo + chunk)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max
        l_i = tl.zeros([BLOCK_M], tl.float32)  # running softmax denominator
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for start in range(kv_lo, kv_hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            n_ok = offs_n < kv_hi
            page = tl.load(table_ptr + table_row * st_b + offs_n // PAGE, mask=n_ok, other=0).to(
                tl.int64
            )
            slot = page * PAGE + offs_n % PAGE
            visible = row_ok[:, None] & (offs_n[None, :] < limit[:, None])
            m_i, l_i, acc = _attend(
                q,
                k_ptr,
                v_ptr,
                slot,
                n_ok,
                visible,
                offs_d,
                d_ok,
                sk_s,
                sk_h,
                sv_s,
                sv_h,
                kvh,
                scale,
                m_i,
                l_i,
                acc,
                PRECISION,
            )
        if TREE:  # the branch's own path: scratch slots 0 .. path_len - 1
            # one split reads it
            path_len = tl.where(split == SPLITS - 1, tl.load(path_len_ptr + row), 0)
            for start in range(0, path_len, BLOCK_N):
                offs_n = start + tl.arange(0, BLOCK_N)
                n_ok = offs_n < path_len
                slot = tl.load(path_ptr + row.to(tl.int64) * sp_r + offs_n, mask=n_ok, other=0).to(
                    tl.int64
                )
                visible = row_ok[:, None] & n_ok[None, :]
                m_i, l_i, acc = _attend(
                    q,
                    k_ptr,
                    v_ptr,
                    slot,
                    n_ok,
                    visible,
                    offs_d,
                    d_ok,
                    sk_s,
                    sk_h,
                    sv_s,
                    sv_h,
                    kvh,
                    scale,
                    m_i,
                    l_i,
                    acc,
                    PRECISION,
                )

        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + split * so_s + tok[:, None] * so_t + head[:, None] * so_h + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )
        if SPLITS > 1:  # each split's running max and denominator, for the merge
            stat = (split * T + tok) * HQ + head
            tl.store(m_ptr + stat, m_i, mask=row_ok)
            tl.store(l_ptr + stat, l_i, mask=row_ok)

    @triton.jit
    def _attend(
        q,
        k_ptr,
        v_ptr,
        slot,
        n_ok,
        visible,
        offs_d,
        d_ok,
        sk_s,
        sk_h,
        sv_s,
        sv_h,
        kvh,
        scale,
        m_i,
        l_i,
        acc,
        PRECISION: tl.constexpr,
    ):
        """One tile of keys: online-softmax update of (max, denominator, accumulator)."""
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(
            k_ptr + slot[:, None] * sk_s + kvh * sk_h + offs_d[None, :], mask=kv_mask, other=0.0
        )
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # rows with nothing visible yet: no NaN
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        v = tl.load(
            v_ptr + slot[:, None] * sv_s + kvh * sv_h + offs_d[None, :], mask=kv_mask, other=0.0
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        return m_new, alpha * l_i + tl.sum(p, axis=1), acc

    @triton.jit
    def _merge_splits_kernel(
        part_ptr,
        m_ptr,
        l_ptr,
        out_ptr,
        T,
        HQ,
        D,
        sp_s,
        sp_t,
        sp_h,
        so_t,
        so_h,
        SPLITS: tl.constexpr,
        BLOCK_S: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
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
        part = tl.load(
            part_ptr + offs_s[:, None] * sp_s + tok * sp_t + head * sp_h + offs_d[None, :],
            mask=s_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        merged = tl.sum(part * weight[:, None], axis=0) / tl.where(total > 0, total, 1.0)
        tl.store(
            out_ptr + tok * so_t + head * so_h + offs_d,
            merged.to(out_ptr.dtype.element_ty),
            mask=d_ok,
        )
