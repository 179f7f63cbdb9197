"""Hooks for benchmarks and tests, not user options: no command-line flag sets them.

- `LLM(..., synthetic=Synthetic(acceptance=0.7))` draws draft acceptances (and, SSD, speculation-cache
  hits) at set rates, so a sweep runs on dummy weights at chosen rates; outputs are then not the target's.
- The environment switches the engine's processes inherit (utils/test_hooks.py): CUDA graphs emulated
  on a CPU, a checker around each emulated graph, the compiled CPU kernels switched off."""

from ssd_engine.core.synthetic_hook import Synthetic
from ssd_engine.utils.test_hooks import (
    EMULATE_CUDA_GRAPHS,
    GRAPH_CHECKER,
    NO_GGUF_KERNEL,
    checked_graph,
    emulated_cuda_graphs,
)

__all__ = [
    "EMULATE_CUDA_GRAPHS",
    "GRAPH_CHECKER",
    "NO_GGUF_KERNEL",
    "Synthetic",
    "checked_graph",
    "emulated_cuda_graphs",
]
