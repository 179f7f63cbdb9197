"""One decoder-only transformer for Llama, Qwen2 and Qwen3, which differ only in `ArchSwitches`.

Parameter names follow the HF checkpoints (fused projections via `stacked_params`); under tensor
parallelism (`tp`) each layer is built as this rank's slice."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ssd_engine.distributed.comm import TPGroup
from ssd_engine.distributed.partition import (
    Span,
    attention_head_shards,
    even_spans,
    intermediate_spans,
)
from ssd_engine.layers.attention import Attention, AttentionMetadata
from ssd_engine.layers.embedding import VocabParallelEmbedding
from ssd_engine.layers.layer_ops import LayerOps
from ssd_engine.layers.linear import Linear
from ssd_engine.layers.norm import RMSNorm
from ssd_engine.layers.rotary import RotaryEmbedding, rotate
from ssd_engine.layers.shapes import head_dim

Rope = tuple[
    torch.Tensor, torch.Tensor
]  # one forward's (cos, sin_signed) rows: RotaryEmbedding.tables


@dataclass(frozen=True)
class ArchSwitches:
    qkv_bias: bool
    qk_norm: bool
    mlp_bias: bool


class DecoderAttention(nn.Module):
    def __init__(self, config, switches: ArchSwitches, tp: TPGroup) -> None:
        super().__init__()
        heads = attention_head_shards(
            config.num_attention_heads, config.num_key_value_heads, tp.size
        )[tp.rank]
        self.num_heads, self.num_kv_heads = heads.q.size, heads.kv.size
        self.head_dim = head_dim(config)
        q_rows, kv_rows = heads.q.scaled(self.head_dim), heads.kv.scaled(self.head_dim)
        total_q = config.num_attention_heads * self.head_dim
        total_kv = config.num_key_value_heads * self.head_dim
        self.qkv_proj = Linear(
            config.hidden_size,
            total_q + 2 * total_kv,
            bias=switches.qkv_bias,
            shards={"q": q_rows, "k": kv_rows, "v": kv_rows},
        )
        self.o_proj = Linear(
            total_q,
            config.hidden_size,
            bias=getattr(config, "attention_bias", False),
            cols=q_rows,
            reduce=tp,
        )
        self.split = (q_rows.size, kv_rows.size, kv_rows.size)
        if switches.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = switches.qk_norm
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)
        self.layer_ops: LayerOps | None = (
            None  # RoPE, q/k norms and the K/V write as one op (use_layer_ops)
        )

    def attend(self, rope: Rope, qkv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The fused q/k/v projection's output -> attention's [T, Hq * D] (before o_proj): RoPE, the
        K/V cache write and attention, the part of a layer piecewise graphs run eagerly."""
        if self.layer_ops is not None:
            q = self.layer_ops.rope_cache_write(
                qkv,
                *rope,
                meta.slot_mapping,
                self.attn.k_cache,
                self.attn.v_cache,
                self.num_heads,
                self.num_kv_heads,
                self.q_norm.weight if self.qk_norm else None,
                self.k_norm.weight if self.qk_norm else None,
                self.q_norm.eps if self.qk_norm else 0.0,
            )
            return self.attn.attend(q, meta)
        q_cols, k_cols, _ = self.split
        v = qkv[:, q_cols + k_cols :].view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q = rotate(self.q_norm(qkv[:, :q_cols].view(-1, self.num_heads, self.head_dim)), rope)
            k = rotate(
                self.k_norm(
                    qkv[:, q_cols : q_cols + k_cols].view(-1, self.num_kv_heads, self.head_dim)
                ),
                rope,
            )
        else:  # q's and k's heads side by side in the projection: rotated together, one set of ops
            qk = rotate(
                qkv[:, : q_cols + k_cols].view(
                    -1, self.num_heads + self.num_kv_heads, self.head_dim
                ),
                rope,
            )
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        return self.attn(q, k, v, meta)


