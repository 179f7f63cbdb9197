"""A checker from outside the package, wrapped around each emulated CUDA graph's forward.

The emulation (`capture="emulate"`) calls the Python forward again at every replay, so it can pass
code a real graph breaks. The tests name a checker in SSD_ENGINE_GRAPH_CHECKER ("module:function",
read when a graph is made, inherited by spawned draft and tensor-parallel processes); the function
takes (forward, graph name) and returns the forward to replay. Unset: the forward runs as it is.
"""
import importlib
import os

CHECKER = "SSD_ENGINE_GRAPH_CHECKER"


def emulated_graph(forward, name: str):
    checker = os.environ.get(CHECKER, "")
    if not checker:
        return forward
    module, _, function = checker.partition(":")
    return getattr(importlib.import_module(module), function)(forward, name)
