"""Owns one model and its paged KV cache: turns a scheduled batch into tensors, runs forward.

Inputs are flattened over the batch (no padding in the dense layers); attention gets per-
sequence slot tables and a mask. A sequence computing new tokens [start, start + n) attends
to every slot up to its own position (causal over cached prefix + new tokens).
"""
import torch

from ssd_engine.engine.scheduler import ScheduledBatch
from ssd_engine.layers.attention import AttentionMetadata
from ssd_engine.layers.linear import Linear
from ssd_engine.models.loader import build_model


class ModelRunner:
    def __init__(self, model_path: str, hf_config, *, num_kv_blocks: int, block_size: int, max_model_len: int,
                 dtype: torch.dtype, device: torch.device, weight_layout: str = "plain") -> None:
        self.device, self.dtype, self.block_size = device, dtype, block_size
        self.config = hf_config
        self.model = build_model(model_path, hf_config, max_model_len, dtype, device)
        if weight_layout != "plain":
            for module in self.model.modules():
                if isinstance(module, Linear):
                    # a tied head shares the embedding table, which must stay plain
                    tied = module is self.model.lm_head and self.model.tie_word_embeddings
                    module.pack_for_cpu(keep_plain=weight_layout == "dual" or tied)
        self._allocate_kv_cache(num_kv_blocks)

    @staticmethod
    def kv_bytes_per_block(hf_config, block_size: int, dtype: torch.dtype) -> int:
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        per_token = 2 * hf_config.num_hidden_layers * hf_config.num_key_value_heads * head_dim
        return per_token * block_size * torch.finfo(dtype).bits // 8

    def _allocate_kv_cache(self, num_blocks: int) -> None:
        cfg = self.config
        layers = self.model.model.layers
        attn0 = layers[0].self_attn.attn
        shape = (2, len(layers), num_blocks * self.block_size, attn0.num_kv_heads, attn0.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        for i, layer in enumerate(layers):
            layer.self_attn.attn.k_cache = self.kv_cache[0, i]
            layer.self_attn.attn.v_cache = self.kv_cache[1, i]

    def prepare(self, batch: ScheduledBatch, token_ids: list[list[int]] | None = None):
        """Build model inputs. `token_ids[i]` overrides the tokens fed for sequence i (draft tokens)."""
        bs, dev = self.block_size, self.device
        starts = [seq.num_computed_tokens for seq in batch.seqs]
        lens = batch.num_new_tokens
        ids, positions = [], []
        for i, seq in enumerate(batch.seqs):
            fed = token_ids[i] if token_ids is not None else seq.token_ids[starts[i]:starts[i] + lens[i]]
            assert len(fed) == lens[i]
            ids.extend(fed)
            positions.extend(range(starts[i], starts[i] + lens[i]))
        max_q, context = max(lens), [s + n for s, n in zip(starts, lens)]
        max_ctx = max(context)
        max_pages = (max_ctx + bs - 1) // bs
        tables = torch.tensor([seq.block_table[:max_pages] + [0] * (max_pages - len(seq.block_table[:max_pages]))
                               for seq in batch.seqs], dtype=torch.long)
        gather = (tables[:, :, None] * bs + torch.arange(bs)).view(len(batch), -1)[:, :max_ctx]
        pos = torch.tensor(positions, dtype=torch.long)
        seq_index = torch.repeat_interleave(torch.arange(len(batch)), torch.tensor(lens))
        slot_mapping = gather[seq_index, pos]
        offsets = torch.cat([torch.arange(n) for n in lens])
        token_to_padded = seq_index * max_q + offsets
        q_pos = torch.tensor(starts)[:, None] + torch.arange(max_q)[None, :]
        mask = torch.arange(max_ctx)[None, None, :] <= q_pos[:, :, None]
        meta = AttentionMetadata(slot_mapping.to(dev), gather.to(dev), token_to_padded.to(dev), mask.to(dev), max_q)
        return torch.tensor(ids, dtype=torch.long, device=dev), pos.to(dev), meta

    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch, logit_rows: list[list[int]], token_ids=None):
        """Run the batch; return logits [R, V] (fp32) for the rows named by `logit_rows[i]`
        (offsets into sequence i's new tokens), concatenated in batch order."""
        input_ids, positions, meta = self.prepare(batch, token_ids)
        hidden = self.model(input_ids, positions, meta)
        flat, base = [], 0
        for rows, n in zip(logit_rows, batch.num_new_tokens):
            flat.extend(base + r for r in rows)
            base += n
        if not flat:
            return hidden.new_zeros(0, self.config.vocab_size, dtype=torch.float32)
        selected = hidden[torch.tensor(flat, device=self.device)]
        return self.model.compute_logits(selected).float()
