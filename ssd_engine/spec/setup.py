"""Build the SD draft: load it, check it shares the target's tokenizer, size its KV like the target's."""
import torch
from transformers import AutoTokenizer

from ssd_engine.engine.model_runner import ModelRunner
from ssd_engine.models.loader import load_config
from ssd_engine.spec.sync_draft import SyncDraft


def check_same_tokenizer(target_tok, draft_tok, target_path: str, draft_path: str) -> None:
    if len(target_tok) != len(draft_tok) or target_tok.get_vocab() != draft_tok.get_vocab():
        raise ValueError(f"draft and target tokenizers differ: target {target_path} has {len(target_tok)} tokens, "
                         f"draft {draft_path} has {len(draft_tok)}; speculative decoding needs the same vocabulary")


def build_sync_draft(config, engine, num_blocks: int, max_position: int, dtype: torch.dtype) -> SyncDraft:
    from ssd_engine.engine.llm_engine import resolve_model_path
    draft_path = resolve_model_path(config, "draft")
    draft_config = load_config(draft_path)
    check_same_tokenizer(engine.tokenizer, AutoTokenizer.from_pretrained(draft_path), engine.model_path, draft_path)
    if config.max_num_batched_tokens < config.num_speculative_tokens + 1:
        raise ValueError(f"max_num_batched_tokens={config.max_num_batched_tokens} cannot fit one verification of "
                         f"num_speculative_tokens+1={config.num_speculative_tokens + 1} tokens")
    runner = ModelRunner(draft_path, draft_config, num_kv_blocks=num_blocks, block_size=config.block_size,
                         max_model_len=max_position, dtype=dtype, device=engine.device,
                         weight_layout=config.weight_layout)
    # ids past the tokenizer (embedding padding) or past the target's vocabulary are never proposed
    proposable = min(len(engine.tokenizer), draft_config.vocab_size, engine.hf_config.vocab_size)
    return SyncDraft(runner, num_blocks, config.block_size, config.num_speculative_tokens, proposable,
                     engine.generator)
