"""The engine's options grouped by the part of the engine that reads them: `build_config` cuts the
validated EngineConfig once into these frozen parts. Inside the engine K is `speculative.k`."""

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """How to load and run one model. The SSD/SD draft's is the target's with its own path (and,
    in its own process, its own device and weight layout)."""

    path: str | None  # model folder; None (before resolution) means the built-in default
    tokenizer: str | None  # tokenizer folder; None: the model folder
    dtype: str  # resolved: never "auto"
    device: str  # rank 0's; rank r on CUDA takes the r-th GPU after it
    weight_layout: str  # resolved: plain, packed or dual (layers/linear.py)
    attention_backend: str = "auto"
    cuda_graph_max_batch: int = 0  # 0: eager (enforce_eager or no graphs)
    num_threads: int | None = None
    weight_format: str | None = (
        None  # a draft's resolved format, or the target's target_dtype (layers/weight_formats.py); None: dtype's own
    )
    row_independent: bool = (
        False  # the target's format: a row's output never depends on the others (never a draft's)
    )
    load_format: str = (
        "auto"  # auto: the checkpoint; dummy: random weights at its shapes (models/loader.py)
    )
    compile: bool = False  # the forward as one torch.compile region (runtime/compiled_model.py)
    fused_kernels: str = "auto"  # a layer's elementwise ops fused (layers/layer_ops.py)
    row_padding: tuple[
        tuple[int, int], ...
    ] = ()  # (rows, padded rows) of its oneDNN matmuls (planning/row_padding_probe.py)


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int
    num_kv_blocks: int | None  # None until the engine sizes it from kv_cache_memory_gb
    kv_cache_memory_gb: float = 1.0
    enable_prefix_caching: bool = True


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int | None  # prompt + output tokens; None until resolved from the checkpoint
    prefill_tokens_while_decoding: int | None = (
        None  # prompt tokens in a step that also decodes; None: no cap
    )
    max_decode_stall: float | None = (
        None  # a decoding step's time cap in unloaded steps; None: no cap
    )


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    tensor_parallel_size: int
    cpu_cores: str | None
    distributed_timeout_s: float


@dataclass(frozen=True, slots=True)
class SSDConfig:
    """The asynchronous draft's policy: fan-out, its budget, and what a cache miss takes."""

    fanout_rule: str | None  # auto / geometric / uniform; None when the user gave the fan-out
    fanout: (
        tuple[int, ...] | None
    )  # the user's K+1 integers (one given applies to every k); None for a rule
    budget: int | None
    fit_window: bool  # cap builds to the verification window (never for the user's integers)
    fallback: str
    critical_batch: float | None
    saguaro_c: float
    calibration_dir: str | None
    synthetic_hit: float | None = None  # benchmarking: P(a lookup hits), drawn on the draft side
    draft_host: str = (
        "auto"  # auto, process, or thread: in the engine process on its own CUDA stream
    )


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    mode: str  # "ar", "sd" or "ssd"
    draft_model: str | None
    draft_dtype: str  # the option; the plan resolves it (planning/formats.py)
    k: int  # draft tokens per round (the option num_speculative_tokens)
    draft_timeout_s: float
    ssd: SSDConfig
    synthetic_acceptance: float | None = (
        None  # benchmarking: P(a draft token is accepted), not the target's law
    )
    per_step: str = (
        "goodput"  # SD: K or 0 chosen every step (engine/step_choice.py); "off": K every step
    )
    prompt_window: int | None = (
        None  # a long prompt's last tokens the draft reads (speculative/prompt_window.py)
    )


@dataclass(frozen=True, slots=True)
class Config:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    speculative: SpeculativeConfig
    seed: int


def build_config(options) -> Config:
    """Cut a validated EngineConfig into its parts."""
    fanout = options.fanout()
    rule, fanout = (options.ssd_fanout, None) if fanout is None else (None, tuple(fanout))
    synthetic = options.synthetic
    acceptance, hit = (synthetic.acceptance, synthetic.hit) if synthetic else (None, None)
    return Config(
        model=ModelConfig(
            options.model,
            options.tokenizer,
            options.dtype,
            options.device,
            options.weight_layout,
            options.attention_backend,
            options.graph_max_batch,
            options.num_threads,
            weight_format=options.target_weight_format,
            row_independent=options.target_weight_format is not None,
            load_format=options.load_format,
            compile=options.compiled,
            fused_kernels=options.fused_kernels,
        ),
        cache=CacheConfig(
            options.block_size,
            options.num_kv_blocks,
            options.kv_cache_memory_gb,
            options.enable_prefix_caching,
        ),
        scheduler=SchedulerConfig(
            options.max_num_seqs,
            options.max_num_batched_tokens,
            options.max_model_len,
            options.prefill_tokens_while_decoding,
            options.max_decode_stall,
        ),
        parallel=ParallelConfig(
            options.tensor_parallel_size, options.cpu_cores, options.distributed_timeout_s
        ),
        speculative=SpeculativeConfig(
            options.speculative_mode,
            options.draft_model,
            options.draft_dtype,
            options.num_speculative_tokens,
            options.draft_timeout_s,
            SSDConfig(
                rule,
                fanout,
                options.ssd_budget,
                options.ssd_fit_window and fanout is None,
                options.ssd_fallback,
                options.ssd_critical_batch,
                float(options.saguaro_c),
                options.calibration_dir,
                _float_or_none(hit),
                options.ssd_draft_host,
            ),
            _float_or_none(acceptance),
            options.speculation_per_step,
            options.draft_prompt_window,
        ),
        seed=options.seed,
    )


def _float_or_none(value: float | None) -> float | None:
    return None if value is None else float(value)
