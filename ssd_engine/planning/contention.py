"""Time one SSD side while a neighbour on the other side's cores decodes as that side does.

Decoding is bandwidth-bound and cores share the memory bus. The neighbour is a child process looping
the matrix-vector product that dominates a decode step; it exits with the block or its parent."""

import contextlib
import subprocess
import sys

_NEIGHBOUR = """
import os, sys
cores = [int(c) for c in sys.argv[1].split(",")]
os.sched_setaffinity(0, cores)
import torch
torch.set_num_threads(len(cores))
dtype = getattr(torch, sys.argv[2])
weight = torch.ones(2**28 // (2048 * dtype.itemsize), 2048, dtype=dtype)  # 256 MB: larger than any cache
row = torch.ones(1, 2048, dtype=dtype)
parent = os.getppid()
print("ready", flush=True)
while os.getppid() == parent:
    torch.nn.functional.linear(row, weight)
"""


@contextlib.contextmanager
def memory_traffic(cores: list[int], dtype: str = "bfloat16"):
    """A neighbour on `cores` decoding with `dtype` weights for as long as the block lasts."""
    child = subprocess.Popen(
        [sys.executable, "-c", _NEIGHBOUR, ",".join(map(str, cores)), dtype],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        child.stdout.readline()  # "ready": its matrix is allocated and it streams from now on
        yield child.pid
    finally:
        child.terminate()
        child.wait()
        child.stdout.close()
