from ssd_engine.models.decoder import ArchSwitches, DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    """Qwen3: per-head RMSNorm on q and k before rotary; bias only if the config asks."""

    def __init__(self, config, max_position: int, tp=None) -> None:
        self.switches = ArchSwitches(
            qkv_bias=bool(getattr(config, "attention_bias", False)), qk_norm=True, mlp_bias=False
        )
        super().__init__(config, max_position, tp)
