"""Decode-shaped paged attention with an explicit key mask (Triton), plus its torch reference.

Why a separate kernel: in SSD tree-branch decoding every tree branch is one query row, and plain
decode is the same shape (one query per sequence). Keys are reached through a slot table into the
paged KV cache (flattened to [S, Hk, D]), and each row carries an explicit boolean mask, so a branch
sees only its trunk prefix and its own path (not its siblings) even though all branches share the
cache. Slots of masked-out keys are never read, so they may hold padding such as -1.

`masked_gather_attention` runs the Triton kernel on CUDA tensors (or on CPU under
TRITON_INTERPRET=1, decided when this module is imported); otherwise it falls back to
`reference_masked_gather_attention`.
"""
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs without triton use the reference
    triton = None

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")

if triton is not None:

    @triton.jit
    def _masked_gather_attn_kernel(
        q_ptr, k_ptr, v_ptr, slot_ptr, mask_ptr, out_ptr,
        L, D, scale,
        sq_b, sq_h, sq_d,
        sk_s, sk_h, sk_d,
        sv_s, sv_h, sv_d,
        ss_b, ss_l, sm_b, sm_l,
        so_b, so_h, so_d,
        GROUP: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        kvh = h // GROUP
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        q = tl.load(q_ptr + b * sq_b + h * sq_h + offs_d * sq_d, mask=d_ok, other=0.0).to(tl.float32)
        m_i = tl.full([], float("-inf"), tl.float32)  # running max
        l_i = tl.full([], 0.0, tl.float32)  # running softmax denominator
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for start in range(0, L, BLOCK_L):
            offs_l = start + tl.arange(0, BLOCK_L)
            in_range = offs_l < L
            keep = tl.load(mask_ptr + b * sm_b + offs_l * sm_l, mask=in_range, other=0) != 0
            valid = in_range & keep
            slots = tl.load(slot_ptr + b * ss_b + offs_l * ss_l, mask=valid, other=0).to(tl.int64)
            kv_mask = valid[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + slots[:, None] * sk_s + kvh * sk_h + offs_d[None, :] * sk_d,
                        mask=kv_mask, other=0.0).to(tl.float32)
            s = tl.sum(k * q[None, :], axis=1) * scale
            s = tl.where(valid, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # fully masked so far: no NaN
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe)
            v = tl.load(v_ptr + slots[:, None] * sv_s + kvh * sv_h + offs_d[None, :] * sv_d,
                        mask=kv_mask, other=0.0).to(tl.float32)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
            m_i = m_new
        out = acc / l_i
        tl.store(out_ptr + b * so_b + h * so_h + offs_d * so_d,
                 out.to(out_ptr.dtype.element_ty), mask=d_ok)


def _check(q, k_cache, v_cache, gather_slots, mask):
    B, Hq, D = q.shape
    S, Hk, Dk = k_cache.shape
    assert v_cache.shape == k_cache.shape and Dk == D, (q.shape, k_cache.shape, v_cache.shape)
    assert Hq % Hk == 0, f"Hq={Hq} must be a multiple of Hk={Hk}"
    assert gather_slots.shape == mask.shape and gather_slots.shape[0] == B
    assert mask.dtype == torch.bool
    return B, Hq, Hk, D


def reference_masked_gather_attention(q, k_cache, v_cache, gather_slots, mask, scale):
    """Plain torch version (fp32 math): gather, mask, softmax, weighted sum. CPU fallback."""
    B, Hq, Hk, D = _check(q, k_cache, v_cache, gather_slots, mask)
    slots = gather_slots.long().masked_fill(~mask, 0)  # masked-out slots may be padding
    k = k_cache[slots].float().repeat_interleave(Hq // Hk, dim=2)  # [B, L, Hq, D]
    v = v_cache[slots].float().repeat_interleave(Hq // Hk, dim=2)
    scores = torch.einsum("bhd,blhd->bhl", q.float(), k) * scale
    scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    p = torch.softmax(scores, dim=-1)
    return torch.einsum("bhl,blhd->bhd", p, v).to(q.dtype)


def masked_gather_attention(q, k_cache, v_cache, gather_slots, mask, scale, block_l=64):
    """q [B, Hq, D] (one query per row); k_cache, v_cache [S, Hk, D] (a paged KV cache flattened to slots);
    gather_slots [B, L] int64: the cache slot of each of row b's L keys; mask [B, L] bool: which keys row b
    may attend to (at least one True per row); Hq is a multiple of Hk (GQA: query head h uses kv head
    h // (Hq // Hk)). Returns [B, Hq, D] = softmax(scale * q·k over masked keys) @ v, in q's dtype, fp32 accumulation."""
    B, Hq, Hk, D = _check(q, k_cache, v_cache, gather_slots, mask)
    if triton is None or not (q.is_cuda or _INTERPRET):
        return reference_masked_gather_attention(q, k_cache, v_cache, gather_slots, mask, scale)
    L = gather_slots.shape[1]
    out = torch.empty_like(q)
    if B == 0:
        return out
    m = mask.view(torch.uint8)  # same storage, byte pointer for the kernel
    _masked_gather_attn_kernel[(B, Hq)](
        q, k_cache, v_cache, gather_slots, m, out,
        L, D, float(scale),
        *q.stride(), *k_cache.stride(), *v_cache.stride(),
        *gather_slots.stride(), *m.stride(), *out.stride(),
        GROUP=Hq // Hk, BLOCK_L=block_l, BLOCK_D=triton.next_power_of_2(D),
    )
    return out
