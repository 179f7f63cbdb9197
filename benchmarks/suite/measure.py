"""One measurement cell (mode x prompt set x batch size x K) from per-request timings.

Every engine reports, per request, seconds from the batch's start to its first output token
(TTFT) and to its end (latency), and how many tokens it produced. Decode throughput excludes
prefill as the paper's does: per batch, the tokens after each request's first one divided by
the time from the batch's last first token to its end.
"""

import os
import resource
from dataclasses import dataclass


@dataclass
class Request:
    ttft_s: float
    latency_s: float
    tokens: int
    token_ids: list[int]


def batches(prompts: list[str], batch: int) -> list[list[str]]:
    """The prompts in batches of exactly `batch`, cycling through the set when it is smaller than
    a batch (so every batch is full: a batch-size sweep never measures a half-empty batch)."""
    count = -(-max(len(prompts), batch) // batch) * batch
    cycled = [prompts[i % len(prompts)] for i in range(count)]
    return [cycled[i : i + batch] for i in range(0, count, batch)]


def cell(requests_by_batch: list[list[Request]], wall_s: float) -> dict:
    """Aggregate one cell's requests: decode tok/s (no prefill), e2e tok/s, mean TTFT / TPOT / latency."""
    flat = [r for batch in requests_by_batch for r in batch]
    decode_tokens = sum(max(r.tokens - 1, 0) for r in flat)
    decode_s = sum(
        max(r.latency_s for r in batch) - max(r.ttft_s for r in batch)
        for batch in requests_by_batch
    )
    tpots = [(r.latency_s - r.ttft_s) / (r.tokens - 1) for r in flat if r.tokens > 1]
    tokens = sum(r.tokens for r in flat)
    return {
        "requests": len(flat),
        "tokens": tokens,
        "wall_s": wall_s,
        "decode_tok_s": decode_tokens / decode_s if decode_s > 0 else 0.0,
        "e2e_tok_s": tokens / wall_s if wall_s > 0 else 0.0,
        "ttft_s": sum(r.ttft_s for r in flat) / len(flat),
        "tpot_s": sum(tpots) / len(tpots) if tpots else None,
        "latency_s": sum(r.latency_s for r in flat) / len(flat),
        "outputs": [r.token_ids for r in flat],
    }


def vm_hwm_gb(pid: int) -> float | None:
    """Peak resident memory of a live process (VmHWM), in GB; None when it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/status") as f:
            line = next(line for line in f if line.startswith("VmHWM:"))
        return int(line.split()[1]) / 2**20
    except (OSError, StopIteration, ValueError):
        return None


def own_peak_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def engine_peaks(llm) -> dict[str, float]:
    """Peak memory of every process one of our engines runs: this one, the SSD draft process, the
    tensor-parallel workers (read while they live), and on CUDA the GPU memory this process allocated."""
    peaks = {"engine": own_peak_gb()}
    draft_pid = getattr(llm.engine.speculator, "pid", None)
    if draft_pid is not None and (gb := vm_hwm_gb(draft_pid)) is not None:
        peaks["draft process"] = gb
    for rank, process in getattr(llm.engine.runner, "processes", {}).items():
        if (gb := vm_hwm_gb(process.pid)) is not None:
            peaks[f"TP rank {rank}"] = gb
    if llm.config.model.device.startswith("cuda"):
        import torch

        peaks["engine GPU"] = torch.cuda.max_memory_allocated() / 2**30
    return peaks


def merge_peaks(total: dict[str, float], more: dict[str, float]) -> dict[str, float]:
    return {key: max(total.get(key, 0.0), more.get(key, 0.0)) for key in total.keys() | more.keys()}


def pin(cores: set[int], threads: int, device: str) -> None:
    """Pin this process to its cores and thread count (CPU runs; a GPU run keeps torch's threads)."""
    import torch

    if device == "cpu":
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(threads)
