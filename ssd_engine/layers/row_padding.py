"""How many rows oneDNN's packed matmul should be given, measured once per machine and dtype.
Some CPUs run one or two rows through a slower path than three or more, so a decode step is padded
with zero rows (the weight is read once either way); only the real rows' outputs are kept."""
import json
import os
import time

import torch

PROBE_SHAPE = (8960, 1536)   # large enough to stream from memory
PROBE_BYTES = 256 * 2**20    # cycle through copies totalling this much, past any cache
REPEATS = 7                  # rounds over every row count in turn, so noise hits them all alike
CANDIDATE_ROWS = (1, 2, 3, 4)
GAIN = 0.85                  # pad only where it saves at least 15%: noise must not decide

_padded: dict[torch.dtype, dict[int, int]] = {}


def padded_rows(rows: int, dtype: torch.dtype) -> int:
    """The row count to run `rows` rows at (>= rows). The comparison comes first so a symbolic
    `rows` in a compiled step is not pinned to one count by the dictionary lookup."""
    table = _padded.get(dtype)
    if not table or rows > max(table):
        return rows
    return table.get(rows, rows)


def largest_padded(dtype: torch.dtype) -> int:
    """The largest row count padded for `dtype` (0: none); steps of more rows run as they are."""
    return max(_padded.get(dtype) or {0: 0})


def measure_once(dtype: torch.dtype, key: str, cache_dir: str) -> dict[int, int]:
    """Measure (or read the cached) padding table for `dtype`; `key` fingerprints the machine's
    cores and threads. Where oneDNN has no packed matmul in `dtype` the table is {}."""
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
            if repeat:
                times[rows].append((time.perf_counter() - start) * 1e3 / copies)
    return {rows: sorted(t)[REPEATS // 2] for rows, t in times.items()}
