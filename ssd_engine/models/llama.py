from ssd_engine.models.decoder import ArchSwitches, DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    def __init__(self, config, max_position: int, tp=None) -> None:
        self.switches = ArchSwitches(
            qkv_bias=bool(getattr(config, "attention_bias", False)),
            qk_norm=False,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
        )
        super().__init__(config, max_position, tp)
