"""Hooks for benchmarks and tests, not user options: `LLM(..., synthetic=Synthetic(acceptance=0.7))`
draws draft acceptances (and, SSD, speculation-cache hits) at set rates, so a sweep runs on dummy
weights at chosen rates. No command-line flag sets them; outputs are then not the target's."""

from ssd_engine.core.synthetic_hook import Synthetic

__all__ = ["Synthetic"]
