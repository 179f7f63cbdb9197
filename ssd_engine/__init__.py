"""ssd_engine: exact speculative speculative decoding (SSD / Saguaro), CPU first."""

from typing import TYPE_CHECKING

__all__ = ["LLM", "SamplingParams", "RequestOutput", "RequestMetrics"]

# Imported on first use: child processes (`python -m ssd_engine.speculative.ssd.draft.main`) import this
# package before their entry point runs, and must reach it without first importing torch.
_HOMES = {
    "LLM": "ssd_engine.llm",
    "SamplingParams": "ssd_engine.core.sampling_params",
    "RequestOutput": "ssd_engine.core.outputs",
    "RequestMetrics": "ssd_engine.core.outputs",
}

if TYPE_CHECKING:
    from ssd_engine.core.outputs import RequestMetrics, RequestOutput
    from ssd_engine.core.sampling_params import SamplingParams
    from ssd_engine.llm import LLM


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'ssd_engine' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value
