"""Flags generated from EngineConfig's options and SamplingParams' fields, so the CLI maps 1:1 onto
them: an option's flag is its public name (core/options.py), whichever section declares it."""

import argparse
import difflib
import json
import sys
import types
import typing
from dataclasses import MISSING, fields

from ssd_engine.core.config import EngineConfig
from ssd_engine.core.options import choices_of, help_of, is_hook, option_fields
from ssd_engine.core.sampling_params import DEFAULTS_RULE, MODEL_DEFAULT_FIELDS, SamplingParams
from ssd_engine.core.structured_outputs import KINDS, StructuredOutputsParams

ALIASES = {
    "speculative_mode": ["--mode"],
    "num_speculative_tokens": ["--k"],
    "tensor_parallel_size": ["--tp"],
}
SAMPLING_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "max_tokens",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "min_tokens",
    "logprobs",
)


class ArgumentParser(argparse.ArgumentParser):
    """argparse that names the closest valid flag for an unknown one and exits with status 2."""

    def parse_args(self, args=None, namespace=None):
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            flag = unknown[0].split("=", 1)[0]
            valid = [s for a in self._actions for s in a.option_strings]
            close = difflib.get_close_matches(flag, valid, n=1)
            self.error(
                f"unknown option {flag!r}" + (f"; did you mean {close[0]!r}?" if close else "")
            )
        return parsed

    def error(self, message):
        self.exit(2, f"error: {message}\n")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _base_type(annotation):
    """int | None -> int; bool stays bool."""
    if isinstance(annotation, str):
        annotation = eval(annotation, {"list": list})  # dataclass annotations may be strings
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return _base_type(args[0])
    return annotation


def add_engine_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ("seed",)) -> None:
    """EngineConfig.seed is left out: on the command line --seed is the request's sampling seed.
    Every flag defaults to None (unset), so EngineConfig's defaults stay in one place."""
    group = parser.add_argument_group(
        "engine", "options of the engine (ssd_engine/core/config.py, EngineConfig)"
    )
    for name, (_, f) in option_fields(EngineConfig).items():
        if name in skip or is_hook(f):  # benchmarks' and tests' hooks are no flags
            continue
        names = [_flag(name)] + ALIASES.get(name, [])
        kind = _base_type(f.type)
        help = help_of(f) + ("" if f.default is None else f" (default: {_shown(f.default)})")
        if kind is bool:
            group.add_argument(
                *names, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help
            )
        elif choices_of(f):
            group.add_argument(
                *names, dest=name, type=kind, default=None, choices=choices_of(f), help=help
            )
        else:
            group.add_argument(
                *names, dest=name, type=kind, default=None, metavar=name.upper(), help=help
            )


def add_sampling_args(parser: argparse.ArgumentParser, defaults: dict | None = None) -> None:
    """`defaults` overrides SamplingParams' own (the CLI generates more than 16 tokens). temperature, top_p,
    top_k and min_p default to unset: sampling_params() gives them the model's defaults (DEFAULTS_RULE)."""
    group = parser.add_argument_group(
        "sampling", "per-request sampling (ssd_engine/core/sampling_params.py); " + DEFAULTS_RULE
    )
    for f in fields(SamplingParams):
        if f.name not in SAMPLING_FIELDS:
            continue
        if f.name in MODEL_DEFAULT_FIELDS and f.name not in (defaults or {}):
            default, shown = (
                None,
                f" (default: the model's generation_config.json value, else {f.default})",
            )
        else:
            default = (defaults or {}).get(f.name, None if f.default is MISSING else f.default)
            shown = "" if default is None else " (default: %(default)s)"
        help = help_of(f) + shown
        if f.name == "ignore_eos":
            group.add_argument(_flag(f.name), action="store_true", default=default, help=help_of(f))
        elif f.name == "logit_bias":
            group.add_argument(
                _flag(f.name), type=_json_object, default=None, metavar="JSON", help=help
            )
        elif f.name in ("stop", "stop_token_ids"):
            group.add_argument(
                _flag(f.name),
                action="append",
                type=int if f.name == "stop_token_ids" else str,
                default=None,
                metavar=f.name.upper(),
                help=help,
            )
        else:
            group.add_argument(
                _flag(f.name),
                type=_base_type(f.type),
                default=default,
                metavar=f.name.upper(),
                help=help,
            )
    _add_structure_args(group)


def _add_structure_args(group) -> None:
    """--structured-outputs-KIND, one per StructuredOutputsParams field (a file's text with @PATH)."""
    group.add_argument(
        "--structured-outputs-json",
        type=_text_or_file,
        metavar="SCHEMA",
        help="the output is JSON matching this JSON schema (its text, or @PATH)",
    )
    group.add_argument(
        "--structured-outputs-json-object",
        action="store_true",
        default=None,
        help="the output is a JSON object",
    )
    group.add_argument(
        "--structured-outputs-regex", metavar="REGEX", help="the output matches this regex"
    )
    group.add_argument(
        "--structured-outputs-choice",
        action="append",
        metavar="TEXT",
        help="the output is one of these strings (repeat for each)",
    )
    group.add_argument(
        "--structured-outputs-grammar",
        type=_text_or_file,
        metavar="EBNF",
        help="the output follows this EBNF grammar, rule `root` (its text, or @PATH)",
    )


def _text_or_file(value: str) -> str:
    if not value.startswith("@"):
        return value
    try:
        with open(value[1:]) as f:
            return f.read()
    except OSError as error:
        raise argparse.ArgumentTypeError(f"cannot read {value[1:]}: {error.strerror}") from None


def _structure(args: argparse.Namespace) -> StructuredOutputsParams | None:
    given = {kind: getattr(args, f"structured_outputs_{kind}", None) for kind in KINDS}
    given = {kind: value for kind, value in given.items() if value is not None}
    return StructuredOutputsParams(**given) if given else None


def _json_object(text: str) -> dict:
    """--logit-bias '{"50256": -100}'"""
    try:
        value = json.loads(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _shown(default) -> str:
    return str(default).lower() if isinstance(default, bool) else str(default)


def engine_options(args: argparse.Namespace) -> dict:
    """Only the engine flags the user set, so EngineConfig's defaults stay in one place."""
    names = set(option_fields(EngineConfig)) - {"seed"}
    return {k: v for k, v in vars(args).items() if k in names and v is not None}


def sampling_params(
    args: argparse.Namespace, defaults: SamplingParams | None = None
) -> SamplingParams:
    """The flags given; an unset one takes `defaults` (`LLM.get_default_sampling_params()`, the model's),
    else SamplingParams' own (what checks the flags before any model loads)."""
    return SamplingParams.from_optional(
        defaults,
        **{k: getattr(args, k) for k in SAMPLING_FIELDS if hasattr(args, k)},
        structured_outputs=_structure(args),
    )


def describe_engine(llm) -> str:
    """The `[engine]` line both CLIs print: how the engine runs (mode chosen with its predictions, formats)."""
    return "[engine] " + " ".join(f"{key}={value}" for key, value in llm.engine.execution().items())


def fail(message: str) -> typing.NoReturn:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)
