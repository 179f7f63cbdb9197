"""Pick the draft's weight format (layers/weight_formats.py) for this CPU by timing every format on
the draft's Linear shapes and row counts, on its cores; cached per machine fingerprint. A more
precise format within TIE of the fastest wins. On a GPU the draft takes "bf16" (or "fp32")."""
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass

import torch

from ssd_engine.core.config import DRAFT_DTYPES
from ssd_engine.kernels import gguf_cpu
from ssd_engine.layers.shapes import head_dim
from ssd_engine.layers.weight_formats import ACTIVATION_DTYPE, FORMATS, check_supported, prepare

log = logging.getLogger("ssd_engine")
TIE = 1.10
HEAD_SLICE = 16384  # LM-head rows the probe times; the full head costs vocab / HEAD_SLICE times that
# the probe cycles through copies totalling this much so weights stream from memory, not cache
WORKING_SET_BYTES = 128 * 2**20


@dataclass(frozen=True)
class DraftFormat:
    name: str
    how: str                       # "probe", "cached probe", "draft_dtype", "gpu"
    step_ms: dict | None = None    # format -> one weighted draft workload, ms (when probed)

    @property
    def dtype(self) -> str:
        return "float32" if ACTIVATION_DTYPE[self.name] == torch.float32 else "bfloat16"

    def describe(self) -> str:
        if not self.step_ms:
            return f"{self.name} ({self.how})"
        times = ", ".join(f"{f} {ms:.1f}" for f, ms in sorted(self.step_ms.items(), key=lambda kv: kv[1]))
        return f"{self.name} ({self.how}: ms per workload {times})"


def linear_shapes(hf_config) -> list[tuple[int, int, int]]:
    """(out, in, count) of the Linears one forward runs; the LM head last."""
    h, i = hf_config.hidden_size, hf_config.intermediate_size
    width = head_dim(hf_config)
    q, kv = hf_config.num_attention_heads * width, hf_config.num_key_value_heads * width
    layers = hf_config.num_hidden_layers
    return [(q + 2 * kv, h, layers), (h, q, layers), (2 * i, h, layers), (h, i, layers),
            (hf_config.vocab_size, h, 1)]


def resolve(option: str, hf_config, device: str, workload: list[tuple[int, int]], cores: list[int] | None,
            threads: int, cache_dir) -> DraftFormat:
    """The draft's format. `workload`: (rows, forwards per round) the draft runs, e.g. SD's
    [(1, K)]; `cores`/`threads`: where it will run (the probe runs there)."""
    assert option in DRAFT_DTYPES
    if device != "cpu":
        return DraftFormat("fp32" if option == "fp32" else "bf16", "draft_dtype" if option != "auto" else "gpu")
    if option != "auto":
        check_supported(option, "draft_dtype")
        return DraftFormat(option, "draft_dtype")
    from ssd_engine.utils.machine import fingerprint
    shapes = linear_shapes(hf_config)
    measured = repr((shapes, workload, FORMATS, gguf_cpu.library_key()))  # hash() of a str differs per process
    key = f"draft-format-{fingerprint(cores, threads)}-{hashlib.blake2b(measured.encode(), digest_size=4).hexdigest()}"
    path = os.path.join(cache_dir, "probes", key + ".json")
    try:
        with open(path) as f:
            cached = json.load(f)
        return DraftFormat(cached["format"], "cached probe", cached["step_ms"])
    except (OSError, ValueError, KeyError):
        pass
    step_ms = probe(shapes, workload, cores, threads)
    chosen = choose(step_ms)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump({"format": chosen, "step_ms": step_ms, "workload": workload, "shapes": shapes}, f)
    os.replace(path + ".tmp", path)
    return DraftFormat(chosen, "probe", step_ms)


def choose(step_ms: dict[str, float]) -> str:
    """The fastest format, or a more precise one within TIE of it (FORMATS runs most precise first)."""
    best = min(step_ms.values())
    return next(f for f in FORMATS if f in step_ms and step_ms[f] <= best * TIE)


def probe(shapes, workload, cores: list[int] | None, threads: int) -> dict[str, float]:
    """ms of one round's draft Linears (`workload`) in each format this CPU runs, on `cores`."""
    from ssd_engine.distributed.placement import pin, unpin
    token = pin(cores, threads) if cores else None
    try:
        started = time.perf_counter()
        generator = torch.Generator().manual_seed(0)
        result = {}
        for fmt in FORMATS:
            try:
                result[fmt] = sum(_time_shape(out, inp, count, fmt, workload, generator) for out, inp, count in shapes)
            except RuntimeError as error:
                log.info("draft format %s unavailable here: %s", fmt, str(error).splitlines()[0])
        log.info("draft format probe took %.1f s: %s", time.perf_counter() - started, result)
        return result
    finally:
        if token is not None:
            unpin(token)


def _time_shape(out: int, inp: int, count: int, fmt: str, workload, generator) -> float:
    """ms of `count` Linears [out, in] over one round's workload, in format `fmt`."""
    rows_timed = min(out, HEAD_SLICE)
    weight = torch.randn(rows_timed, inp, generator=generator) * 0.02
    copies = max(1, min(count, -(-WORKING_SET_BYTES // weight.nbytes)))
    prepared = [prepare(weight, fmt) for _ in range(copies)]
    total = 0.0
    for rows, per_round in workload:
        x = torch.randn(rows, inp, generator=generator).to(ACTIVATION_DTYPE[fmt])
        per_copy = _median_ms(lambda: [p(x, None) for p in prepared]) / copies
        total += per_copy * per_round
    return total * count * out / rows_timed


def _median_ms(fn, repeats: int = 5) -> float:
    fn(), fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[repeats // 2] * 1e3
