"""The engine's switches for tests and benchmarks, in one place. They are environment variables, so
the processes an engine starts (tensor-parallel ranks, the SSD draft) inherit them; no command-line
flag or `LLM` option sets them, and users have no reason to. `ssd_engine.testing` is their front door.

- SSD_ENGINE_EMULATE_CUDA_GRAPHS=1: runners built on a CPU take the CUDA-graph path (the same static
  buffers, padding rows and replays, no CUDA), read as each runner is built; 0 or unset: none on CPU.
- SSD_ENGINE_GRAPH_CHECKER="module:function": a checker wrapped around each emulated graph's forward,
  called as function(forward, graph name) and returning the forward to run; unset: none.
- SSD_ENGINE_NO_GGUF_KERNEL=1: the compiled CPU kernels count as unavailable, as on a machine without
  a C++ compiler, so the paths that stand in for them run."""

import importlib
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

EMULATE_CUDA_GRAPHS = "SSD_ENGINE_EMULATE_CUDA_GRAPHS"
GRAPH_CHECKER = "SSD_ENGINE_GRAPH_CHECKER"
NO_GGUF_KERNEL = "SSD_ENGINE_NO_GGUF_KERNEL"


def emulating_cuda_graphs() -> bool:
    return os.environ.get(EMULATE_CUDA_GRAPHS) == "1"


@contextmanager
def emulated_cuda_graphs(on: bool = True) -> Iterator[None]:
    """Runners built inside emulate CUDA graphs (on) or build none on CPU (off)."""
    saved = os.environ.get(EMULATE_CUDA_GRAPHS)
    os.environ[EMULATE_CUDA_GRAPHS] = "1" if on else "0"
    try:
        yield
    finally:
        os.environ.pop(EMULATE_CUDA_GRAPHS)
        if saved is not None:
            os.environ[EMULATE_CUDA_GRAPHS] = saved


def checked_graph(forward: Callable, name: str) -> Callable:
    """An emulated graph's forward, wrapped by the checker GRAPH_CHECKER names (unset: as it is)."""
    checker = os.environ.get(GRAPH_CHECKER, "")
    if not checker:
        return forward
    module, _, function = checker.partition(":")
    return getattr(importlib.import_module(module), function)(forward, name)


def gguf_kernel_switched_off() -> bool:
    return os.environ.get(NO_GGUF_KERNEL, "") not in ("", "0")
