"""Sizes read from a Hugging Face config that the config does not always state."""


def head_dim(config) -> int:
    """Per-head width of q, k and v. Qwen3 states it (and it need not be hidden_size / heads);
    older Llama and Qwen2 configs leave it out or set it to None, meaning the even split."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
