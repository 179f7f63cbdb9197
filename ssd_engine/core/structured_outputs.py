"""What a request's output must match (vLLM's `StructuredOutputsParams`): a JSON schema, any JSON
object, a regex, one of a list of strings, or an EBNF grammar. Exactly one is set. The grammar is
compiled and applied by sampling/grammar.py; here only its shape is checked."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict | None = None  # a JSON schema (a dict or its text)
    json_object: bool = False  # any JSON object (OpenAI's response_format json_object)
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None  # EBNF (GBNF), root rule `root`

    def __post_init__(self) -> None:
        given = [name for name in KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs must set exactly one of {', '.join(KINDS)}; got "
                f"{', '.join(given) or 'none'}"
            )
        if isinstance(self.json, dict):
            object.__setattr__(self, "json", json.dumps(self.json))
        elif self.json is not None and not isinstance(self.json, str):
            raise ValueError(
                f"structured_outputs.json must be a JSON schema (an object or its text), got {self.json!r}"
            )
        if self.choice is not None:
            if (
                isinstance(self.choice, str)
                or not all(isinstance(c, str) for c in self.choice)
                or not self.choice
            ):
                raise ValueError(
                    f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}"
                )
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(
                    f"structured_outputs.{name} must be a non-empty string, got {value!r}"
                )

    @property
    def kind(self) -> str:
        return next(name for name in KINDS if getattr(self, name) not in (None, False))

    @property
    def key(self) -> tuple:
        """What identifies the compiled grammar (its cache key)."""
        return self.kind, getattr(self, self.kind)

    @classmethod
    def of(cls, value: StructuredOutputsParams | dict | None) -> StructuredOutputsParams | None:
        """A request's value as given: the params, a dict of their fields (JSON bodies, the CLI), or None."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(
                f"structured_outputs must be an object with one of {', '.join(KINDS)}, got {value!r}"
            )
        unknown = set(value) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(
                f"structured_outputs has unknown field(s) {', '.join(sorted(unknown))}; "
                f"expected one of {', '.join(KINDS)}"
            )
        return cls(**value)
