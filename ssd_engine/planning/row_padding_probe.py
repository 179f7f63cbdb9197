"""oneDNN's row padding, probed on a model's cores: which small row counts run faster padded."""

import time
from dataclasses import replace

import torch

from ssd_engine.core.config_sections import ModelConfig
from ssd_engine.distributed.placement import pin, unpin
from ssd_engine.models.gguf_weights import GGUF_FORMATS
from ssd_engine.planning.probe_cache import read_probe, write_probe
from ssd_engine.runtime.model_runner import matmul_dtype
from ssd_engine.utils.machine import fingerprint

PADDING_SHAPE = (8960, 1536)  # the row-padding probe's weight: large enough to stream from memory
PADDING_BYTES = 256 * 2**20
PADDING_REPEATS = 7  # rounds over every row count in turn, so noise hits them all alike
PADDING_ROWS = (1, 2, 3, 4)
PADDING_GAIN = 0.85  # pad only where it saves at least 15%: noise must not decide


def with_row_padding(model: ModelConfig, cores: list[int], threads: int) -> ModelConfig:
    """`model` with the row padding of the oneDNN matmuls it will run, measured on `cores`."""
    dtype = matmul_dtype(model, gguf=model.weight_format in GGUF_FORMATS)
    if dtype is None:
        return model
    return replace(
        model, row_padding=tuple(sorted(measure_row_padding(dtype, cores, threads).items()))
    )


def measure_row_padding(dtype: torch.dtype, cores: list[int], threads: int) -> dict[int, int]:
    """rows -> the row count to run them at, for oneDNN's packed matmuls in `dtype` on `cores`
    (cached); {} where oneDNN has no packed matmul in `dtype` or padding never pays."""
    key = f"row-padding-{fingerprint(cores, threads)}-{str(dtype).split('.')[-1]}"
    cached = read_probe(key)
    if cached is not None and "padded" in cached:
        return {int(rows): padded for rows, padded in cached["padded"].items()}
    token = pin(cores, threads)
    try:
        times = _probe_padding(dtype)
    except RuntimeError:
        times = {}
    finally:
        unpin(token)
    table = choose_padding(times)
    write_probe(key, {"ms": times, "padded": table})
    return table


def choose_padding(ms: dict[int, float]) -> dict[int, int]:
    """rows -> the cheapest row count >= rows, where it saves PADDING_GAIN; others run as they are."""
    table = {}
    for rows in ms:
        best = min((m for m in ms if m >= rows), key=lambda m: ms[m])
        if best != rows and ms[best] < PADDING_GAIN * ms[rows]:
            table[rows] = best
    return table


def _probe_padding(dtype: torch.dtype) -> dict[int, float]:
    weight = (
        torch.randn(*PADDING_SHAPE, generator=torch.Generator().manual_seed(0)).to(dtype) * 0.02
    )
    copies = max(1, PADDING_BYTES // (weight.numel() * 4))
    packed = [torch.ops.mkldnn._reorder_linear_weight(weight.clone(), 8) for _ in range(copies)]
    inputs = {rows: torch.randn(rows, PADDING_SHAPE[1]).to(dtype) for rows in PADDING_ROWS}
    times: dict[int, list[float]] = {rows: [] for rows in PADDING_ROWS}
    for repeat in range(PADDING_REPEATS + 1):
        for rows, x in inputs.items():
            start = time.perf_counter()
            for p in packed:
                torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
            if repeat:
                times[rows].append((time.perf_counter() - start) * 1e3 / copies)
    return {rows: sorted(t)[PADDING_REPEATS // 2] for rows, t in times.items()}
