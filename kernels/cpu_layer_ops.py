"""fused_layer_ops.py's calls on CPU as compiled C++ (cpu_layer_ops.cpp, built by gguf_cpu.py): one
dispatch each where eager torch dispatches several. SiLU-mul stays torch's two ops and RoPE gives
torch's bits; RMSNorm sums squares as cpu_vec.h's dot product, so it may differ by an ulp."""

import torch
import torch.nn.functional as F


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [T, N] -> (rms_norm(x + residual) * weight, x + residual); residual None: (rms_norm(x), x)."""
    if residual is None:  # the first layer's norm, once a step
        return F.rms_norm(x, (x.shape[-1],), weight, eps), x
    out, total = torch.ops.ssd_engine_gguf.add_rms_norm(x, residual, weight, eps)
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
    """As fused_layer_ops.rope_cache_write: k and v written at their slots; -> rotated q [T, Hq, D]."""
    return torch.ops.ssd_engine_gguf.rope_cache_write(
        qkv, cos, sin_signed, slots, k_cache, v_cache, num_heads, num_kv_heads, q_norm, k_norm, eps
    )


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2 N] (gate's columns, then up's) -> SiLU(gate) * up [T, N]: torch's bits."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)
