"""Documented dataclass fields: each option's meaning, public name and valid values live on the field
itself (`option(default, help, choices, ...)`), so `--help` and the checks read the same place the
API does. A config's fields: options (each a flag and a keyword), hooks (keywords for benchmarks and
tests only), resolved values (derived from the options, never given) and sections (a frozen
dataclass of such fields)."""

import functools
from dataclasses import Field, field, fields

Path = tuple[str, ...]  # attribute names from a config down to one of its fields


def option(
    default,
    help: str,
    choices: tuple[str, ...] | None = None,
    *,
    name: str | None = None,
    at_least: float | None = None,
    above: float | None = None,
    at_most: float | None = None,
) -> Field:
    """A dataclass field with its one-line meaning. `choices`: the only valid values, if a closed set;
    `name`: its keyword and flag name where the field's own name is the engine's shorter one
    (`k` is `num_speculative_tokens`); `at_least` / `above` / `at_most`: its range, the kind of
    number (an integer, or any number) read off the field's type."""
    bounds = {"at_least": at_least, "above": above, "at_most": at_most}
    return field(
        default=default,
        metadata={"help": help, "choices": choices, "name": name, "bounds": bounds},
    )


def hook(help: str) -> Field:
    """A field for benchmarks and tests only: an LLM / EngineConfig keyword, never a command-line flag."""
    return field(default=None, metadata={"help": help, "choices": None, "hook": True})


def resolved(default, help: str) -> Field:
    """A value derived from the options (EngineConfig fills it), never a keyword or a flag."""
    return field(default=default, metadata={"help": help, "resolved": True})


def section(kind: type) -> Field:
    """A field holding a section of options (a frozen dataclass of them), its defaults by default."""
    return field(default_factory=kind, metadata={"section": True})


def is_section(f: Field) -> bool:
    return f.metadata.get("section", False)


def is_hook(f: Field) -> bool:
    return f.metadata.get("hook", False)


def is_resolved(f: Field) -> bool:
    return f.metadata.get("resolved", False)


def is_option(f: Field) -> bool:
    """An option or a hook: something a user (or a test) may set by its public name."""
    return "help" in f.metadata and not is_resolved(f)


def public_name(f: Field) -> str:
    """The keyword and flag name of option `f`: its declared `name`, else the field's own."""
    return f.metadata.get("name") or f.name


def help_of(f: Field) -> str:
    return f.metadata.get("help", "")


def choices_of(f: Field) -> tuple[str, ...] | None:
    return f.metadata.get("choices")


def bounds_of(f: Field) -> dict[str, float | None]:
    """{'at_least': ..., 'above': ..., 'at_most': ...}: None where the option declares no bound."""
    return f.metadata.get("bounds") or {}


@functools.cache
def option_fields(kind: type, path: Path = ()) -> dict[str, tuple[Path, Field]]:
    """Every option and hook of config class `kind`, its sections' included, by public name: (its
    path from the config, its field), in declaration order (the order of the CLI's flags). Cached:
    callers only read it."""
    found = {}
    for f in fields(kind):
        if is_section(f):
            found.update(option_fields(f.default_factory, path + (f.name,)))
        elif is_option(f):
            found[public_name(f)] = (path + (f.name,), f)
    return found


def value_at(config: object, path: Path) -> object:
    """The value at `path` (attribute names) below `config`."""
    for name in path:
        config = getattr(config, name)
    return config
