"""EngineConfig's value checks: types and ranges, and option combinations that cannot run."""

import difflib
from dataclasses import fields

from ssd_engine.core.core_sets import parse_core_sets
from ssd_engine.core.option_choices import FANOUT_RULES
from ssd_engine.core.options import choices_of
from ssd_engine.core.synthetic_hook import Synthetic


def require(ok: bool, message: str) -> None:
    """A ValueError with `message` (which names the option) unless `ok`."""
    if not ok:
        raise ValueError(message)


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    """An int or a float, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def all_ints(text: str) -> bool:
    return all(v.strip().isdigit() for v in text.split(",")) and bool(text.strip())


def parse_fanout(given, k: int) -> list[int] | None:
    """ssd_fanout `given` as K+1 non-negative integers (one value applies to every k); None for a
    rule (auto / geometric / uniform) that the engine resolves from its calibration."""
    value = given
    if isinstance(value, str) and value in FANOUT_RULES:
        return None
    if isinstance(value, str):
        value = (
            [int(v) for v in value.replace(" ", "").split(",") if v] if all_ints(value) else None
        )
    elif is_int(value):
        value = [value]
    else:
        value = (
            list(value)
            if isinstance(value, (list, tuple)) and all(is_int(v) for v in value)
            else None
        )
    require(
        value is not None and len(value) in (1, k + 1) and all(v >= 0 for v in value),
        f"ssd_fanout must be one of {FANOUT_RULES}, one integer >= 0 or {k + 1} of them "
        f"(one per accepted count k = 0..{k}), "
        f"got {given!r}",
    )
    return value * (k + 1) if len(value) == 1 else value


def check_choices(config) -> None:
    """Each option of EngineConfig `config` within its closed set of values, as it declares it
    (`option(..., choices)`), and a device torch names."""
    for f in fields(config):
        value, choices = getattr(config, f.name), choices_of(f)
        require(
            choices is None or value in choices, f"{f.name} must be one of {choices}, got {value!r}"
        )
    require(
        config.device == "cpu" or config.device.startswith("cuda"),
        f"device must be 'cpu' or 'cuda[:N]', got {config.device!r}",
    )


def check_values(config) -> None:
    """A ValueError naming the first option of EngineConfig `config` (its closed sets of values
    already checked, its defaults filled in) whose value, or combination with another, cannot run."""
    require(
        not (config.compile_model == "on" and config.tensor_parallel_size > 1),
        "compile_model='on' needs tensor_parallel_size=1: tensor parallelism's all-reduces are not compiled",
    )
    require(
        not (config.fused_kernels == "on" and config.compiled),
        "fused_kernels='on' and compile_model='on' are two ways to fuse a layer's ops: choose one",
    )
    for name in (
        "num_speculative_tokens",
        "max_num_seqs",
        "max_num_batched_tokens",
        "block_size",
        "tensor_parallel_size",
        "cuda_graph_max_batch",
    ):
        value = getattr(config, name)
        require(is_int(value) and value >= 1, f"{name} must be an integer >= 1, got {value!r}")
    for name in ("max_model_len", "num_kv_blocks", "num_threads", "prefill_tokens_while_decoding"):
        value = getattr(config, name)
        require(
            value is None or (is_int(value) and value >= 1),
            f"{name} must be an integer >= 1, got {value!r}",
        )
    stall = config.max_decode_stall
    require(
        stall is None or (is_number(stall) and stall > 1),
        f"max_decode_stall must be a number > 1, got {stall!r}",
    )
    require(
        config.draft_prompt_window is None
        or (is_int(config.draft_prompt_window) and config.draft_prompt_window >= 0),
        f"draft_prompt_window must be an integer >= 0, got {config.draft_prompt_window!r}",
    )
    require(
        isinstance(config.kv_cache_memory_gb, (int, float)) and config.kv_cache_memory_gb > 0,
        f"kv_cache_memory_gb must be > 0, got {config.kv_cache_memory_gb!r}",
    )
    for name in ("distributed_timeout_s", "draft_timeout_s"):
        value = getattr(config, name)
        require(
            is_number(value) and value > 0,
            f"{name} must be > 0, got {value!r}",
        )
    require(
        config.device == "cpu" or config.draft_dtype not in ("int8", "int4", "q4k"),
        f"draft_dtype={config.draft_dtype} is CPU-only; on {config.device} use auto, bf16 or fp32",
    )
    require(
        config.device == "cpu" or config.target_dtype not in ("gguf", "gguf-int8", "int8", "int4"),
        f"target_dtype={config.target_dtype} is CPU-only; on {config.device} use fp32 or bf16",
    )
    config.fanout()  # validates
    require(
        config.ssd_budget is None or (is_int(config.ssd_budget) and config.ssd_budget >= 0),
        f"ssd_budget must be an integer >= 0, got {config.ssd_budget!r}",
    )
    require(
        config.ssd_critical_batch is None
        or (is_number(config.ssd_critical_batch) and config.ssd_critical_batch >= 0),
        f"ssd_critical_batch must be a number >= 0, got {config.ssd_critical_batch!r}",
    )
    require(
        is_number(config.saguaro_c) and 0 <= config.saguaro_c <= 1,
        f"saguaro_c must be in [0, 1], got {config.saguaro_c!r}",
    )
    require(
        config.synthetic is None or isinstance(config.synthetic, Synthetic),
        f"synthetic must be a Synthetic or None, got {config.synthetic!r}",
    )
    if config.synthetic is not None:
        config.synthetic.check(config.speculative_mode)
    if config.cpu_cores is not None:
        parse_core_sets(config.cpu_cores)  # a malformed spec fails here, naming itself
    require(
        config.speculative_mode == "ar" or config.model is None or config.draft_model is not None,
        f"speculative_mode={config.speculative_mode!r} needs draft_model when model is given",
    )


def unknown_option_message(key: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; valid options: {', '.join(valid)}"
    return f"unknown option {key!r}{hint}"
