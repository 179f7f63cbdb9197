"""What an engine reads off its checkpoint and options before it builds: the longest sequence, the
KV blocks that fit, the EOS ids."""

import os

import torch
from transformers import GenerationConfig

from ssd_engine.core.config import EngineConfig
from ssd_engine.runtime.model_runner import ModelRunner


def max_model_len(hf_config, wanted: int | None) -> int:
    """The max_model_len option `wanted` (None: min(the checkpoint's, 4096)); a ValueError where it
    exceeds the checkpoint's positions."""
    limit = getattr(hf_config, "max_position_embeddings", None) or 4096
    if wanted is None:
        return min(limit, 4096)
    if wanted > limit:
        raise ValueError(
            f"max_model_len={wanted} exceeds the model's max_position_embeddings={limit}"
        )
    return wanted


def num_kv_blocks(config: EngineConfig, hf_config, model_len: int, dtype: torch.dtype) -> int:
    """The option's KV blocks, else those kv_cache_memory_gb holds, capped at what every sequence at
    full length can use."""
    cache = config.cache
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    # kv_cache_memory_gb is per rank, as GPU memory limits are per device
    per_block = ModelRunner.kv_bytes_per_block(
        hf_config, cache.block_size, dtype, config.parallel.tensor_parallel_size
    )
    by_memory = int(cache.kv_cache_memory_gb * 2**30 // per_block)
    # more blocks than every slot of every sequence at full length can never be used
    useful = config.scheduler.max_num_seqs * -(-model_len // cache.block_size) + 1
    return max(1, min(by_memory, useful))


def eos_token_ids(model_path: str, hf_config, tokenizer) -> set[int]:
    """generation_config.json's EOS ids, else the config's, else the tokenizer's."""
    eos = None
    if os.path.isfile(os.path.join(model_path, "generation_config.json")):
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None) or tokenizer.eos_token_id
    return set(eos if isinstance(eos, list) else [] if eos is None else [eos])
