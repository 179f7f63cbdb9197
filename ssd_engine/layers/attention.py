"""Paged attention through one backend interface.

The torch reference backend reads K/V through per-sequence slot tables (block tables expanded
to token slots) and takes an explicit boolean mask, so the same code serves prefill (causal over
cached prefix + new tokens), decode, verification of K+1 tokens, and tree attention (any mask).
It runs on CPU and CUDA; a faster backend only has to honour the same AttentionMetadata. On CUDA,
steps with one query per row (decode, SSD tree branches) use the Triton kernel in
`kernels/tree_attention.py` when triton is installed (SSD_ENGINE_TRITON=0 keeps the reference).
"""
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor     # [T] cache slot each new token's K/V is written to
    gather_slots: torch.Tensor     # [B, L] cache slots of each sequence's context (padded)
    token_to_padded: torch.Tensor  # [T] index of each new token in the padded [B * Lq] query grid
    mask: torch.Tensor             # [B, Lq, L] True where query may attend key
    max_query_len: int


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        # bound by the model runner to this layer's slice of the paged cache: [num_slots, Hk, D]
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hk, D] -> [T, Hq * D]."""
        self.k_cache[meta.slot_mapping] = k
        self.v_cache[meta.slot_mapping] = v
        if meta.max_query_len == 1 and q.is_cuda and _triton_kernel() is not None:
            out = _triton_kernel()(q, self.k_cache, self.v_cache, meta.gather_slots, meta.mask[:, 0], self.scale)
            return out.reshape(q.shape[0], self.num_heads * self.head_dim)
        batch, lq = meta.mask.shape[0], meta.max_query_len
        keys = self.k_cache[meta.gather_slots].transpose(1, 2)    # [B, Hk, L, D]
        values = self.v_cache[meta.gather_slots].transpose(1, 2)
        padded = q.new_zeros(batch * lq, self.num_heads, self.head_dim)
        padded[meta.token_to_padded] = q
        queries = padded.view(batch, lq, self.num_heads, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=meta.mask.unsqueeze(1),
                                             scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads)
        out = out.transpose(1, 2).reshape(batch * lq, self.num_heads * self.head_dim)
        return out[meta.token_to_padded]


_KERNEL: list = []


def _triton_kernel():
    """The Triton masked-gather decode kernel, or None (no triton, or disabled)."""
    if not _KERNEL:
        kernel = None
        if os.environ.get("SSD_ENGINE_TRITON", "1") != "0":
            try:
                from kernels.tree_attention import masked_gather_attention, triton
                kernel = masked_gather_attention if triton is not None else None
            except ImportError:
                pass
        _KERNEL.append(kernel)
    return _KERNEL[0]
