"""speculative_mode="auto": run the mode (AR, SD or SSD) and K predicted fastest on this machine.

SSD is a candidate only where its draft gets cores (or a GPU) of its own: no prediction covers a
draft sharing the target's. A speculative mode must beat AR by MARGIN, so a prediction error costs
little where AR is nearly as fast. What nothing times runs unmeasured, and `how` says so."""

import logging
from dataclasses import dataclass, field, replace

from ssd_engine.core.config import EngineConfig
from ssd_engine.core.core_sets import format_core_sets
from ssd_engine.core.synthetic_hook import Synthetic
from ssd_engine.models.model_paths import resolve_model_path
from ssd_engine.planning.costs import MeasuredCosts, NotMeasured, Placement
from ssd_engine.planning.mode_placement import placement_for
from ssd_engine.planning.predict import (
    K_RANGE,
    Acceptance,
    Prediction,
    predict_all,
    predict_ssd,
)
from ssd_engine.planning.survey import Survey, survey
from ssd_engine.saguaro.calibration import CONFIG_DIR, find_calibrations
from ssd_engine.saguaro.plan import needs_calibration
from ssd_engine.tensor_parallel.launch import torchrun_world
from ssd_engine.utils.machine import cpu_fingerprint

log = logging.getLogger("ssd_engine")
MARGIN = 1.05
FORMAT_TIE = 0.97  # SSD draft formats predicted this close are equals (planning/costs.py noise)


@dataclass(frozen=True)
class ModeChoice:
    mode: str  # ar, sd or ssd
    k: int
    how: str  # what the choice rests on
    predicted_tok_s: dict = field(default_factory=dict)
    detail: dict = field(default_factory=dict)

    def describe(self) -> str:
        if not self.predicted_tok_s:
            return f"{self.mode} ({self.how})"
        ar = self.predicted_tok_s.get("ar")
        preds = ", ".join(
            f"{m} {v:.2f} tok/s" + (f" ({v / ar:.2f}x AR)" if ar and m != "ar" else "")
            for m, v in sorted(self.predicted_tok_s.items(), key=lambda kv: -kv[1])
        )
        k = f" K={self.k}" if self.mode != "ar" else ""
        return f"{self.mode}{k} (predicted: {preds}; {self.how})"


def resolve_auto(config: EngineConfig) -> tuple[EngineConfig, ModeChoice]:
    """The config with speculative_mode="auto" replaced by the chosen mode and its settings."""
    if config.model.path is not None and config.speculative.draft_model is None:
        return config.with_options(speculative_mode="ar"), ModeChoice("ar", 0, "no draft model")
    world = torchrun_world()
    if world is not None and world[0] != 0:
        # this rank serves rank 0's plan: measuring here would only slow rank 0's measurement
        return config.with_options(speculative_mode="ar"), ModeChoice(
            "ar", 0, f"torchrun rank {world[0]}: serves rank 0, which chooses the mode"
        )
    try:
        seen = survey(config)
    except NotMeasured as missing:
        mode, where = (
            ("ssd", "the draft on a device of its own")
            if placement_for(config)[0].ssd_draft
            else ("sd", "no device for an SSD draft of its own")
        )
        return config.with_options(speculative_mode=mode), ModeChoice(
            mode, config.speculative.k, f"not measured: {missing}; {mode.upper()}, {where}"
        )
    choice = _choose(seen)
    ranks = config.parallel.tensor_parallel_size
    if ranks > 1 and seen.placement.device == "cpu" and world is None:
        single = config.with_options(tensor_parallel_size=1)
        alone = survey(single)
        one = _choose(alone)
        ranks_s, one_s = choice.predicted_tok_s[choice.mode], one.predicted_tok_s[one.mode]
        if one_s > ranks_s:
            line = (
                f"tensor parallelism predicted slower: {ranks} ranks {ranks_s:.2f} tok/s "
                f"({choice.mode}), one process {one_s:.2f} ({one.mode}); running one process (a mode given "
                f"with --mode keeps the ranks)"
            )
            log.warning(line)
            one = replace(one, how=f"{line}; {one.how}")
            return _apply(single, one, alone.placement, alone.measured), one
    return _apply(config, choice, seen.placement, seen.measured), choice


def _choose(seen: Survey) -> ModeChoice:
    """The fastest predicted mode at its best K; a speculative one only by MARGIN over AR."""
    predictions = _predict_all_formats(seen.measured, seen.acceptance)
    best = max(predictions.values(), key=lambda p: p.tokens_per_s)
    if best.mode != "ar" and best.tokens_per_s < MARGIN * predictions["ar"].tokens_per_s:
        best = predictions["ar"]
    return ModeChoice(
        best.mode,
        best.k,
        seen.how,
        {m: p.tokens_per_s for m, p in predictions.items()},
        best.detail,
    )


