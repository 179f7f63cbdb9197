"""Every weight format and matmul row padding, decided before any model is built (`decide`).

The one place that probes formats: the draft's weight format (each format this CPU runs, timed on
the draft's Linear shapes, rows and cores) here, and oneDNN's row padding (whether one- and two-row
matmuls run faster padded with zero rows) through planning/row_padding_probe.py. Both are cached
per machine fingerprint in the model cache's `probes/` folder (planning/probe_cache.py), so a
second engine on the same cores measures nothing. Runners only read the results from their
`ModelConfig`."""

import hashlib
import logging
import os
import time
from dataclasses import dataclass, replace

import torch

from ssd_engine.core.config import EngineConfig
from ssd_engine.core.config_sections import ModelConfig
from ssd_engine.core.option_choices import DRAFT_DTYPES
from ssd_engine.distributed.placement import pin, unpin
from ssd_engine.kernels import gguf_cpu
from ssd_engine.layers.shapes import head_dim
from ssd_engine.layers.weight_formats import ACTIVATION_DTYPE, FORMATS, check_supported, prepare
from ssd_engine.models.loader import load_config
from ssd_engine.planning.probe_cache import read_probe, write_probe
from ssd_engine.planning.row_padding_probe import with_row_padding
from ssd_engine.saguaro.plan import SaguaroPlan
from ssd_engine.utils.machine import fingerprint

log = logging.getLogger("ssd_engine")
TIE = 1.10  # a more precise draft format within this factor of the fastest wins
# LM-head rows the draft probe times; the full head costs vocab / HEAD_SLICE times that
HEAD_SLICE = 16384
# the draft probe cycles through copies this large: weights stream from memory
WORKING_SET_BYTES = 128 * 2**20


@dataclass(frozen=True)
class DraftFormat:
    name: str
    how: str  # "probe", "cached probe", "draft_dtype", "gpu"
    step_ms: dict | None = None  # format -> one weighted draft workload, ms (when probed)

    @property
    def dtype(self) -> str:
        return "float32" if ACTIVATION_DTYPE[self.name] == torch.float32 else "bfloat16"

    def describe(self) -> str:
        if not self.step_ms:
            return f"{self.name} ({self.how})"
        times = ", ".join(
            f"{f} {ms:.1f}" for f, ms in sorted(self.step_ms.items(), key=lambda kv: kv[1])
        )
        return f"{self.name} ({self.how}: ms per workload {times})"


@dataclass(frozen=True)
class Formats:
    target: ModelConfig  # the target's model with its row padding
    draft: ModelConfig | None  # the draft's: its folder, device, resolved format and row padding
    draft_format: DraftFormat | None


def decide(
    config: EngineConfig, core_sets: list[list[int]] | None, saguaro: SaguaroPlan | None
) -> Formats:
    """The target's and the draft's formats for where the engine will run them: SSD's draft on the
    last of `core_sets` (CPU) or the GPU after the target's ranks, SD's beside the target."""
    model, speculative = config.model, config.speculative
    target_cores = core_sets[0] if core_sets else sorted(os.sched_getaffinity(0))
    target_threads = threads_on(model, core_sets[0] if core_sets else None)
    target = with_row_padding(model, target_cores, target_threads)
    if speculative.mode == "ar":
        return Formats(target, None, None)
    # row_independent: the target's alone
    draft = replace(model, path=speculative.draft_model, row_independent=False)
    if speculative.mode == "sd":
        cores, threads, workload = None, threads_on(model, None), [(1, speculative.k)]
        padding_cores, padding_threads = target_cores, target_threads
    else:
        cores = core_sets[-1] if core_sets else None
        threads = threads_on(model, cores)
        draft = replace(draft, device=ssd_draft_device(config))
        branch_rows = max(sum(fanout) for _, fanout in saguaro.fanouts)
        # a round: the glue scores K+1 rows, then K branch steps of B rows; a miss drafts one row
        workload = [(1, 1), (speculative.k + 1, 1), (max(branch_rows, 1), speculative.k)]
        padding_cores, padding_threads = cores or target_cores, threads
    chosen = resolve_draft(
        speculative.draft_dtype,
        load_config(draft.path, draft.load_format),
        draft.device,
        workload,
        cores,
        threads,
    )
    draft = replace(
        draft, dtype=chosen.dtype, weight_format=chosen.name if draft.device == "cpu" else None
    )
    return Formats(target, with_row_padding(draft, padding_cores, padding_threads), chosen)


