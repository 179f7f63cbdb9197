"""Paged attention through one backend interface.

The torch reference backend reads K/V through per-sequence slot tables (block tables expanded
to token slots) and takes an explicit boolean mask, so the same code serves prefill (causal over
cached prefix + new tokens), decode, verification of K+1 tokens, and tree attention (any mask).
It runs on CPU and CUDA; a faster backend only has to honour the same AttentionMetadata.
"""
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
