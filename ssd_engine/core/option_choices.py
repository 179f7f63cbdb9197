"""The closed sets of values EngineConfig's options accept (`option(..., choices)`)."""

SPECULATIVE_MODES = ("auto", "ar", "sd", "ssd")
DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flash-attn")
WEIGHT_LAYOUTS = ("auto", "dual", "packed", "plain")
SSD_FALLBACKS = ("auto", "jit", "fast")
DRAFT_DTYPES = ("auto", "fp32", "bf16", "int8", "int4", "q4k")  # auto: the fastest this CPU runs
# auto, fp32 and gguf keep the checkpoint's values; the others change the model
TARGET_DTYPES = ("auto", "fp32", "gguf", "gguf-int8", "bf16", "int8", "int4")
REQUANTIZED = (
    "bf16",
    "int8",
    "int4",
)  # re-quantized weights (layers/weight_formats.py); gguf-int8 rounds activations
FANOUT_RULES = ("auto", "geometric", "uniform")
LOAD_FORMATS = ("auto", "dummy")  # dummy: vLLM's name for random weights at the checkpoint's shapes
COMPILE_MODES = ("auto", "on", "off")
FUSED_KERNEL_MODES = ("auto", "on", "off")
SSD_DRAFT_HOSTS = ("auto", "process", "thread")
PER_STEP_POLICIES = ("goodput", "off")
