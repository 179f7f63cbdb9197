"""Time the SSD target while its neighbour streams memory, as the SSD draft does all round.

Decoding is bandwidth-bound and cores share the memory bus: on the 2-core AMD EPYC VM of
2026-11-23 one core summing 256 MB took 11.5 ms alone and 17.2 ms while the other core did the
same, and a verification ran 1.11x slower with the draft working beside it
(benchmarks/results/2026-11-23-contention.md). How much depends on the machine.
So the SSD target's cost is measured under load:
a child process pinned to the draft's cores sums a buffer larger than any cache, in a loop, for
as long as the `memory_traffic` block lasts. It exits when the block ends or, should this process
die first, when it finds its parent gone.
"""
import contextlib
import subprocess
import sys

_STREAMER = """
import os, sys
cores = [int(c) for c in sys.argv[1].split(",")]
os.sched_setaffinity(0, cores)
import torch
torch.set_num_threads(len(cores))
parent = os.getppid()
buffer = torch.ones(64 * 2**20)  # 256 MB of fp32
print("ready", flush=True)
while os.getppid() == parent:
    buffer.sum()
"""


@contextlib.contextmanager
def memory_traffic(cores: list[int]):
    child = subprocess.Popen([sys.executable, "-c", _STREAMER, ",".join(map(str, cores))],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        child.stdout.readline()  # "ready": its buffer is allocated and it streams from now on
        yield child.pid
    finally:
        child.terminate()
        child.wait()
        child.stdout.close()
