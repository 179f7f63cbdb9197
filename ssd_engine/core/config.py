"""EngineConfig: every engine option in one validated, frozen dataclass; the CLI maps its flags 1:1
onto these fields. Checkpoint-dependent values (max_model_len, num_kv_blocks) are resolved later."""

from dataclasses import dataclass, fields

from ssd_engine.core.config_parts import Config, build_config
from ssd_engine.core.option_checks import (
    check_choices,
    check_values,
    parse_fanout,
    unknown_option_message,
)
from ssd_engine.core.option_choices import (
    ATTENTION_BACKENDS,
    COMPILE_MODES,
    DRAFT_DTYPES,
    DTYPES,
    FUSED_KERNEL_MODES,
    LOAD_FORMATS,
    PER_STEP_POLICIES,
    SPECULATIVE_MODES,
    SSD_DRAFT_HOSTS,
    SSD_FALLBACKS,
    TARGET_DTYPES,
    WEIGHT_LAYOUTS,
)
from ssd_engine.core.options import hook, option
from ssd_engine.core.synthetic_hook import Synthetic


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str | None = option(
        None,
        "Hugging Face model folder (config.json + safetensors) or a .gguf file "
        "(converted once into the cache); unset: the built-in default target",
    )
    draft_model: str | None = option(
        None,
        "draft model folder or .gguf file (same tokenizer as the model); unset "
        "with no model: the built-in default draft",
    )
    speculative_mode: str | None = option(
        None,
        "ar: no speculation; sd: a colocated draft; ssd: speculative "
        "speculative decoding with the draft in its own process; auto: the "
        "one (and its K) predicted fastest on this machine's cores; unset: "
        "auto when a draft is known, else ar",
        SPECULATIVE_MODES,
    )
    num_speculative_tokens: int = option(4, "K: draft tokens per round")
    speculation_per_step: str = option(
        "goodput",
        "SD: goodput (each step drafts K or nothing, whichever this "
        "engine measured emitting more tokens per second at that batch "
        "size; a batch holding a seeded request drafts K, so its tokens "
        "never depend on the batch), off (every step drafts K)",
        PER_STEP_POLICIES,
    )
    draft_dtype: str = option(
        "auto",
        "the draft's weight format (its precision never changes the output): auto "
        "picks the fastest this CPU runs, measured once per machine; int8/int4 are "
        "weight-only with bf16 activations, q4k is GGUF Q4_K blocks with int8 "
        "activations (AVX-512 VNNI), all three CPU only",
        DRAFT_DTYPES,
    )
    draft_prompt_window: int | None = option(
        None,
        "the draft reads a long prompt's first 4 tokens and its last N only (its context never changes the "
        "output, only acceptance), so less of a prompt is read twice; unset: 128 for SD on CPU (docs/CPU.md), "
        "the whole prompt on a GPU and for SSD, whose draft reads it beside the target's prefill",
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
    max_model_len: int | None = option(
        None, "prompt + output token limit; unset: min(the checkpoint's, 4096)"
    )
    max_num_seqs: int = option(16, "most requests in one batch")
    max_num_batched_tokens: int | None = option(
        None,
        "tokens computed per step (a longer prefill is chunked to "
        "fit); unset: 512 on CPU (docs/CPU.md), 2048 on a GPU",
    )
    prefill_tokens_while_decoding: int | None = option(
        None,
        "most prompt tokens computed in a step that also decodes running requests; unset: up to "
        "max_num_batched_tokens. A small value keeps their inter-token latency under a long arriving "
        "prompt, at that prompt's time to first token",
    )
    max_decode_stall: float | None = option(
        None,
        "a step that also decodes running requests takes at most this many times their unloaded step: "
        "an arriving prompt's tokens are paced by the measured step times; unset: no time cap",
    )
    block_size: int = option(16, "tokens per KV-cache block")
    num_kv_blocks: int | None = option(
        None, "KV-cache blocks; unset: derived from kv_cache_memory_gb"
    )
    kv_cache_memory_gb: float = option(1.0, "memory for the KV cache in GiB, per rank")
    enable_prefix_caching: bool = option(True, "reuse the KV blocks of a prompt prefix seen before")
    dtype: str = option(
        "auto",
        "weights and activations; auto: bfloat16 on CUDA, float32 on CPU (no bf16 units on AVX2)",
        DTYPES,
    )
    device: str = option("cpu", "cpu or cuda[:N]")
    num_threads: int | None = option(None, "torch intra-op threads; unset: torch's default")
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
        64, "CUDA graphs are captured for batch sizes 1, 2, 4, ... up to this"
    )
    cpu_weight_layout: str = option(
        "auto",
        "CPU weight layout (see layers/linear.py): auto = packed (one copy "
        "of each weight); dual keeps a second, plain copy",
        WEIGHT_LAYOUTS,
    )
    seed: int = option(0, "seeds unseeded sampling")
    tensor_parallel_size: int = option(
        1, "target ranks: rank 0 in this process, 1..N-1 spawned (or joined via torchrun)"
    )
    cpu_cores: str | None = option(
        None,
        'cores per rank (then the SSD draft\'s), e.g. "0;1" or '
        '"0-3;4-7"; unset: the usable cores split evenly',
    )
    distributed_timeout_s: float = option(
        60.0, "seconds a tensor-parallel collective may wait before it raises instead of hanging"
    )
    ssd_fanout: str | int | tuple = option(
        "auto",
        "SSD bonus candidates per accepted count k: auto (Theorem 12 "
        "on the calibration's measured P(k)), geometric (Theorem 12 "
        "with i.i.d. acceptance alpha), uniform, one integer, or K+1 "
        "comma-separated integers",
    )
    ssd_budget: int | None = option(
        None, "B, the sum of the SSD fan-out; unset: the calibration's measured time budget"
    )
    ssd_fit_window: bool = option(
        True,
        "shrink the SSD fan-out at run time while the draft's cache build outlasts "
        "the target's verification (T_p > 1); an explicit integer ssd_fanout is "
        "always kept as given",
    )
    ssd_fallback: str = option(
        "auto",
        "what an SSD cache miss takes: jit (the draft drafts now), fast (n-gram, "
        "else random), auto (jit below the critical batch size b*, else fast)",
        SSD_FALLBACKS,
    )
    ssd_critical_batch: float | None = option(
        None, "pins b* for ssd_fallback=auto; unset: from running estimates"
    )
    saguaro_c: float = option(
        1.0,
        "Saguaro sampling: the draft's top-F probabilities times C, in [0, 1] (1: plain sampling)",
    )
    calibration_dir: str | None = option(
        None, "folder of Saguaro calibrations; unset: the repo's configs/"
    )
    ssd_draft_host: str = option(
        "auto",
        "where the SSD draft runs: process (its own process, on its own cores or "
        "GPU; the production shape), thread (a thread of the engine process on "
        "its own CUDA stream, so on one GPU its kernels can overlap the "
        "target's; on CPU it shares the engine's cores), auto (thread when the "
        "draft shares the target's one GPU, where it measured faster; else "
        "process)",
        SSD_DRAFT_HOSTS,
    )
    draft_timeout_s: float = option(
        30.0, "SSD: seconds after which a draft reply counts as a dead draft"
    )
    synthetic: Synthetic | None = hook(
        "benchmarks and tests only: drafts accepted and SSD lookups hit at set "
        "rates (core/synthetic_hook.py Synthetic); outputs are then NOT the "
        "target's"
    )

    @property
    def weight_layout(self) -> str:
        """The CPU weight layout every process of this engine uses (target ranks and drafts alike)."""
        if self.enforce_eager or self.device != "cpu":
            return "plain"
        if self.cpu_weight_layout != "auto":
            return self.cpu_weight_layout
        # one copy of every weight; packed loses only on one thread's single-row decode, which
        # "dual" wins back with a second, plain copy
        return "packed"

    @property
    def target_weight_format(self) -> str | None:
        """The target's re-quantized Linear format (layers/weight_formats.py); None: fp32, the weights
        as `dtype` holds them."""
        return (
            None if self.target_dtype in ("auto", "fp32") else self.target_dtype
        )  # auto: until planning resolves it

    @property
    def compiled(self) -> bool:
        """Whether every runner (target, SD draft, SSD draft) compiles its forward
        (runtime/compiled_model.py). auto is off: compile time outweighs a typical run's gain."""
        return self.compile_model == "on" and not self.enforce_eager

    @property
    def graph_max_batch(self) -> int:
        """Largest batch CUDA graphs are captured for; 0 = eager."""
        return 0 if self.enforce_eager else self.cuda_graph_max_batch

    def parts(self) -> Config:
        """These options cut into the engine's frozen parts (config_parts.py)."""
        return build_config(self)

    def fanout(self) -> list[int] | None:
        """ssd_fanout as K+1 non-negative integers (one value applies to every k); None for a rule
        (auto / geometric / uniform) that the engine resolves from its calibration."""
        return parse_fanout(self.ssd_fanout, self.num_speculative_tokens)

    def __post_init__(self) -> None:
        if self.speculative_mode is None:  # the default pair, or a user-given draft, means auto
            drafted = self.model is None or self.draft_model is not None
            object.__setattr__(self, "speculative_mode", "auto" if drafted else "ar")
        check_choices(
            self
        )  # every closed set of values, as each option declares it, and the device
        if self.dtype == "auto":
            object.__setattr__(self, "dtype", "float32" if self.device == "cpu" else "bfloat16")
        # CPU: a long prompt's chunks beat one step (docs/CPU.md)
        if self.max_num_batched_tokens is None:
            object.__setattr__(
                self, "max_num_batched_tokens", 512 if self.device == "cpu" else 2048
            )
        check_values(self)  # each value's type and range, and combinations that cannot run

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        names = field_names()
        for key in kwargs:
            if key not in names:
                raise ValueError(unknown_option_message(key, names))
        return cls(**kwargs)


def field_names() -> list[str]:
    return [f.name for f in fields(EngineConfig)]
