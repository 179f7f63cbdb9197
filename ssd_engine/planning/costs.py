"""Time one forward per row count on CPU cores where the engine will run it, cached per machine.

Curves are timed on a few layers of dummy weights and scaled to the whole model
(planning/forward_timing.py): a forward's cost does not depend on weight values and every layer
costs the same. Each SSD side is timed beside the other side's memory traffic
(planning/contention.py). CUDA: planning/gpu_costs.py."""

import json
import os
import time
from dataclasses import asdict, dataclass

from tqdm import tqdm

from ssd_engine.core.config_sections import ModelConfig
from ssd_engine.models.loader import load_config
from ssd_engine.planning import formats
from ssd_engine.planning.contention import memory_traffic
from ssd_engine.planning.forward_timing import (
    DRAFT_ROWS,
    TARGET_ROWS,
    build_timed,
    release_memory,
    time_forwards,
    time_ranks,
)
from ssd_engine.planning.predict import Costs
from ssd_engine.utils.progress import progress_enabled

SSD_WORKLOAD = [(1, 1), (5, 1), (8, 4)]  # the draft format's probe workload: K = 4, B ~ 8
VERSION = 6  # bump when what is timed changes: older cached costs are then measured anew
# one process's target is timed on AR's and SSD's cores in alternation, this many times each, and each
# row count keeps its fastest: a load that comes and goes cannot fall on one mode's cores only
TARGET_PASSES = 2


class NotMeasured(Exception):
    """A placement nothing here times (planning/choose.py then chooses unmeasured)."""


@dataclass(frozen=True)
class Placement:
    """Where each mode runs, as the engine will place it. On CPU a unit is a core; on CUDA a GPU."""

    # AR and SD: the target's units per rank (one set: one process); SD's draft on ranks[0]
    ranks: list[list[int]]
    ssd_ranks: list[list[int]]  # SSD: the target's units per rank
    # SSD's draft process; empty: it would share the ranks', and SSD is no candidate
    ssd_draft: list[int]
    device: str = "cpu"

    @property
    def every(self) -> list[int]:
        return sorted({u for s in self.ranks + self.ssd_ranks + [self.ssd_draft] for u in s})


@dataclass
class MeasuredCosts:
    key: str
    target_cores: list[int]  # SSD's target cores (every rank's)
    draft_cores: list[int]  # SSD's draft cores; empty: no SSD
    target_all: dict[int, float]
    target_one: dict[int, float]
    draft_all: dict[int, float]
    draft_one: dict[str, dict[int, float]]  # SSD draft format -> its curve
    sd_format: str
    ssd_format: str  # the probe's pick for SSD's branch workload
    seconds: float  # how long measuring took
    version: int = VERSION

    def costs(self, ssd_format: str | None = None) -> Costs:
        """The cost curves with the SSD draft in `ssd_format` (None: the probe's pick)."""
        draft_one = self.draft_one[ssd_format or self.ssd_format]
        return Costs(
            _curve(self.target_all),
            _curve(self.target_one),
            _curve(self.draft_all),
            _curve(draft_one),
            ssd_possible=bool(self.draft_cores),
        )

    @classmethod
    def load(cls, path: str) -> "MeasuredCosts":
        with open(path) as f:
            raw = json.load(f)
        if raw.get("version") != VERSION:
            raise ValueError(
                f"{path}: costs of version {raw.get('version')}, this engine reads {VERSION}"
            )
        for name in ("target_all", "target_one", "draft_all"):
            raw[name] = {int(rows): s for rows, s in raw[name].items()}
        raw["draft_one"] = {
            fmt: {int(rows): s for rows, s in curve.items()}
            for fmt, curve in raw["draft_one"].items()
        }
        return cls(**raw)

    def save(self, path: str) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump(asdict(self), f, indent=1)
        os.replace(path + ".tmp", path)


def _curve(measured: dict[int, float]):
    """Piecewise-linear in rows through the measured points, extended linearly past the last two.
    Non-decreasing: a point above a later one is noise and takes the later value."""
    rows = sorted(measured)
    points = {n: min(measured[m] for m in rows if m >= n) for n in rows}

    def at(n: float) -> float:
        if n <= rows[0] or len(rows) == 1:
            return points[rows[0]]
        for lo, hi in zip(rows, rows[1:]):
            if n <= hi or hi == rows[-1]:
                return points[lo] + (points[hi] - points[lo]) * (n - lo) / (hi - lo)
        raise AssertionError("unreachable")

    return at


