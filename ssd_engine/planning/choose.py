"""speculative_mode="auto": run the mode (AR, SD or SSD) and K predicted fastest on this machine.

The engine's cores are the baseline's too: AR and SD get every core the engine was given, SSD
splits them into a target set and a draft set. Costs come from planning/costs.py (measured once
per machine, cached), acceptance from the pair's Saguaro calibration (configs/), the prediction
from planning/predict.py. A speculative mode must beat AR by MARGIN to be chosen, so that a
prediction error costs little where AR is nearly as fast. The choice, its K, the draft's format
and (for SSD) the budget B are written into the engine's config; `ModeChoice` reports them.
"""
import logging
from dataclasses import dataclass, field, replace

from ssd_engine.planning.costs import MeasuredCosts, load_or_measure
from ssd_engine.planning.predict import Acceptance, Prediction, predict_all, predict_ssd
from ssd_engine.core.config import EngineConfig
from ssd_engine.core.config_parts import ModelConfig
from ssd_engine.models.default_models import cache_dir, resolve_model_path
from ssd_engine.core.config import parse_core_sets
from ssd_engine.distributed.placement import available_cores
from ssd_engine.utils.machine import cpu_fingerprint, fingerprint
from ssd_engine.saguaro.calibration import CONFIG_DIR, find_calibrations, model_fingerprint

log = logging.getLogger("ssd_engine")
MARGIN = 1.05
FORMAT_TIE = 0.97  # SSD draft formats predicted this close are equals (planning/costs.py noise)


@dataclass(frozen=True)
class ModeChoice:
    mode: str                                 # ar, sd or ssd
    k: int
    how: str                                  # what the choice rests on
    predicted_tok_s: dict = field(default_factory=dict)
    detail: dict = field(default_factory=dict)

    def describe(self) -> str:
        if not self.predicted_tok_s:
            return f"{self.mode} ({self.how})"
        ar = self.predicted_tok_s.get("ar")
        preds = ", ".join(f"{m} {v:.2f} tok/s" + (f" ({v / ar:.2f}x AR)" if ar and m != "ar" else "")
                          for m, v in sorted(self.predicted_tok_s.items(), key=lambda kv: -kv[1]))
        k = f" K={self.k}" if self.mode != "ar" else ""
        return f"{self.mode}{k} (predicted: {preds}; {self.how})"


@dataclass(frozen=True)
class Survey:
    """What a prediction rests on: the engine's cores, split for SSD, and their measured costs."""
    every: list[int]
    target_cores: list[int]
    draft_cores: list[int]
    measured: MeasuredCosts
    acceptance: Acceptance
    how: str


def survey(config: EngineConfig) -> Survey:
    """This machine's costs for the config's pair and cores (measured once, then cached)."""
    target_path, draft_path = resolve_model_path(config), resolve_model_path(config, "draft")
    sets = parse_core_sets(config.cpu_cores) if config.cpu_cores else [available_cores()]
    every = sorted({c for s in sets for c in s})
    half = len(every) // 2
    target_cores, draft_cores = (sets[0], sets[1]) if len(sets) == 2 else (every[:half], every[half:])
    if not half:
        target_cores, draft_cores = every, []
    key = "-".join([fingerprint(every, len(every)), model_fingerprint(target_path)[:8],
                    model_fingerprint(draft_path)[:8], config.draft_dtype])
    model = ModelConfig(target_path, None, config.dtype, "cpu", config.weight_layout)
    measured, cached = load_or_measure(key, str(cache_dir()), model, replace(model, path=draft_path),
                                       config.draft_dtype, target_cores, draft_cores)
    calibrations = find_calibrations(target_path, draft_path, config.calibration_dir or CONFIG_DIR)
    how = (f"{'cached ' if cached else ''}costs measured on {len(every)} core(s) in {measured.seconds:.0f} s, "
           f"acceptance from {'the pair calibration' if calibrations else 'defaults (no calibration)'}")
    acceptance = with_synthetic(Acceptance.from_calibration(calibrations[0] if calibrations else None), config)
    if config.synthetic_acceptance is not None or config.synthetic_hit is not None:
        how += " (synthetic_acceptance / synthetic_hit replace what they set)"
    return Survey(every, target_cores, draft_cores, measured, acceptance, how)


def with_synthetic(acceptance: Acceptance, config: EngineConfig) -> Acceptance:
    """Benchmarking: under synthetic_acceptance every draft is accepted with probability alpha, and
    under synthetic_hit a lookup hits with probability p whatever the fan-out (r = 0)."""
    if config.synthetic_acceptance is not None:
        acceptance = replace(acceptance, position_rates=(float(config.synthetic_acceptance),))
    if config.synthetic_hit is not None:
        acceptance = replace(acceptance, miss_by_fanout=(1.0 - config.synthetic_hit,), r=0.0)
    return acceptance


