"""How many rows oneDNN's packed matmul should be given: a measured, per-machine choice.

On some CPUs oneDNN runs a packed weight through a slow path for one or two rows and a fast one
from three or more. Padding a one-row decode step with zero rows up to a faster count then makes it
faster at no extra memory traffic: the weight is read once either way. On other CPUs one row is
fastest, so the choice is measured, once per machine and dtype, and cached (docs/CPU.md).

The padding rows are zeros and only row i of the output is kept for input row i; the kept rows
are computed by the same kernel family as every multi-row step (verification, prefill), so
greedy output stays token-identical to transformers as with any other fp32 kernel choice.
"""
import json
import os
import time

import torch

PROBE_SHAPE = (8960, 1536)   # a 1.5B model's MLP: large enough to stream from memory
PROBE_BYTES = 256 * 2**20    # cycle through copies totalling this much, past any cache
REPEATS = 7                  # rounds over every row count in turn: a neighbour's traffic hits them all alike
CANDIDATE_ROWS = (1, 2, 3, 4)
GAIN = 0.85                  # pad only where it saves at least 15%: noise must not decide

_padded: dict[torch.dtype, dict[int, int]] = {}


def padded_rows(rows: int, dtype: torch.dtype) -> int:
    """The row count to run `rows` rows at (>= rows); rows itself when no measurement says otherwise.
    In a compiled step `rows` may be symbolic, known only to exceed `largest_padded`: one comparison
    then settles it, where a dictionary lookup would pin the graph to one row count."""
    table = _padded.get(dtype)
    if not table or rows > max(table):
        return rows
    return table.get(rows, rows)


def largest_padded(dtype: torch.dtype) -> int:
    """The largest row count padded for `dtype` (0: none); steps of more rows run as they are."""
    return max(_padded.get(dtype) or {0: 0})


def measure_once(dtype: torch.dtype, key: str, cache_dir: str) -> dict[int, int]:
    """Measure (or read the cached) padding table for `dtype` in this process; `key`: the machine
    fingerprint for this process's cores and threads. Where oneDNN has no packed matmul in `dtype`
    (bf16 on a CPU without AVX-512: the probe raises RuntimeError) nothing is padded ({}), cached
    like any result: no weight of that dtype can be packed there either."""
    if dtype in _padded:
        return _padded[dtype]
    path = os.path.join(cache_dir, "probes", f"row-padding-{key}-{str(dtype).split('.')[-1]}.json")
    try:
        with open(path) as f:
            table = {int(k): v for k, v in json.load(f)["padded"].items()}
    except (OSError, ValueError, KeyError):
        try:
            times = _probe(dtype)
        except RuntimeError:
            times = {}
        table = choose(times)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump({"ms": times, "padded": table}, f)
        os.replace(path + ".tmp", path)
    _padded[dtype] = table
    return table


def choose(ms: dict[int, float]) -> dict[int, int]:
    """rows -> the cheapest row count >= rows, when it saves GAIN; rows absent from the table run as they are."""
    table = {}
    for rows in ms:
        best = min((m for m in ms if m >= rows), key=lambda m: ms[m])
        if best != rows and ms[best] < GAIN * ms[rows]:
            table[rows] = best
    return table


def _probe(dtype: torch.dtype) -> dict[int, float]:
    weight = torch.randn(*PROBE_SHAPE, generator=torch.Generator().manual_seed(0)).to(dtype) * 0.02
    copies = max(1, PROBE_BYTES // (weight.numel() * 4))
    packed = [torch.ops.mkldnn._reorder_linear_weight(weight.clone(), 8) for _ in range(copies)]
    inputs = {rows: torch.randn(rows, PROBE_SHAPE[1]).to(dtype) for rows in CANDIDATE_ROWS}
    times: dict[int, list[float]] = {rows: [] for rows in CANDIDATE_ROWS}
    for repeat in range(REPEATS + 1):
        for rows, x in inputs.items():
            start = time.perf_counter()
            for p in packed:
                torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
            if repeat:  # the first round warms every shape up
                times[rows].append((time.perf_counter() - start) * 1e3 / copies)
    return {rows: sorted(t)[REPEATS // 2] for rows, t in times.items()}