class DecoderMLP(nn.Module):
    def __init__(self, config, switches: ArchSwitches, tp: TPGroup) -> None:
        super().__init__()
        inter = config.intermediate_size
        rows = intermediate_spans(inter, tp.size)[tp.rank]
        self.gate_up_proj = Linear(
            config.hidden_size, 2 * inter, bias=switches.mlp_bias, shards={"gate": rows, "up": rows}
        )
        self.down_proj = Linear(
            inter, config.hidden_size, bias=switches.mlp_bias, cols=rows, reduce=tp
        )
        self.inter = rows.size
        self.layer_ops: LayerOps | None = None  # SiLU-mul as one op (use_layer_ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.layer_ops is not None:
            return self.down_proj(self.layer_ops.silu_mul(gate_up))
        gate, up = gate_up.split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config, switches: ArchSwitches, tp: TPGroup) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(config, switches, tp)
        self.mlp = DecoderMLP(config, switches, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, rope: Rope, x, residual, meta):
        """-> (this layer's MLP output, the residual stream before it): the next norm adds them,
        fused with the norm on a GPU. `residual` None: the first layer (x is the embedding)."""
        qkv, residual = self.start(x, residual)
        return self.finish(self.self_attn.attend(rope, qkv, meta), residual)

    def start(self, x, residual):
        """The layer up to attention: (its q/k/v projection, the residual stream)."""
        x, residual = self.input_layernorm.add_forward(x, residual)
        return self.self_attn.qkv_proj(x), residual

    def finish(self, attention, residual):
        """The layer after attention: (its MLP output, the residual stream before it)."""
        x, residual = self.post_attention_layernorm.add_forward(
            self.self_attn.o_proj(attention), residual
        )
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    def __init__(
        self, config, switches: ArchSwitches, max_position: int, tp: TPGroup, vocab_rows: Span
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, vocab_rows, tp
        )
        self.rotary = RotaryEmbedding(config, max_position)
        self.layers = nn.ModuleList(
            DecoderLayer(config, switches, tp) for _ in range(config.num_hidden_layers)
        )
        for index, layer in enumerate(self.layers):
            layer.self_attn.attn.layer_index = index
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, positions, meta):
        """-> hidden [T, H]. runtime/compiled_model.py compiles this whole function, meta None."""
        x = self.embed_tokens(input_ids)
        rope = self.rotary.tables(positions, x.dtype)
        residual = None
        for layer in self.layers:
            x, residual = layer(rope, x, residual, meta)
        return self.norm.add_forward(x, residual)[0]

    def piece(self, index: int, x: torch.Tensor, residual: torch.Tensor | None):
        """The work between two attentions, what a piecewise graph holds. index 0: x = input ids;
        else x = layer index - 1's attention output. -> layer index's (q/k/v projection, residual),
        or (the final hidden states, None) at index = layers."""
        if index == 0:
            x = self.embed_tokens(x)
        else:
            x, residual = self.layers[index - 1].finish(x, residual)
        if index == len(self.layers):
            return self.norm.add_forward(x, residual)[0], None
        return self.layers[index].start(x, residual)


class DecoderForCausalLM(nn.Module):
    switches: ArchSwitches  # set by each architecture's subclass

    # HF tensor name fragment -> (our fused module fragment, shard id)
    stacked_params = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }

    def __init__(self, config, max_position: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = tp or TPGroup.single()
        self.vocab_spans = even_spans(config.vocab_size, self.tp.size, "vocab_size")
        vocab_rows = self.vocab_spans[self.tp.rank]
        self.model = DecoderModel(config, self.switches, max_position, self.tp, vocab_rows)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = Linear(config.hidden_size, config.vocab_size, shards={None: vocab_rows})
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, positions, meta) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def use_layer_ops(self, ops: LayerOps | None) -> None:
        """Run each layer's elementwise work (residual adds with norms, RoPE with the K/V write,
        SiLU-mul) through `ops`; None: torch's ops."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, DecoderAttention, DecoderMLP)):
                module.layer_ops = ops

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Full-vocabulary logits on rank 0 (each rank computes its vocabulary span); None elsewhere."""
        return self.tp.gather_columns(self.lm_head(hidden), [s.size for s in self.vocab_spans])
