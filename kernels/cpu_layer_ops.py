"""A decoder layer's elementwise work on CPU as compiled C++ (cpu_layer_ops.cpp, built into the library
gguf_cpu.py compiles): the same three calls as fused_layer_ops.py's Triton kernels, for a CPU.

Why: a one-token step is short of arithmetic outside its matmuls, but eager torch dispatches each op
through Python and the dispatcher, a few microseconds apiece. A residual add and RMSNorm were ~10
dispatches (torch's CPU rms_norm is itself pow, mean, add, rsqrt and two muls), RoPE and the K/V
writes ~8: in a 24-layer draft step, milliseconds beside ~10 ms of weights streamed. Here each is one.

SiLU-mul stays two torch ops (`F.silu` then an in-place mul), torch's bits: fused, it would save one
dispatch a layer and need an exp for either sign (cpu_attention.cpp's is for x <= 0 only).

Results are torch's within rounding (tests/test_cpu_layer_ops.py): RMSNorm sums its squares with the
attention kernel's dot product (cpu_vec.h), so about a fifth of fp32 outputs differ from torch's by an
ulp; RoPE's are torch's bits by construction.
"""
import torch
import torch.nn.functional as F


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [T, N] -> (rms_norm(x + residual) * weight, x + residual); residual None: (rms_norm(x), x)."""
    if residual is None:  # the first layer's norm, once a step
        return F.rms_norm(x, (x.shape[-1],), weight, eps), x
    out, total = torch.ops.ssd_engine_gguf.add_rms_norm(x, residual, weight, eps)
    return out, total


def rope_cache_write(qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, slots: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, num_kv_heads: int,
                     q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                     eps: float = 0.0) -> torch.Tensor:
    """As fused_layer_ops.rope_cache_write: k and v written at their slots; -> rotated q [T, Hq, D]."""
    return torch.ops.ssd_engine_gguf.rope_cache_write(qkv, cos, sin_signed, slots, k_cache, v_cache, num_heads,
                                                      num_kv_heads, q_norm, k_norm, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2 N] (gate's columns, then up's) -> SiLU(gate) * up [T, N]: torch's bits."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)
