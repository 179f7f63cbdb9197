"""Rotary position embedding.

The inverse frequencies come from transformers' own ROPE_INIT_FUNCTIONS so every scaling
variant (llama3, linear, yarn, ...) matches the reference implementation by construction.
cos/sin are precomputed for all positions up to max_position so decode just indexes them.
"""
import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


def _inv_freq(config) -> tuple[torch.Tensor, float]:
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim)), 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS or rope_type in ("dynamic", "longrope"):
        # dynamic/longrope change frequencies with sequence length; the static table below can't express that
        raise ValueError(f"unsupported rope_type {rope_type!r}")
    return ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")


class RotaryEmbedding(nn.Module):
    def __init__(self, config, max_position: int) -> None:
        super().__init__()
        inv_freq, scaling = _inv_freq(config)
        # tables are computed on CPU so every device gets bit-identical values, then moved to the
        # device the model is being built on
        inv_freq = inv_freq.cpu()
        freqs = torch.arange(max_position, dtype=torch.float, device="cpu")[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        device = torch.empty(0).device
        self.register_buffer("cos", (emb.cos() * scaling).to(device), persistent=False)
        self.register_buffer("sin", (emb.sin() * scaling).to(device), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, Hq, D], k: [T, Hk, D], positions: [T]."""
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
