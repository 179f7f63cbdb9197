"""ssd_engine: exact speculative speculative decoding (SSD / Saguaro), CPU first."""
from ssd_engine.llm import LLM
from ssd_engine.outputs import RequestMetrics, RequestOutput
from ssd_engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "RequestMetrics"]