def size_ssd(config: EngineConfig) -> tuple[EngineConfig, ModeChoice | None]:
    """A forced SSD on CPU without tensor parallelism: budget B, draft format and fallback timing
    from this machine's costs at K, unless given or the pair was calibrated on this kind of CPU."""
    speculative, ssd = config.speculative, config.speculative.ssd
    pinned = speculative.draft_dtype != "auto" and not needs_calibration(ssd)
    if (
        config.model.device != "cpu"
        or config.parallel.tensor_parallel_size > 1
        or ssd.budget is not None
        or pinned
    ):
        return config, None
    calibrations = find_calibrations(
        resolve_model_path(config),
        resolve_model_path(config, "draft"),
        ssd.calibration_dir or CONFIG_DIR,
    )
    if calibrations and calibrations[0].measured.get("cpu_fingerprint") == cpu_fingerprint():
        return config, None  # calibrated on this kind of CPU: its measured budget stands
    seen = survey(config)
    if not seen.placement.ssd_draft:
        return config, None  # one core: the draft shares it, and no prediction covers that
    k = speculative.k
    predicted = _best_format(
        [
            (fmt, predict_ssd(seen.measured.costs(fmt), seen.acceptance, k))
            for fmt in _formats(seen.measured)
        ]
    )
    choice = ModeChoice(
        "ssd",
        k,
        "forced; budget and draft format sized from " + seen.how,
        {"ssd": predicted.tokens_per_s},
        predicted.detail,
    )
    return config.with_options(
        ssd_budget=predicted.detail["budget"], draft_dtype=predicted.detail["draft_format"]
    ), choice


def _formats(measured: MeasuredCosts) -> list[str]:
    """The SSD draft formats measured, the probe's pick for SSD's workload first (it wins ties)."""
    return sorted(measured.draft_one, key=lambda fmt: fmt != measured.ssd_format)


def _best_format(candidates: list[tuple[str, Prediction]]) -> Prediction:
    """Among those within FORMAT_TIE of the fastest, the one whose one-row build takes the smallest
    share of the window: a shorter real window can still fit it by cutting B."""
    top = max(p.tokens_per_s for _, p in candidates)
    near = [(fmt, p) for fmt, p in candidates if p.tokens_per_s >= FORMAT_TIE * top]
    fmt, best = min(near, key=lambda pair: pair[1].detail.get("floor_t_p", 0.0))
    return replace(best, detail={**best.detail, "draft_format": fmt})


def _predict_all_formats(measured: MeasuredCosts, acceptance: Acceptance) -> dict[str, Prediction]:
    """AR, SD and SSD at their best K, SSD in whichever measured format predicts faster: the fastest
    format at B rows need not be the fastest at the B that fits the verification."""
    by_format = [(fmt, predict_all(measured.costs(fmt), acceptance)) for fmt in _formats(measured)]
    predictions = dict(by_format[0][1])  # AR and SD do not depend on SSD's draft format
    if "ssd" in predictions:
        predictions["ssd"] = _best_format([(fmt, each["ssd"]) for fmt, each in by_format])
    return predictions


def _apply(
    config: EngineConfig, choice: ModeChoice, placement: Placement, measured: MeasuredCosts
) -> EngineConfig:
    """The choice written into the config; on CPU the cores too, as the prediction placed them
    (except under torchrun, whose ranks the engine does not place)."""
    on_cpu = placement.device == "cpu"
    if choice.mode == "ssd":
        budget = config.speculative.ssd.budget
        budget = budget if budget is not None else choice.detail["budget"]
        changes = dict(speculative_mode="ssd", num_speculative_tokens=choice.k, ssd_budget=budget)
        if on_cpu:
            changes["draft_dtype"] = choice.detail.get("draft_format", measured.ssd_format)
            if torchrun_world() is None:
                changes["cpu_cores"] = format_core_sets(placement.ssd_ranks + [placement.ssd_draft])
        return config.with_options(**changes)
    synthetic = config.speculative.synthetic or Synthetic()
    # SD draws no lookups, AR no drafts
    kept = Synthetic(synthetic.acceptance if choice.mode == "sd" else None)
    changes = dict(
        speculative_mode=choice.mode, synthetic=kept if kept.acceptance is not None else None
    )
    if choice.mode == "sd":
        # the per-step choice starts at the predicted K and may measure one more to be faster
        per_step = config.speculative.per_step == "goodput"
        changes["num_speculative_tokens"] = min(choice.k + per_step, max(K_RANGE))
        if on_cpu:
            changes["draft_dtype"] = measured.sd_format
    if on_cpu and torchrun_world() is None:
        changes["cpu_cores"] = format_core_sets(placement.ranks)
        if len(placement.ranks) == 1:
            changes["num_threads"] = config.model.num_threads or len(placement.ranks[0])
    return config.with_options(**changes)