def resolve_auto(config: EngineConfig) -> tuple[EngineConfig, ModeChoice]:
    """The config with speculative_mode="auto" replaced by the chosen mode and its settings."""
    if config.model is not None and config.draft_model is None:
        return replace(config, speculative_mode="ar"), ModeChoice("ar", 0, "no draft model")
    if config.device != "cpu" or config.tensor_parallel_size > 1:
        # not calibrated there yet: the draft on its own device, as before "auto" existed
        return replace(config, speculative_mode="ssd"), ModeChoice("ssd", config.num_speculative_tokens,
                                                                  "not calibrated off CPU or under TP: SSD")
    seen = survey(config)
    predictions = _predict_all_formats(seen.measured, seen.acceptance)
    best = max(predictions.values(), key=lambda p: p.tokens_per_s)
    if best.mode != "ar" and best.tokens_per_s < MARGIN * predictions["ar"].tokens_per_s:
        best = predictions["ar"]
    choice = ModeChoice(best.mode, best.k, seen.how, {m: p.tokens_per_s for m, p in predictions.items()}, best.detail)
    return _apply(config, choice, seen.every, seen.target_cores, seen.draft_cores, seen.measured), choice


def size_ssd(config: EngineConfig) -> tuple[EngineConfig, ModeChoice | None]:
    """A forced SSD on CPU without tensor parallelism: its budget B and the fallback rule's starting
    timing from this machine's costs at the config's K, unless ssd_budget is given or the pair's
    calibration was measured on this kind of CPU (its budget then stands)."""
    if config.device != "cpu" or config.tensor_parallel_size > 1 or config.ssd_budget is not None:
        return config, None
    calibrations = find_calibrations(resolve_model_path(config), resolve_model_path(config, "draft"),
                                     config.calibration_dir or CONFIG_DIR)
    if calibrations and calibrations[0].measured.get("cpu_fingerprint") == cpu_fingerprint():
        return config, None  # calibrated on this kind of CPU: its measured budget stands
    seen = survey(config)
    if not seen.draft_cores:
        return config, None  # one core: the draft shares it, and no prediction covers that
    k = config.num_speculative_tokens
    predicted = _best_format([(fmt, predict_ssd(seen.measured.costs(fmt), seen.acceptance, k))
                              for fmt in _formats(seen.measured)])
    choice = ModeChoice("ssd", k, "forced; budget and draft format sized from " + seen.how,
                        {"ssd": predicted.tokens_per_s}, predicted.detail)
    return replace(config, ssd_budget=predicted.detail["budget"], draft_dtype=predicted.detail["draft_format"]), choice


def _formats(measured: MeasuredCosts) -> list[str]:
    """The SSD draft formats measured, the probe's pick for SSD's workload first (it wins ties)."""
    return sorted(measured.draft_one, key=lambda fmt: fmt != measured.ssd_format)


def _best_format(candidates: list[tuple[str, Prediction]]) -> Prediction:
    """The fastest; among those within FORMAT_TIE of it, the one whose one-row build takes the
    smallest share of the window: where the real window is shorter than measured, the run-time
    budget can still fit that build by cutting B, never the other's."""
    top = max(p.tokens_per_s for _, p in candidates)
    near = [(fmt, p) for fmt, p in candidates if p.tokens_per_s >= FORMAT_TIE * top]
    fmt, best = min(near, key=lambda pair: pair[1].detail.get("floor_t_p", 0.0))  # the first of equals
    return replace(best, detail={**best.detail, "draft_format": fmt})


def _predict_all_formats(measured: MeasuredCosts, acceptance: Acceptance) -> dict[str, Prediction]:
    """AR, SD and SSD at their best K, SSD in whichever measured format predicts faster: the build
    fits the verification at a budget the formats' curves set, and the fastest format at B rows
    need not be the fastest at the B that fits."""
    by_format = [(fmt, predict_all(measured.costs(fmt), acceptance)) for fmt in _formats(measured)]
    predictions = dict(by_format[0][1])  # AR and SD do not depend on SSD's draft format
    if "ssd" in predictions:
        predictions["ssd"] = _best_format([(fmt, each["ssd"]) for fmt, each in by_format])
    return predictions


def _apply(config: EngineConfig, choice: ModeChoice, every, target_cores, draft_cores, measured) -> EngineConfig:
    together = ",".join(map(str, every))
    if choice.mode == "ssd":
        budget = config.ssd_budget if config.ssd_budget is not None else choice.detail["budget"]
        return replace(config, speculative_mode="ssd", num_speculative_tokens=choice.k, ssd_budget=budget,
                       draft_dtype=choice.detail.get("draft_format", measured.ssd_format),
                       cpu_cores=";".join(",".join(map(str, s)) for s in (target_cores, draft_cores)))
    # the benchmarking-only options of modes not chosen are dropped: they would not apply
    if choice.mode == "sd":
        return replace(config, speculative_mode="sd", num_speculative_tokens=choice.k, draft_dtype=measured.sd_format,
                       cpu_cores=together, num_threads=config.num_threads or len(every), synthetic_hit=None)
    return replace(config, speculative_mode="ar", cpu_cores=together, num_threads=config.num_threads or len(every),
                   synthetic_acceptance=None, synthetic_hit=None)
