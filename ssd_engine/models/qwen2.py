from ssd_engine.models.decoder import ArchSwitches, DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    """Qwen2: bias on q/k/v only (o_proj has none; the config has no attention_bias field)."""

    switches = ArchSwitches(qkv_bias=True, qk_norm=False, mlp_bias=False)
