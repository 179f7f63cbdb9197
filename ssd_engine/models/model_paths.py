"""Resolve `model` / `draft_model` options to model folders."""

from ssd_engine.core.config import EngineConfig
from ssd_engine.models.default_models import resolve_default_model
from ssd_engine.models.gguf_files import is_gguf_file, resolve_gguf


def resolve_model_arg(value: str | None, which: str = "target") -> str:
    """The folder a `model` / `draft_model` value names: a folder as given, a GGUF file converted
    once into the cache, None the built-in pair's `which` ('target' or 'draft')."""
    if value is None:
        return resolve_default_model(which)
    return resolve_gguf(value) if is_gguf_file(value) else value


def resolve_model_path(config: EngineConfig, which: str = "target") -> str:
    """The folder of EngineConfig `config`'s target or draft (`which`), as resolve_model_arg
    resolves it."""
    given = config.model.path if which == "target" else config.speculative.draft_model
    return resolve_model_arg(given, which)
