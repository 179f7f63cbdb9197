"""EngineConfig validation, from_kwargs' unknown-option message, the CLI flag mapping and its help."""

import argparse
import dataclasses

import pytest

from ssd_engine.cli_args import (
    ArgumentParser,
    add_engine_args,
    add_sampling_args,
    engine_options,
    sampling_params,
)
from ssd_engine.core.config import EngineConfig, option_names
from ssd_engine.core.options import help_of, is_hook, is_option, is_section, option_fields
from ssd_engine.core.sampling_params import SamplingParams
from ssd_engine.generate import build_parser
from ssd_engine.testing import Synthetic


def test_defaults_are_valid_and_frozen():
    config = EngineConfig()
    assert (
        config.speculative.mode == "auto" and config.model.path is None
    )  # the built-in pair: the fastest mode
    assert EngineConfig.from_kwargs(model="/t").speculative.mode == "ar"  # a target alone: no draft
    assert EngineConfig.from_kwargs(model="/t", draft_model="/d").speculative.mode == "auto"
    ssd = config.speculative.ssd
    assert (
        ssd.fanout_counts is None and ssd.fanout_rule == "auto" and ssd.fallback == "auto"
    )  # Saguaro: resolved from the calibration
    counts = EngineConfig.from_kwargs(ssd_fanout="2").speculative.ssd.fanout_counts
    assert counts == (2,) * (config.speculative.k + 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.cache.block_size = 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.cache = None


def test_each_option_is_declared_once_in_its_section():
    """Public names are unique across the sections (each is one keyword and one flag), and every
    field of a section is an option, a hook, a resolved value or a section."""
    declared = []

    def walk(kind):
        for f in dataclasses.fields(kind):
            if is_section(f):
                walk(f.default_factory)
            elif is_option(f):
                declared.append(f)
            else:
                assert f.metadata.get("resolved"), f"{kind.__name__}.{f.name} is undeclared"

    walk(EngineConfig)
    assert len(declared) == len(option_fields(EngineConfig))
    assert option_names() == [f for f in option_fields(EngineConfig) if f != "synthetic"]
    assert option_fields(EngineConfig)["num_speculative_tokens"][0] == ("speculative", "k")
    assert option_fields(EngineConfig)["ssd_fanout"][0] == ("speculative", "ssd", "fanout")


def test_options_are_replaced_by_their_public_names_and_checked_again():
    config = EngineConfig.from_kwargs(ssd_fanout=3)
    longer = config.with_options(num_speculative_tokens=6, max_num_seqs=2)
    assert (longer.speculative.k, longer.scheduler.max_num_seqs) == (6, 2)
    assert longer.speculative.ssd.fanout_counts == (3,) * 7  # resolved again for the new K
    assert config.speculative.k == 4 and longer.option_value("ssd_fanout") == 3
    with pytest.raises(ValueError, match="max_num_seqs"):
        config.with_options(max_num_seqs=0)
    with pytest.raises(ValueError, match="did you mean 'max_num_seqs'"):
        config.with_options(max_num_seq=2)
    with pytest.raises(ValueError, match="unknown option 'weight_layout'"):
        EngineConfig.from_kwargs(weight_layout="dual")  # a resolved value is never given


def test_derived_values_are_resolved_from_the_options():
    model = EngineConfig.from_kwargs(enforce_eager=True, compile_model="on").model
    assert (model.weight_layout, model.graph_max_batch, model.compile) == ("plain", 0, False)
    model = EngineConfig.from_kwargs(cpu_weight_layout="dual", cuda_graph_max_batch=8).model
    assert (model.weight_layout, model.graph_max_batch, model.dtype) == ("dual", 8, "float32")
    cuda = EngineConfig.from_kwargs(device="cuda", compile_model="on")
    assert (cuda.model.weight_layout, cuda.model.dtype, cuda.model.compile) == (
        "plain",
        "bfloat16",
        True,
    )
    assert cuda.scheduler.max_num_batched_tokens == 2048


def test_with_options_decides_the_resolved_options_again():
    """dtype, max_num_batched_tokens and speculative_mode keep what was given (unset / auto); the
    decision beside them follows a new device or model, and a given value is kept."""
    cpu = EngineConfig()
    cuda = cpu.with_options(device="cuda")
    assert (cpu.model.dtype, cpu.scheduler.max_num_batched_tokens) == ("float32", 512)
    assert (cuda.model.dtype, cuda.scheduler.max_num_batched_tokens) == ("bfloat16", 2048)
    assert cuda.with_options(device="cpu") == cpu
    assert [cuda.option_value(n) for n in ("dtype", "max_num_batched_tokens")] == ["auto", None]
    given = cpu.with_options(dtype="float16", max_num_batched_tokens=64).with_options(device="cuda")
    assert (given.model.dtype, given.scheduler.max_num_batched_tokens) == ("float16", 64)
    target = EngineConfig.from_kwargs(model="/t")
    assert target.speculative.mode == "ar" and target.option_value("speculative_mode") is None
    assert target.with_options(draft_model="/d").speculative.mode == "auto"
    assert target.with_options(draft_model="/d", speculative_mode="sd").speculative.mode == "sd"


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(speculative_mode="medusa"), "speculative_mode"),
        (dict(dtype="int8"), "dtype"),
        (dict(cpu_weight_layout="fancy"), "cpu_weight_layout"),
        (dict(device="tpu"), "device"),
        (dict(num_speculative_tokens=0), "num_speculative_tokens"),
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(max_num_batched_tokens=-5), "max_num_batched_tokens"),
        (dict(block_size=0), "block_size"),
        (dict(block_size=4.0), "block_size"),
        (dict(max_model_len=0), "max_model_len"),
        (dict(num_kv_blocks=-1), "num_kv_blocks"),
        (dict(num_threads=0), "num_threads"),
        (dict(kv_cache_memory_gb=0), "kv_cache_memory_gb"),
        (dict(model="/some/target", speculative_mode="sd"), "draft_model"),
        (dict(ssd_fanout="1,2"), "ssd_fanout"),
        (dict(ssd_fanout=-1), "ssd_fanout"),
        (dict(ssd_fallback="ngram"), "ssd_fallback"),
        (dict(ssd_fanout="geometrik"), "ssd_fanout"),
        (dict(ssd_budget=-1), "ssd_budget"),
        (dict(saguaro_c=1.5), "saguaro_c"),
        (dict(ssd_critical_batch=-2), "ssd_critical_batch"),
        (dict(draft_timeout_s=0), "draft_timeout_s"),
        (dict(max_decode_stall=1), "max_decode_stall"),
        (dict(max_decode_stall="2"), "max_decode_stall"),
    ],
)
def test_invalid_values_raise_one_line_value_error(kwargs, needle):
    with pytest.raises(ValueError) as info:
        EngineConfig.from_kwargs(**kwargs)
    message = str(info.value)
    assert needle in message and "\n" not in message
    with pytest.raises(ValueError):
        EngineConfig().with_options(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(device="cuda"),
        dict(device="cuda:1"),
        dict(dtype="bfloat16"),
        dict(max_model_len=None),
        dict(speculative_mode="ssd"),  # no model -> the built-in default pair
        dict(max_decode_stall=2),
        dict(max_decode_stall=1.5),
        dict(model="/t", draft_model="/d", speculative_mode="sd", num_speculative_tokens=1),
    ],
)
def test_valid_values_are_accepted(kwargs):
    config = EngineConfig.from_kwargs(**kwargs)
    for key, value in kwargs.items():
        assert config.option_value(key) == value


