"""Documented dataclass fields: each option's meaning and valid values live on the field itself
(`option(default, help, choices)`), so `--help` is generated from the same place the API reads."""

from dataclasses import Field, field


def option(default, help: str, choices: tuple[str, ...] | None = None) -> Field:
    """A dataclass field with its one-line meaning; `choices`: the only valid values, if a closed set."""
    return field(default=default, metadata={"help": help, "choices": choices})


def hook(help: str) -> Field:
    """A field for benchmarks and tests only: an LLM / EngineConfig keyword, never a command-line flag."""
    return field(default=None, metadata={"help": help, "choices": None, "hook": True})


def is_hook(f: Field) -> bool:
    return f.metadata.get("hook", False)


def help_of(f: Field) -> str:
    return f.metadata.get("help", "")


def choices_of(f: Field) -> tuple[str, ...] | None:
    return f.metadata.get("choices")
