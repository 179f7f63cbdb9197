"""One decoder-only transformer covering Llama, Qwen2 and Qwen3.

The three differ only in switches read from the Hugging Face config: bias on q/k/v (Qwen2,
Llama's `attention_bias`), per-head RMSNorm on q and k (Qwen3), MLP bias (Llama's `mlp_bias`),
rope scaling (handled by transformers' rope init) and tied embeddings. Parameter names follow
the Hugging Face checkpoints; fused projections map their HF tensors through `stacked_params`.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ssd_engine.layers.attention import Attention, AttentionMetadata
from ssd_engine.layers.linear import Linear
from ssd_engine.layers.norm import RMSNorm
from ssd_engine.layers.rotary import RotaryEmbedding


@dataclass(frozen=True)
class ArchSwitches:
    qkv_bias: bool
    qk_norm: bool
    mlp_bias: bool


class DecoderAttention(nn.Module):
    def __init__(self, config, switches: ArchSwitches, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, q_size + 2 * kv_size, bias=switches.qkv_bias,
                               shard_sizes={"q": q_size, "k": kv_size, "v": kv_size})
        self.o_proj = Linear(q_size, config.hidden_size, bias=getattr(config, "attention_bias", False))
        self.split = (q_size, kv_size, kv_size)
        if switches.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = switches.qk_norm
        self.rotary = rotary
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v, meta))


class DecoderMLP(nn.Module):
    def __init__(self, config, switches: ArchSwitches) -> None:
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * inter, bias=switches.mlp_bias,
                                   shard_sizes={"gate": inter, "up": inter})
        self.down_proj = Linear(inter, config.hidden_size, bias=switches.mlp_bias)
        self.inter = inter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config, switches: ArchSwitches, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(config, switches, rotary)
        self.mlp = DecoderMLP(config, switches)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, x, meta):
        x = x + self.self_attn(positions, self.input_layernorm(x), meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, config, switches: ArchSwitches, max_position: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        rotary = RotaryEmbedding(config, max_position)
        self.layers = nn.ModuleList(DecoderLayer(config, switches, rotary) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, positions, meta):
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(positions, x, meta)
        return self.norm(x)


class DecoderForCausalLM(nn.Module):
    switches: ArchSwitches  # set by each architecture's subclass

    # HF tensor name fragment -> (our fused module fragment, shard id)
    stacked_params = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up"),
    }

    def __init__(self, config, max_position: int) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, self.switches, max_position)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, positions, meta) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