def test_from_kwargs_unknown_option_names_closest():
    with pytest.raises(ValueError) as info:
        EngineConfig.from_kwargs(max_model_length=64)
    message = str(info.value)
    assert "'max_model_length'" in message and "'max_model_len'" in message and "\n" not in message

    with pytest.raises(ValueError, match="num_kv_blocks"):
        EngineConfig.from_kwargs(num_kv_block=3)

    with pytest.raises(ValueError) as info:  # nothing close: list the valid options
        EngineConfig.from_kwargs(zzzz=1)
    assert "'zzzz'" in str(info.value)
    assert all(name in str(info.value) for name in option_names())
    assert "synthetic" not in str(info.value)  # a hook is a keyword, not a public option


# ---- CLI -----------------------------------------------------------------------------------------
def _engine_parser():
    parser = ArgumentParser(prog="t", allow_abbrev=False)
    add_engine_args(parser)
    return parser


def _option_dest_map(parser):
    return {s: a.dest for a in parser._actions for s in a.option_strings}


def test_every_engine_field_but_seed_has_a_flag():
    flags = _option_dest_map(_engine_parser())
    hooks = {name for name, (_, f) in option_fields(EngineConfig).items() if is_hook(f)}
    for name in option_fields(EngineConfig):
        flag = "--" + name.replace("_", "-")
        if name == "seed" or name in hooks:
            assert (
                flag not in flags
            )  # --seed is the request's sampling seed on the CLI; hooks have none
        else:
            assert flags.get(flag) == name
    assert flags["--mode"] == "speculative_mode"
    assert flags["--k"] == "num_speculative_tokens"