def load_or_measure(
    key: str,
    cache_dir: str,
    target: ModelConfig,
    draft: ModelConfig,
    draft_dtype: str,
    placement: Placement,
    measure_gpu=None,
) -> tuple[MeasuredCosts, bool]:
    """-> (costs, whether cached). A GPU's are timed by `measure_gpu`."""
    path = os.path.join(cache_dir, "calibrations", f"mode-costs-{key}.json")
    try:
        cached = MeasuredCosts.load(path)
        if cached.key == key:
            return cached, True
    except (OSError, ValueError, TypeError, KeyError):
        pass
    measured = (
        measure_gpu(key, target, draft, draft_dtype, placement)
        if placement.device != "cpu" and measure_gpu
        else measure(key, target, draft, draft_dtype, placement)
    )
    measured.save(path)
    return measured, False


def measure(
    key: str, target: ModelConfig, draft: ModelConfig, draft_dtype: str, placement: Placement
) -> MeasuredCosts:
    if placement.device != "cpu":
        raise NotMeasured(
            f"planning/costs.py times CPU cores; {placement.device} is planning/gpu_costs.py's"
        )
    started = time.perf_counter()
    ranks, ssd_ranks, draft_cores = placement.ranks, placement.ssd_ranks, placement.ssd_draft
    sd_cores = ranks[0]  # the colocated draft runs in rank 0's process (one process: every core)
    ssd_target = sorted({c for s in ssd_ranks for c in s})
    draft_hf = load_config(draft.path, "dummy")
    sd_format = formats.resolve_draft(
        draft_dtype, draft_hf, "cpu", [(1, 4)], sd_cores, len(sd_cores)
    )
    ssd_format = (
        formats.resolve_draft(
            draft_dtype, draft_hf, "cpu", SSD_WORKLOAD, draft_cores, len(draft_cores)
        )
        if draft_cores
        else sd_format
    )
    ssd_formats = list({f.name: f for f in (sd_format, ssd_format)}.values()) if draft_cores else []
    passes = TARGET_PASSES if len(ranks) == 1 else 1  # ranks start anew for every timing: once
    steps = len(TARGET_ROWS) * (1 + bool(draft_cores)) * passes
    steps += 1 + len(DRAFT_ROWS) * len(ssd_formats)
    with tqdm(
        total=steps, desc="calibrating modes (once per machine)", disable=not progress_enabled()
    ) as bar:
        target_all, target_one = _time_target(target, ranks, ssd_ranks, draft_cores, passes, bar)
        runner = build_timed(draft, sd_format)
        draft_all = time_forwards(runner, (1,), sd_cores, bar)
        draft_one = {}
        for fmt in ssd_formats:  # SD's format first: it is the one built
            if fmt.name != sd_format.name:
                del runner
                release_memory()
                runner = build_timed(draft, fmt)
            with memory_traffic(ssd_target, "float32"):  # the fp32 target verifying beside it
                draft_one[fmt.name] = time_forwards(runner, DRAFT_ROWS, draft_cores, bar)
        del runner
        release_memory()
    return MeasuredCosts(
        key,
        ssd_target,
        draft_cores,
        target_all,
        target_one or target_all,
        draft_all,
        draft_one or {sd_format.name: draft_all},
        sd_format.name,
        ssd_format.name,
        time.perf_counter() - started,
    )


def _time_target(
    target: ModelConfig,
    ranks: list[list[int]],
    ssd_ranks: list[list[int]],
    draft_cores: list[int],
    passes: int,
    bar,
) -> tuple[dict[int, float], dict[int, float]]:
    """The target on AR and SD's ranks, and on SSD's beside the draft cores' memory traffic when SSD
    is a candidate, `passes` times in alternation, each row count keeping its fastest. One process
    is built once and timed on both; tensor-parallel ranks start on each's cores every pass."""
    one = build_timed(target) if len(ranks) == 1 else None

    def time_on(sets: list[list[int]]) -> dict[int, float]:
        if one is not None:
            return time_forwards(one, TARGET_ROWS, sets[0], bar)
        return time_ranks(target, sets, bar)

    target_all, target_one = {}, {}
    for _ in range(passes):
        target_all = _fastest(target_all, time_on(ranks))
        if draft_cores:
            # what the SSD target meets: the draft beside it
            with memory_traffic(draft_cores, "bfloat16"):
                target_one = _fastest(target_one, time_on(ssd_ranks))
    one = None  # the process's weights go now, not when the closure goes
    release_memory()  # the target's weights go before a draft loads
    return target_all, target_one


def _fastest(so_far: dict[int, float], timed: dict[int, float]) -> dict[int, float]:
    return {n: min(s, so_far.get(n, s)) for n, s in timed.items()}
