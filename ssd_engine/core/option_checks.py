"""EngineConfig's value checks, in one place: each option's declared choices and range (core/options.py
`option`), and option combinations that cannot run."""

import difflib
import typing
from dataclasses import Field

from ssd_engine.core.core_sets import parse_core_sets
from ssd_engine.core.option_choices import FANOUT_RULES
from ssd_engine.core.options import bounds_of, choices_of, option_fields, value_at
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
    (`option(..., choices)`), or unset where its default is (speculative_mode), and a device torch
    names."""
    for name, (path, f) in option_fields(type(config)).items():
        value, choices = value_at(config, path), choices_of(f)
        require(
            choices is None or value in choices or (value is None and f.default is None),
            f"{name} must be one of {choices}, got {value!r}",
        )
    device = config.model.device
    require(
        device == "cpu" or device.startswith("cuda"),
        f"device must be 'cpu' or 'cuda[:N]', got {device!r}",
    )


def check_range(name: str, f: Field, value) -> None:
    """`value` of option `name` (field `f`) of the kind its type declares (an integer, or any
    number) and within the bounds it declares; None where its type allows it."""
    bounds = {k: v for k, v in bounds_of(f).items() if v is not None}
    if not bounds:
        return
    kinds = typing.get_args(f.type) or (f.type,)
    if value is None and type(None) in kinds:
        return
    integer = int in kinds and float not in kinds
    low, above, high = bounds.get("at_least"), bounds.get("above"), bounds.get("at_most")
    ok = (is_int(value) if integer else is_number(value)) and (
        (low is None or value >= low)
        and (above is None or value > above)
        and (high is None or value <= high)
    )
    if low is not None and high is not None:
        wanted = f"in [{low:g}, {high:g}]"
    else:
        limits = [
            f"{sign} {bound:g}"
            for sign, bound in ((">=", low), (">", above), ("<=", high))
            if bound is not None
        ]
        wanted = f"{'an integer' if integer else 'a number'} " + " and ".join(limits)
    require(ok, f"{name} must be {wanted}, got {value!r}")


def check_values(config) -> None:
    """A ValueError naming the first option of EngineConfig `config` (its closed sets of values
    already checked, its defaults filled in) whose value, or combination with another, cannot run."""
    model, speculative, parallel = config.model, config.speculative, config.parallel
    require(
        not (model.compile_model == "on" and parallel.tensor_parallel_size > 1),
        "compile_model='on' needs tensor_parallel_size=1: tensor parallelism's all-reduces are not compiled",
    )
    require(
        not (model.fused_kernels == "on" and config.compiled),
        "fused_kernels='on' and compile_model='on' are two ways to fuse a layer's ops: choose one",
    )
    for name, (path, f) in option_fields(type(config)).items():
        check_range(name, f, value_at(config, path))
    require(
        model.device == "cpu" or speculative.draft_dtype not in ("int8", "int4", "q4k"),
        f"draft_dtype={speculative.draft_dtype} is CPU-only; on {model.device} use auto, bf16 or fp32",
    )
    require(
        model.device == "cpu" or model.target_dtype not in ("gguf", "gguf-int8", "int8", "int4"),
        f"target_dtype={model.target_dtype} is CPU-only; on {model.device} use fp32 or bf16",
    )
    parse_fanout(speculative.ssd.fanout, speculative.k)  # validates
    synthetic = speculative.synthetic
    require(
        synthetic is None or isinstance(synthetic, Synthetic),
        f"synthetic must be a Synthetic or None, got {synthetic!r}",
    )
    if synthetic is not None:
        synthetic.check(speculative.mode)
    if parallel.cpu_cores is not None:
        parse_core_sets(parallel.cpu_cores)  # a malformed spec fails here, naming itself
    require(
        speculative.mode == "ar" or model.path is None or speculative.draft_model is not None,
        f"speculative_mode={speculative.mode!r} needs draft_model when model is given",
    )


def unknown_option_message(key: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; valid options: {', '.join(valid)}"
    return f"unknown option {key!r}{hint}"
