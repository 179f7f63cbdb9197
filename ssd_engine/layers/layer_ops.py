"""Which implementation runs a decoder layer's elementwise work (add + RMSNorm, RoPE + K/V write,
SiLU-mul): torch ops (None), Triton kernels on a GPU, or C++ ops on a CPU. None when the forward
is compiled, since inductor fuses the same ops."""

from typing import Protocol

import torch

from ssd_engine.layers.attention_backends import _interpreting, triton_available


class LayerOps(Protocol):
    """What kernels/fused_layer_ops.py and kernels/cpu_layer_ops.py each provide."""

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def rope_cache_write(
        self,
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
    ) -> torch.Tensor: ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...


def select_layer_ops(mode: str, device: torch.device, compiled: bool) -> LayerOps | None:
    """The ops module the layers call, or None for torch's ops."""
    if mode == "off":
        return None
    if compiled:
        if mode == "on":
            raise ValueError(
                "fused_kernels='on' and compile_model='on' are two ways to fuse a layer's ops: choose one"
            )
        return None
    if device.type == "cuda" or (mode == "on" and _interpreting()):
        if triton_available():
            from ssd_engine.kernels import fused_layer_ops

            return fused_layer_ops
        if mode == "on":
            raise ValueError("fused_kernels='on' needs the triton package (pip install triton)")
        return None
    from ssd_engine.kernels import cpu_layer_ops, gguf_cpu

    try:
        gguf_cpu.load()
    except gguf_cpu.KernelUnavailable as error:
        if mode == "on":
            raise ValueError(
                f"fused_kernels='on' on CPU needs the compiled CPU kernels ({error})"
            ) from None
        return None
    return cpu_layer_ops