def test_generate_parser_has_engine_and_sampling_flags():
    flags = _option_dest_map(build_parser())
    for name in set(option_names()) - {"seed"}:
        assert flags["--" + name.replace("_", "-")] == name
    for name in (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "max_tokens",
        "stop",
        "stop_token_ids",
        "ignore_eos",
    ):
        assert flags["--" + name.replace("_", "-")] == name


# non-default values for string fields whose valid values are constrained
STRING_VALUES = {
    "speculative_mode": "ssd",
    "dtype": "bfloat16",
    "device": "cuda:1",
    "cpu_weight_layout": "packed",
    "cpu_cores": "0-1;2",
    "ssd_fanout": "2",
    "ssd_fallback": "fast",
    "attention_backend": "torch",
    "draft_dtype": "bf16",
    "target_dtype": "bf16",
    "load_format": "dummy",
    "compile_model": "off",
    "fused_kernels": "off",
    "ssd_draft_host": "thread",
    "speculation_per_step": "off",
}


def _non_default_argv(name, f):
    """(argv, expected value) that sets option `name` (field `f`) to a valid non-default value
    through its flag."""
    flag = "--" + name.replace("_", "-")
    default = f.default
    kind = type(default) if default is not None else None
    if kind is bool:
        return ([flag] if not default else ["--no-" + name.replace("_", "-")]), not default
    if kind is float:
        return [flag, str(default / 2)], default / 2
    if default is None and str(f.type).startswith("float"):
        return [flag, "3.0"], 3.0
    if kind is int or (default is None and "int" in str(f.type)):
        value = (default or 2) + 1
        return [flag, str(value)], value
    value = STRING_VALUES.get(name, f"/path/{name}" if default is None else default)
    return [flag, value], value


def test_flags_map_onto_config_fields_one_to_one():
    argv, expected = [], {}
    for name, (_, f) in option_fields(EngineConfig).items():
        if name == "seed" or is_hook(f):
            continue
        args, value = _non_default_argv(name, f)
        argv += args
        expected[name] = value
    options = engine_options(_engine_parser().parse_args(argv))
    assert options == expected
    config = EngineConfig.from_kwargs(**options)  # every value passes validation
    for key, value in expected.items():
        assert config.option_value(key) == value
        assert value != EngineConfig().option_value(key)  # each flag really changed its field

    aliases = _engine_parser().parse_args(["--mode", "ssd", "--k", "6"])
    long_names = _engine_parser().parse_args(
        ["--speculative-mode", "ssd", "--num-speculative-tokens", "6"]
    )
    assert (
        engine_options(aliases)
        == engine_options(long_names)
        == dict(speculative_mode="ssd", num_speculative_tokens=6)
    )


