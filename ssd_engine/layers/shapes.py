"""Reading a Hugging Face config: sizes it does not always state, and transformers' own class for
the functions that need it. The config is transformers' class in the engine process and plain values
in its child processes (models/loader.py `config_from_values`)."""


def head_dim(config) -> int:
    """Per-head width of q, k and v. Qwen3 states it (and it need not be hidden_size / heads);
    older Llama and Qwen2 configs leave it out or set it to None, meaning the even split."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def transformers_config(config):
    """`config` as transformers' own config class (what its functions take), rebuilt from plain
    values where it is not; this imports transformers, so only the paths that need it call it."""
    if hasattr(config, "to_dict"):
        return config
    from transformers import AutoConfig
    values = dict(vars(config))
    return AutoConfig.for_model(values.pop("model_type"), **values)
