"""How fast this host runs three fixed workloads, measured before and after a benchmark.

The same machine kind has delivered anything from its full speed to a small fraction of it. On
2026-11-25 a 2-core Intel Xeon VM (AVX-512, AMX) ran, sustained over ~0.2 s of work, a one-thread
fp32 GEMM at 4-6 GFLOP/s, a memory copy at 0.4-0.5 GB/s and a Python loop at 1-11 M steps/s,
where in bursts of a few milliseconds it reached 150 GFLOP/s, 20 GB/s and 38 M steps/s; importing
torch took 105 s. Timings measured on such a host say little, and a ratio whose two sides ran at
different host speeds says less. So the benchmarks write these figures next to their machine
line: the reader sees a slowed host, and a run whose host changed speed while it ran is marked.
"""

import time
from dataclasses import asdict, dataclass

import torch

# Each figure times one sustained run of fixed work, about 0.2 s on a healthy host. Short intervals
# mislead: this host's vCPUs ran at full speed for a few milliseconds at a time and then stood still,
# so a median of 5 ms timings looked healthy while any 100 ms of work took 25x longer.
GEMM_SIZE, GEMM_RUNS = 512, 128  # fp32, one thread: compute-bound, like a verification's matmuls
COPY_BYTES, COPY_RUNS = (
    64 * 2**20,
    32,
)  # larger than any last-level cache: memory-bound, like a decode step
PYTHON_STEPS = 5_000_000  # interpreter-bound, like the engine's host work between steps
DRIFT = 0.2  # a figure that moved more than this between before and after marks the run


@dataclass(frozen=True)
class HostSpeed:
    gemm_gflops: float  # one-thread fp32 GEMM
    copy_gbps: float  # one-thread tensor copy, bytes read + written per second
    python_msteps: float  # million pure-Python loop steps per second


def _seconds(work, runs: int) -> float:
    work()  # outside the timing: allocation, page faults, kernel selection
    start = time.perf_counter()
    for _ in range(runs):
        work()
    return time.perf_counter() - start


def _python_loop() -> None:
    total = 0
    for step in range(PYTHON_STEPS):
        total += step


def measure() -> HostSpeed:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(GEMM_SIZE, GEMM_SIZE), torch.randn(GEMM_SIZE, GEMM_SIZE)
        source = torch.empty(COPY_BYTES // 4)
        target = torch.empty_like(source)
        gemm_s = _seconds(lambda: torch.mm(a, b), GEMM_RUNS)
        copy_s = _seconds(lambda: target.copy_(source), COPY_RUNS)
    finally:
        torch.set_num_threads(threads)
    start = time.perf_counter()
    _python_loop()
    python_s = time.perf_counter() - start
    return HostSpeed(
        gemm_gflops=GEMM_RUNS * 2 * GEMM_SIZE**3 / gemm_s / 1e9,
        copy_gbps=COPY_RUNS * 2 * COPY_BYTES / copy_s / 1e9,
        python_msteps=PYTHON_STEPS / python_s / 1e6,
    )


def drift(before: HostSpeed, after: HostSpeed) -> float:
    """The largest relative change of any figure between the two readings."""
    pairs = zip(asdict(before).values(), asdict(after).values())
    return max(abs(later - earlier) / earlier for earlier, later in pairs)


def describe(before: HostSpeed, after: HostSpeed) -> str:
    """One clause for a machine line: the three figures before / after the run."""
    text = (
        f"host speed before / after the run: fp32 GEMM {before.gemm_gflops:.1f} / {after.gemm_gflops:.1f} GFLOP/s, "
        f"copy {before.copy_gbps:.1f} / {after.copy_gbps:.1f} GB/s (1 thread), "
        f"Python {before.python_msteps:.1f} / {after.python_msteps:.1f} M loop steps/s"
    )
    moved = drift(before, after)
    if moved > DRIFT:
        text += f" (the host's speed moved {moved:.0%} while it ran: compare this run's figures with care)"
    return text


def as_dict(before: HostSpeed, after: HostSpeed) -> dict:
    return {"before": asdict(before), "after": asdict(after)}
