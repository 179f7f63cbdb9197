"""EngineConfig's sections for the model, its KV cache, the scheduler and parallelism: each option
declared once, in the section of the engine that reads it (core/options.py `option`). A field's
own name is the engine's; its public name (keyword, flag) is the declared `name`, else the field's.
`resolved` fields are derived from the options (EngineConfig fills them), never given. An option
decided from the others when unset or auto (dtype, max_num_batched_tokens, speculative_mode) keeps
what was given in its `requested_` field, and the engine reads the decision from the resolved field
under the option's name (`model.dtype`), so a config with other options decides it again."""

from dataclasses import dataclass, replace

from ssd_engine.core.option_choices import (
    ATTENTION_BACKENDS,
    COMPILE_MODES,
    DTYPES,
    FUSED_KERNEL_MODES,
    LOAD_FORMATS,
    TARGET_DTYPES,
    WEIGHT_LAYOUTS,
)
from ssd_engine.core.options import option, resolved


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """How to load and run one model. The SSD/SD draft's is the target's with its own path (and,
    in its own process, its own device) and its own resolved format."""

    path: str | None = option(
        None,
        "Hugging Face model folder (config.json + safetensors) or a .gguf file "
        "(converted once into the cache); unset: the built-in default target",
        name="model",
    )
    tokenizer: str | None = option(
        None,
        "tokenizer folder; unset: the model folder (with load_format=dummy and "
        "no tokenizer files there: none, prompts must be token ids)",
    )
    load_format: str = option(
        "auto",
        "auto: read the checkpoint's safetensors; dummy: random weights at the "
        "shapes of the folder's config.json, no weights read (speed measurements)",
        LOAD_FORMATS,
    )
    target_dtype: str = option(
        "auto",
        "the target's Linear weight format: auto is gguf-int8 where the target came from "
        "a GGUF file (the built-in pair does) and runs on CPU, else fp32; fp32 keeps the "
        "weights as dtype holds them; gguf keeps a GGUF checkpoint's own quantized blocks (the same values "
        "as fp32, a sixth of the bytes; CPU only; exact); gguf-int8 multiplies those blocks by int8-rounded "
        "activations (llama.cpp's arithmetic and fidelity, prompts ~1.5-1.9x faster; another model, close); "
        "bf16, int8 and int4 re-quantize them, which CHANGES the model: AR, SD and SSD all give that "
        "model's own output (bf16 activations in its Linears; int8/int4 CPU only)",
        TARGET_DTYPES,
    )
    requested_dtype: str = option(
        "auto",
        "weights and activations; auto: bfloat16 on CUDA, float32 on CPU (no bf16 units on AVX2)",
        DTYPES,
        name="dtype",
    )
    device: str = option(
        "cpu", "cpu or cuda[:N]"
    )  # rank 0's; rank r on CUDA takes the r-th GPU after it
    num_threads: int | None = option(
        None, "torch intra-op threads; unset: torch's default", at_least=1
    )
    enforce_eager: bool = option(
        False, "plain weights: no prepacking, no CUDA graphs, no compiled forward"
    )
    compile_model: str = option(
        "auto",
        "run the model's forward (attention excepted) as one torch.compile region, "
        "in the target and the drafts; auto: off (on a CPU the gain, 1 to 14 percent a layer, "
        "does not repay a typical run's compile time; unmeasured on CUDA)",
        COMPILE_MODES,
    )
    fused_kernels: str = option(
        "auto",
        "a decoder layer's elementwise work (residual add + RMSNorm, RoPE + K/V "
        "cache write, SiLU-mul) as fused ops: Triton kernels on CUDA, C++ on a CPU "
        "where the CPU kernels build; auto: on unless compile_model is on (inductor "
        "fuses those)",
        FUSED_KERNEL_MODES,
    )
    attention_backend: str = option(
        "auto",
        "auto: on CUDA flash-attn if importable and the blocks fit, else "
        "triton, on CPU the compiled CPU kernel if it builds, else torch; torch is the reference",
        ATTENTION_BACKENDS,
    )
    cuda_graph_max_batch: int = option(
        64, "CUDA graphs are captured for batch sizes 1, 2, 4, ... up to this", at_least=1
    )
    cpu_weight_layout: str = option(
        "auto",
        "CPU weight layout (see layers/linear.py): auto = packed (one copy "
        "of each weight); dual keeps a second, plain copy",
        WEIGHT_LAYOUTS,
    )
    dtype: str = resolved(
        "float32", "the dtype option decided: as given, or auto's choice for the device"
    )
    weight_layout: str = resolved(
        "plain", "plain, packed or dual (layers/linear.py): cpu_weight_layout on a CPU, else plain"
    )
    graph_max_batch: int = resolved(
        0, "largest batch CUDA graphs are captured for: cuda_graph_max_batch; 0 = eager"
    )
    compile: bool = resolved(
        False, "the forward as one torch.compile region (runtime/compiled_model.py)"
    )
    weight_format: str | None = resolved(
        None,
        "a draft's decided format, or the target's target_dtype (layers/weight_formats.py); "
        "None: dtype's own",
    )
    row_independent: bool = resolved(
        False, "the target's format: a row's output never depends on the others (never a draft's)"
    )
    row_padding: tuple[tuple[int, int], ...] = resolved(
        (), "(rows, padded rows) of its oneDNN matmuls (planning/row_padding_probe.py)"
    )

    @property
    def target_weight_format(self) -> str | None:
        """target_dtype as a Linear format (layers/weight_formats.py); None: fp32, the weights as
        `dtype` holds them (auto too, until planning resolves it)."""
        return None if self.target_dtype in ("auto", "fp32") else self.target_dtype

    def resolve(self, compiled: bool) -> "ModelConfig":
        """This model with its resolved fields derived from its options; `compiled`: whether it
        compiles its forward (EngineConfig.compiled)."""
        if self.enforce_eager or self.device != "cpu":
            layout = "plain"
        else:
            # one copy of every weight; packed loses only on one thread's single-row decode, which
            # "dual" wins back with a second, plain copy
            layout = "packed" if self.cpu_weight_layout == "auto" else self.cpu_weight_layout
        fmt = self.target_weight_format
        dtype = self.requested_dtype
        if dtype == "auto":
            dtype = "float32" if self.device == "cpu" else "bfloat16"
        return replace(
            self,
            dtype=dtype,
            weight_layout=layout,
            graph_max_batch=0 if self.enforce_eager else self.cuda_graph_max_batch,
            compile=compiled,
            weight_format=fmt,
            row_independent=fmt is not None,
        )


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """The paged KV cache."""

    block_size: int = option(16, "tokens per KV-cache block", at_least=1)
    num_kv_blocks: int | None = option(
        None, "KV-cache blocks; unset: derived from kv_cache_memory_gb", at_least=1
    )
    kv_cache_memory_gb: float = option(1.0, "memory for the KV cache in GiB, per rank", above=0)
    enable_prefix_caching: bool = option(True, "reuse the KV blocks of a prompt prefix seen before")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """What a step computes: the batch, its tokens, and how a prefill shares a decoding step."""

    max_model_len: int | None = option(
        None, "prompt + output token limit; unset: min(the checkpoint's, 4096)", at_least=1
    )
    max_num_seqs: int = option(16, "most requests in one batch", at_least=1)
    requested_max_num_batched_tokens: int | None = option(
        None,
        "tokens computed per step (a longer prefill is chunked to "
        "fit); unset: 512 on CPU (docs/CPU.md), 2048 on a GPU",
        name="max_num_batched_tokens",
        at_least=1,
    )
    prefill_tokens_while_decoding: int | None = option(
        None,
        "most prompt tokens computed in a step that also decodes running requests; unset: up to "
        "max_num_batched_tokens. A small value keeps their inter-token latency under a long arriving "
        "prompt, at that prompt's time to first token",
        at_least=1,
    )
    max_decode_stall: float | None = option(
        None,
        "a step that also decodes running requests takes at most this many times their unloaded step: "
        "an arriving prompt's tokens are paced by the measured step times; unset: no time cap",
        above=1,
    )
    max_num_batched_tokens: int = resolved(
        512, "the max_num_batched_tokens option decided: as given, or the device's default"
    )


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """Tensor-parallel ranks and the CPU cores each process runs on."""

    tensor_parallel_size: int = option(
        1,
        "target ranks: rank 0 in this process, 1..N-1 spawned (or joined via torchrun)",
        at_least=1,
    )
    cpu_cores: str | None = option(
        None,
        'cores per rank (then the SSD draft\'s), e.g. "0;1" or '
        '"0-3;4-7"; unset: the usable cores split evenly',
    )
    distributed_timeout_s: float = option(
        60.0,
        "seconds a tensor-parallel collective may wait before it raises instead of hanging",
        above=0,
    )