def threads_on(model: ModelConfig, cores: list[int] | None) -> int:
    """The torch threads a process of `model` pinned to `cores` runs (None: unpinned, this process's)."""
    return model.num_threads or (len(cores) if cores else torch.get_num_threads())


def ssd_draft_device(config: EngineConfig) -> str:
    """The SSD draft's device: the GPU after the target's ranks (the last one when too few), or the CPU."""
    device = config.model.device
    if not device.startswith("cuda"):
        return device
    wanted = (torch.device(device).index or 0) + config.parallel.tensor_parallel_size
    return f"cuda:{min(wanted, torch.cuda.device_count() - 1)}"


# ---------------------------------------------------------------- the draft's weight format


def linear_shapes(hf_config) -> list[tuple[int, int, int]]:
    """(out, in, count) of the Linears one forward runs; the LM head last."""
    h, i = hf_config.hidden_size, hf_config.intermediate_size
    width = head_dim(hf_config)
    q, kv = hf_config.num_attention_heads * width, hf_config.num_key_value_heads * width
    layers = hf_config.num_hidden_layers
    return [
        (q + 2 * kv, h, layers),
        (h, q, layers),
        (2 * i, h, layers),
        (h, i, layers),
        (hf_config.vocab_size, h, 1),
    ]


def resolve_draft(
    option: str,
    hf_config,
    device: str,
    workload: list[tuple[int, int]],
    cores: list[int] | None,
    threads: int,
) -> DraftFormat:
    """The draft's format. `workload`: (rows, forwards per round) the draft runs, e.g. SD's
    [(1, K)]; `cores`/`threads`: where it will run (the probe runs there)."""
    assert option in DRAFT_DTYPES
    if device != "cpu":
        return DraftFormat(
            "fp32" if option == "fp32" else "bf16", "draft_dtype" if option != "auto" else "gpu"
        )
    if option != "auto":
        check_supported(option, "draft_dtype")
        return DraftFormat(option, "draft_dtype")
    shapes = linear_shapes(hf_config)
    # hash() of a str differs per process
    measured = repr((shapes, workload, FORMATS, gguf_cpu.library_key()))
    key = f"draft-format-{fingerprint(cores, threads)}-{hashlib.blake2b(measured.encode(), digest_size=4).hexdigest()}"
    cached = read_probe(key)
    if cached is not None and "format" in cached:
        return DraftFormat(cached["format"], "cached probe", cached["step_ms"])
    step_ms = probe_draft(shapes, workload, cores, threads)
    chosen = choose_draft(step_ms)
    write_probe(key, {"format": chosen, "step_ms": step_ms, "workload": workload, "shapes": shapes})
    return DraftFormat(chosen, "probe", step_ms)


def choose_draft(step_ms: dict[str, float]) -> str:
    """The fastest format, or a more precise one within TIE of it (FORMATS runs most precise first)."""
    best = min(step_ms.values())
    return next(f for f in FORMATS if f in step_ms and step_ms[f] <= best * TIE)


def probe_draft(shapes, workload, cores: list[int] | None, threads: int) -> dict[str, float]:
    """ms of one round's draft Linears (`workload`) in each format this CPU runs, on `cores`."""
    token = pin(cores, threads) if cores else None
    try:
        started = time.perf_counter()
        generator = torch.Generator().manual_seed(0)
        result = {}
        for fmt in FORMATS:
            try:
                result[fmt] = sum(
                    _time_shape(out, inp, count, fmt, workload, generator)
                    for out, inp, count in shapes
                )
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
