"""An optional checker wrapped around each emulated CUDA graph's forward, named by
SSD_ENGINE_GRAPH_CHECKER ("module:function" taking (forward, graph name), returning the forward)."""

import importlib
import os

CHECKER = "SSD_ENGINE_GRAPH_CHECKER"


def emulated_graph(forward, name: str):
    checker = os.environ.get(CHECKER, "")
    if not checker:
        return forward
    module, _, function = checker.partition(":")
    return getattr(importlib.import_module(module), function)(forward, name)
