"""Model registry keyed by the Hugging Face `architectures` name in config.json."""

from ssd_engine.models.llama import LlamaForCausalLM
from ssd_engine.models.qwen2 import Qwen2ForCausalLM
from ssd_engine.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def model_class_for(config):
    names = list(getattr(config, "architectures", None) or [])
    for name in names:
        if name in MODEL_REGISTRY:
            return MODEL_REGISTRY[name]
    raise ValueError(
        f"unsupported architecture {names or '(none in config.json)'}; "
        f"supported: {', '.join(sorted(MODEL_REGISTRY))}"
    )
