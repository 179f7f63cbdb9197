"""Triton kernels for a decoder layer's elementwise work (add_rms_norm, rope_cache_write, silu_mul):
one launch where eager torch runs several. Each computes in fp32 and rounds where the torch ops
round, so results stay within rounding of the torch path. Runs on CUDA, or on CPU under
TRITON_INTERPRET=1."""

import torch

from ssd_engine.utils.launches import kernel_launch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs without triton: the layers keep the torch ops
    triton = None

if triton is not None:

    @triton.jit
    def _add_rms_norm_kernel(
        x_ptr,
        res_ptr,
        w_ptr,
        out_ptr,
        sum_ptr,
        N,
        eps,
        sx,
        sr,
        so,
        ss,
        HAS_RESIDUAL: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < N
        x = tl.load(x_ptr + row * sx + cols, mask=ok, other=0.0)
        if HAS_RESIDUAL:
            x = x.to(tl.float32) + tl.load(res_ptr + row * sr + cols, mask=ok, other=0.0).to(
                tl.float32
            )
            x = x.to(sum_ptr.dtype.element_ty)
            tl.store(sum_ptr + row * ss + cols, x, mask=ok)
        x = x.to(tl.float32)
        scale = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * so + cols, (x * scale * w).to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _rope_cache_write_kernel(
        qkv_ptr,
        cos_ptr,
        sin_ptr,
        slot_ptr,
        q_out_ptr,
        k_cache_ptr,
        v_cache_ptr,
        qn_ptr,
        kn_ptr,
        s_qkv,
        s_rope,
        s_qo_t,
        s_qo_h,
        s_kc,
        s_kh,
        s_vc,
        s_vh,
        HQ,
        HK,
        D,
        eps,
        QK_NORM: tl.constexpr,
        HALF: tl.constexpr,
    ):
        token = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        half = D // 2
        offs = tl.arange(0, HALF)
        ok = offs < half
        src = qkv_ptr + token * s_qkv + head * D
        x1 = tl.load(src + offs, mask=ok, other=0.0)
        x2 = tl.load(src + half + offs, mask=ok, other=0.0)
        slot = tl.load(slot_ptr + token).to(tl.int64)
        if head >= HQ + HK:  # a v head: copied into the cache as it is
            v_dst = v_cache_ptr + slot * s_vc + (head - HQ - HK) * s_vh
            tl.store(v_dst + offs, x1.to(v_cache_ptr.dtype.element_ty), mask=ok)
            tl.store(v_dst + half + offs, x2.to(v_cache_ptr.dtype.element_ty), mask=ok)
        else:
            dtype = x1.dtype
            a, b = x1.to(tl.float32), x2.to(tl.float32)
            # Qwen3: each q / k head RMS-normed, then rounded as the torch op's output is
            if QK_NORM:
                is_q = head < HQ
                w1 = tl.where(
                    is_q,
                    tl.load(qn_ptr + offs, mask=ok, other=0.0),
                    tl.load(kn_ptr + offs, mask=ok, other=0.0),
                )
                w2 = tl.where(
                    is_q,
                    tl.load(qn_ptr + half + offs, mask=ok, other=0.0),
                    tl.load(kn_ptr + half + offs, mask=ok, other=0.0),
                )
                scale = 1.0 / tl.sqrt((tl.sum(a * a, axis=0) + tl.sum(b * b, axis=0)) / D + eps)
                a = (a * scale * w1.to(tl.float32)).to(dtype).to(tl.float32)
                b = (b * scale * w2.to(tl.float32)).to(dtype).to(tl.float32)
            # x * cos + (x's halves swapped) * sin_signed: the rotate-half sign is in the table
            rope = token * s_rope
            cos1 = tl.load(cos_ptr + rope + offs, mask=ok, other=0.0).to(tl.float32)
            cos2 = tl.load(cos_ptr + rope + half + offs, mask=ok, other=0.0).to(tl.float32)
            sin1 = tl.load(sin_ptr + rope + offs, mask=ok, other=0.0).to(tl.float32)
            sin2 = tl.load(sin_ptr + rope + half + offs, mask=ok, other=0.0).to(tl.float32)
            out1 = a * cos1 + b * sin1
            out2 = b * cos2 + a * sin2
            if head < HQ:
                dst = q_out_ptr + token * s_qo_t + head * s_qo_h
                tl.store(dst + offs, out1.to(q_out_ptr.dtype.element_ty), mask=ok)
                tl.store(dst + half + offs, out2.to(q_out_ptr.dtype.element_ty), mask=ok)
            else:
                dst = k_cache_ptr + slot * s_kc + (head - HQ) * s_kh
                tl.store(dst + offs, out1.to(k_cache_ptr.dtype.element_ty), mask=ok)
                tl.store(dst + half + offs, out2.to(k_cache_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, N, s_gu, s_out, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < N
        gate = tl.load(gu_ptr + row * s_gu + cols, mask=ok, other=0.0)
        up = tl.load(gu_ptr + row * s_gu + N + cols, mask=ok, other=0.0).to(tl.float32)
        g = gate.to(tl.float32)
        # rounded as F.silu's output is
        silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
        tl.store(out_ptr + row * s_out + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=ok)


SILU_BLOCK = 1024


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [T, N] -> (rms_norm(x + residual) * weight, x + residual); residual None: (rms_norm(x), x)."""
    rows, n = x.shape
    assert x.stride(-1) == 1 and (residual is None or residual.stride(-1) == 1)
    out = torch.empty_like(x)
    total = x if residual is None else torch.empty_like(x)
    if rows:
        with kernel_launch(
            "add_rms_norm", x, weight, out, total, *(() if residual is None else (residual,))
        ):
            _add_rms_norm_kernel[(rows,)](
                x,
                x if residual is None else residual,
                weight,
                out,
                total,
                n,
                float(eps),
                x.stride(0),
                0 if residual is None else residual.stride(0),
                out.stride(0),
                total.stride(0),
                HAS_RESIDUAL=residual is not None,
                BLOCK=triton.next_power_of_2(n),
            )
    return out, total


def rope_cache_write(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin_signed: torch.Tensor,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 0.0,
) -> torch.Tensor:
    """qkv [T, (Hq + 2 Hk) * D] (q's heads, k's, v's); cos, sin_signed rows [T, (1,) D]
    (layers/rotary.py's tables); slots [T] the cache slot of each token; k_cache, v_cache [S, Hk, D].
    Writes rotated k and v at the slots; -> rotated q [T, Hq, D]."""
    tokens, head_dim = qkv.shape[0], k_cache.shape[-1]
    assert qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim and qkv.stride(-1) == 1
    assert cos.stride(-1) == 1 and sin_signed.stride(0) == cos.stride(0) and k_cache.stride(-1) == 1
    q = torch.empty(tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if tokens:
        with kernel_launch(
            "rope_cache_write",
            qkv,
            cos,
            sin_signed,
            slots,
            q,
            k_cache,
            v_cache,
            *(n for n in (q_norm, k_norm) if n is not None),
        ):
            _rope_cache_write_kernel[(tokens, num_heads + 2 * num_kv_heads)](
                qkv,
                cos,
                sin_signed,
                slots,
                q,
                k_cache,
                v_cache,
                q_norm if q_norm is not None else cos,
                k_norm if k_norm is not None else cos,
                qkv.stride(0),
                cos.stride(0),
                q.stride(0),
                q.stride(1),
                k_cache.stride(0),
                k_cache.stride(1),
                v_cache.stride(0),
                v_cache.stride(1),
                num_heads,
                num_kv_heads,
                head_dim,
                float(eps),
                QK_NORM=q_norm is not None,
                HALF=triton.next_power_of_2(head_dim // 2),
            )
    return q


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2 N] (gate's columns, then up's) -> SiLU(gate) * up [T, N]."""
    tokens, n = gate_up.shape[0], gate_up.shape[1] // 2
    assert gate_up.stride(-1) == 1
    out = torch.empty(tokens, n, dtype=gate_up.dtype, device=gate_up.device)
    if tokens:
        with kernel_launch("silu_mul", gate_up, out):
            _silu_mul_kernel[(tokens, triton.cdiv(n, SILU_BLOCK))](
                gate_up, out, n, gate_up.stride(0), out.stride(0), BLOCK=SILU_BLOCK
            )
    return out
