"""Reading a Hugging Face config, either transformers' class or plain values (child processes)."""


def head_dim(config) -> int:
    """Per-head width of q, k and v; a missing or None head_dim means the even split."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def transformers_config(config):
    """`config` as transformers' own config class; imports transformers."""
    if hasattr(config, "to_dict"):
        return config
    from transformers import AutoConfig

    values = dict(vars(config))
    return AutoConfig.for_model(values.pop("model_type"), **values)