def test_a_hook_is_a_keyword_and_no_flag():
    hooks = [name for name, (_, f) in option_fields(EngineConfig).items() if is_hook(f)]
    assert hooks == ["synthetic"]
    with pytest.raises(SystemExit):
        _engine_parser().parse_args(["--synthetic", "0.5"])
    assert (
        EngineConfig.from_kwargs(
            synthetic=Synthetic(acceptance=0.5)
        ).speculative.synthetic_acceptance
        == 0.5
    )


def test_unset_flags_leave_config_defaults():
    options = engine_options(_engine_parser().parse_args([]))
    assert options == {}
    assert EngineConfig.from_kwargs(**options) == EngineConfig()


def test_sampling_flags_build_sampling_params():
    parser = ArgumentParser(prog="t", allow_abbrev=False)
    add_sampling_args(parser, defaults={"max_tokens": 128, "temperature": 0.0})
    params = sampling_params(parser.parse_args([]))
    assert (
        params.max_tokens == 128
        and params.temperature == 0.0
        and params.stop == []
        and not params.ignore_eos
    )
    params = sampling_params(
        parser.parse_args(
            [
                "--temperature",
                "0.7",
                "--top-p",
                "0.9",
                "--top-k",
                "20",
                "--min-p",
                "0.05",
                "--seed",
                "3",
                "--max-tokens",
                "9",
                "--stop",
                "\n\n",
                "--stop",
                "END",
                "--stop-token-ids",
                "5",
                "--stop-token-ids",
                "6",
                "--ignore-eos",
            ]
        )
    )
    assert (
        params.temperature,
        params.top_p,
        params.top_k,
        params.min_p,
        params.seed,
        params.max_tokens,
    ) == (0.7, 0.9, 20, 0.05, 3, 9)
    assert params.stop == ["\n\n", "END"] and params.stop_token_ids == [5, 6] and params.ignore_eos


def test_unknown_flag_names_closest_and_exits_2(capsys):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["--max-model-length", "64"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--max-model-length" in err and "'--max-model-len'" in err
    assert err.count("\n") == 1 and err.startswith("error:")

    with pytest.raises(SystemExit) as info:  # no abbreviations: a prefix is not silently accepted
        build_parser().parse_args(["--max-model", "64"])
    assert info.value.code == 2

    with pytest.raises(SystemExit) as info:  # a bad value is also exit 2
        build_parser().parse_args(["--block-size", "four"])
    assert info.value.code == 2


def test_every_field_is_documented_where_the_help_reads_it():
    engine = [f for _, f in option_fields(EngineConfig).values()]
    for f in engine + list(dataclasses.fields(SamplingParams)):
        assert help_of(f).strip(), f"{f.name} has no help"


def test_help_gives_every_flag_a_description_default_and_choices():
    parser = build_parser()
    by_dest = {a.dest: a for a in parser._actions}
    for action in parser._actions:
        assert action.help and action.help != argparse.SUPPRESS, (
            f"{action.option_strings} has no description"
        )
    for name, (_, f) in option_fields(EngineConfig).items():
        if name == "seed" or is_hook(f):
            continue
        text = by_dest[name].help
        # a field without a default says what leaving it unset means instead
        assert (
            ("unset" in text)
            if f.default is None
            else (f"(default: {str(f.default).lower()})" in text.lower())
        )
    help_text = " ".join(parser.format_help().split())  # argparse wraps lines; compare unwrapped
    for needle in (
        "--speculative-mode {auto,ar,sd,ssd}, --mode {auto,ar,sd,ssd}",
        "K: draft tokens per round (default: 4)",
        "--dtype {auto,float32,bfloat16,float16}",
        "--ssd-fallback {auto,jit,fast}",
        "most tokens to generate (default: 128)",
        "Exit status",
        "(default: the model's generation_config.json value, else 1.0)",
        "--temperature 0 gives the greedy",
    ):
        assert needle in help_text, needle


def test_a_value_outside_the_choices_is_one_error_line(capsys):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["--mode", "fast"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1 and "'auto', 'ar', 'sd', 'ssd'" in err
