"""Tiny random checkpoints built with transformers' own config classes; transformers is the oracle."""

import os

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

# 3 specials + 256 byte tokens = 259 tokenizer ids; the embedding is padded past them (like real
# checkpoints whose vocab_size exceeds len(tokenizer)).
VOCAB = 320

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def llama_config(**overrides):
    kwargs = dict(
        COMMON,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        tie_word_embeddings=True,
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def qwen2_config(**overrides):
    return Qwen2Config(**dict(COMMON, tie_word_embeddings=False, **overrides))


def qwen3_config(**overrides):
    return Qwen3Config(**dict(COMMON, head_dim=32, tie_word_embeddings=False, **overrides))


CONFIGS = {"llama": llama_config, "qwen2": qwen2_config, "qwen3": qwen3_config}


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level tokenizer without merges: every byte is one token (ids 3..258), specials 0-2."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    vocab.update({ch: 3 + i for i, ch in enumerate(sorted(alphabet))})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


def build_checkpoint(path: str, arch: str, seed: int = 0, **overrides) -> str:
    """Write a random checkpoint of `arch` to `path` (safetensors + tokenizer) and return the path."""
    torch.manual_seed(seed)
    config = CONFIGS[arch](**overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # larger-than-default weights give peaked, less tie-prone distributions
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


def derived_checkpoint(src: str, dst: str, transform) -> str:
    """Copy checkpoint `src` to `dst`, replacing its weights by transform(state_dict)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, dirs_exist_ok=True)
    state = load_file(os.path.join(src, "model.safetensors"))
    save_file(transform(state), os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst
