"""Rotary position embedding. Scaled variants take transformers' ROPE_INIT_FUNCTIONS (matching the
reference by construction); the default is computed here so child processes skip transformers."""

import torch
from torch import nn

from ssd_engine.layers.shapes import head_dim, transformers_config


def _inv_freq(config) -> tuple[torch.Tensor, float]:
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        dim = head_dim(config)
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS or rope_type in ("dynamic", "longrope"):
        # dynamic/longrope change frequencies with sequence length: a static table can't hold that
        raise ValueError(f"unsupported rope_type {rope_type!r}")
    return ROPE_INIT_FUNCTIONS[rope_type](transformers_config(config), "cpu")


class RotaryEmbedding(nn.Module):
    def __init__(self, config, max_position: int) -> None:
        super().__init__()
        inv_freq, scaling = _inv_freq(config)
        # computed on CPU so every device gets bit-identical tables
        inv_freq = inv_freq.cpu()
        freqs = (
            torch.arange(max_position, dtype=torch.float, device="cpu")[:, None] * inv_freq[None, :]
        )
        emb = torch.cat((freqs, freqs), dim=-1)
        half = emb.shape[-1] // 2
        sin = emb.sin() * scaling
        # the rotate-half sign folded into the table: bit-exact, as a sign flip is exact
        sin[:, :half] = -sin[:, :half]
        device = torch.empty(0).device
        self.register_buffer(
            "cos_sin", torch.stack([emb.cos() * scaling, sin], dim=1).to(device), persistent=False
        )

    def tables(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin_signed) rows of `positions` as [T, 1, D] views in `dtype`."""
        rows = self.cos_sin[positions]
        if rows.dtype != dtype:
            rows = rows.to(dtype)
        return rows[:, :1], rows[:, 1:]


def rotate(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x: [T, H, D] rotated by its positions' tables (RotaryEmbedding.tables)."""
    cos, sin_signed = tables
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed
