"""speculative_mode="auto": run the mode (AR, SD or SSD) and K predicted fastest on this machine.

SSD is a candidate only where its draft gets cores (or a GPU) of its own: no prediction covers a
draft sharing the target's. A speculative mode must beat AR by MARGIN, so a prediction error costs
little where AR is nearly as fast. What nothing times runs unmeasured, and `how` says so."""
import hashlib
import logging
from dataclasses import dataclass, field, replace

import torch

from ssd_engine.core.config import EngineConfig, Synthetic, format_core_sets, parse_core_sets
from ssd_engine.core.config_parts import ModelConfig
from ssd_engine.distributed.partition import check_splittable
from ssd_engine.distributed.placement import available_cores, plan_core_sets, split_evenly
from ssd_engine.kernels import gguf_cpu
from ssd_engine.layers.weight_formats import FORMATS
from ssd_engine.models.default_models import cache_dir
from ssd_engine.models.loader import load_config
from ssd_engine.models.model_paths import resolve_model_path
from ssd_engine.planning import gpu_costs
from ssd_engine.planning.costs import MeasuredCosts, NotMeasured, Placement, load_or_measure
from ssd_engine.planning.predict import Acceptance, Prediction, predict_all, predict_ssd
from ssd_engine.saguaro.calibration import CONFIG_DIR, find_calibrations, model_fingerprint
from ssd_engine.saguaro.plan import needs_calibration
from ssd_engine.tensor_parallel.launch import torchrun_world
from ssd_engine.utils.machine import cpu_fingerprint, fingerprint

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
    """What a prediction rests on: where each mode runs and its measured costs."""
    placement: Placement
    measured: MeasuredCosts
    acceptance: Acceptance
    how: str


def placement_for(config: EngineConfig) -> tuple[Placement, str]:
    """Where AR, SD and SSD would run, as the engine places them; why SSD is no candidate ("")."""
    if config.device != "cpu":
        return _gpu_placement(config)
    tp = config.tensor_parallel_size
    sets = parse_core_sets(config.cpu_cores) if config.cpu_cores else [available_cores()]
    every = sorted({c for s in sets for c in s})
    if tp == 1:
        half = len(every) // 2
        if not half:
            return Placement([every], [every], []), "one core: the draft would share it"
        target_cores, draft_cores = (sets[0], sets[1]) if len(sets) == 2 else (every[:half], every[half:])
        return Placement([every], [target_cores], draft_cores), ""
    if config.cpu_cores:
        plan_core_sets(len(sets), config.cpu_cores)  # the engine's checks (available, disjoint) before any pinning
    if len(every) < tp:
        raise ValueError(f"{tp} ranks need {tp} disjoint core sets but only {len(every)} cores {every} are given "
                         f"or available; pass cpu_cores to place them explicitly")
    ranks = sets if len(sets) == tp else split_evenly(every, tp)
    ssd = sets if len(sets) == tp + 1 else split_evenly(every, tp + 1) if len(every) > tp else None
    if torchrun_world() is not None:
        return Placement(ranks, ranks, []), "under torchrun the SSD draft gets no cores of its own"
    if ssd is None:
        return Placement(ranks, ranks, []), (f"{tp} ranks + its draft need {tp + 1} disjoint core sets, "
                                             f"{len(every)} core(s) here: the draft would share the ranks'")
    return Placement(ranks, ssd[:-1], ssd[-1]), ""


def _gpu_placement(config: EngineConfig) -> tuple[Placement, str]:
    """Rank r on the config's GPU + r; SSD's draft on the next, a candidate only where it exists."""
    first, tp, count = torch.device(config.device).index or 0, config.tensor_parallel_size, len(_gpus())
    ranks = [[first + r] for r in range(tp)]
    if first + tp < count:
        return Placement(ranks, ranks, [first + tp], config.device), ""
    why = f"{tp} rank GPU(s) + the draft's need GPUs up to cuda:{first + tp}, {count} here: the draft would share one"
    return Placement(ranks, ranks, [], config.device), why


def _gpus() -> list[str]:  # the visible GPUs' names (tests replace this to plan for GPUs this machine lacks)
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def _placement_key(placement: Placement, tp: int) -> str:
    """The cached costs' machine part, plus the placement for ranks and GPUs (cpu_cores vary)."""
    every = placement.every
    if placement.device == "cpu" and tp == 1:
        return fingerprint(every, len(every))
    where = f"{format_core_sets(placement.ranks)}|{format_core_sets(placement.ssd_ranks)}|{format_core_sets([placement.ssd_draft])}"
    machine = fingerprint(every, len(every)) if placement.device == "cpu" else "|".join([torch.__version__] + _gpus())
    return f"tp{tp}-" + hashlib.blake2b(f"{machine}|{where}".encode(), digest_size=6).hexdigest()


def survey(config: EngineConfig) -> Survey:
    """This machine's costs for the config's pair and placement (measured once, then cached).
    Raises NotMeasured where planning/costs.py cannot time the device."""
    target_path, draft_path = resolve_model_path(config), resolve_model_path(config, "draft")
    tp = config.tensor_parallel_size
    if tp > 1:  # an unsplittable target fails here, naming its sizes, before any rank is started
        check_splittable(load_config(target_path, "dummy"), tp)
    placement, no_ssd = placement_for(config)
    key = "-".join([_placement_key(placement, tp), model_fingerprint(target_path)[:8],
                    model_fingerprint(draft_path)[:8], config.draft_dtype]
                   + (["+".join(FORMATS)] if config.draft_dtype == "auto" else [])  # another candidate: measured anew
                   + ([config.target_dtype] if config.target_weight_format else [])
                   # a GGUF target's costs are its kernels': another build of them is measured anew
                   + ([gguf_cpu.library_key()] if config.target_weight_format in ("gguf", "gguf-int8") else []))
    model = ModelConfig(target_path, None, config.dtype, config.device, config.weight_layout,
                        config.attention_backend, config.graph_max_batch if placement.device != "cpu" else 0,
                        weight_format=config.target_weight_format, fused_kernels=config.fused_kernels,
                        row_independent=config.target_weight_format is not None)
    measured, cached = load_or_measure(key, str(cache_dir()), model, replace(model, path=draft_path),
                                       config.draft_dtype, placement, measure_gpu=gpu_costs.measure)
    calibrations = find_calibrations(target_path, draft_path, config.calibration_dir or CONFIG_DIR)
    how = (f"{'cached ' if cached else ''}costs measured on {len(placement.every)} "
           f"{'core(s)' if placement.device == 'cpu' else 'GPU(s)'} in {measured.seconds:.0f} s")
    if tp > 1:
        how += (f", the target on {tp} tensor-parallel ranks ({_where(placement.ranks, placement.device)}), "
                f"SD's draft in rank 0")
        if placement.ssd_draft:
            how += f", SSD's ranks on {_where(placement.ssd_ranks, placement.device)} and its draft on " \
                   f"{_where([placement.ssd_draft], placement.device)}"
    if no_ssd:
        how += f"; SSD not a candidate ({no_ssd})"
    how += f"; acceptance from {'the pair calibration' if calibrations else 'defaults (no calibration)'}"
    acceptance = with_synthetic(Acceptance.from_calibration(calibrations[0] if calibrations else None), config)
    if config.synthetic is not None:
        how += " (the synthetic acceptance / hit rates replace what they set)"
    return Survey(placement, measured, acceptance, how)


def _where(sets: list[list[int]], device: str) -> str:
    return "cores " + format_core_sets(sets) if device == "cpu" else ", ".join(f"cuda:{g}" for s in sets for g in s)


def with_synthetic(acceptance: Acceptance, config: EngineConfig) -> Acceptance:
    """Benchmarking: under a synthetic acceptance every draft is accepted with probability alpha, and
    under a synthetic hit rate a lookup hits with probability p whatever the fan-out (r = 0)."""
    synthetic = config.synthetic or Synthetic()
    if synthetic.acceptance is not None:
        acceptance = replace(acceptance, position_rates=(float(synthetic.acceptance),))
    if synthetic.hit is not None:
        acceptance = replace(acceptance, miss_by_fanout=(1.0 - synthetic.hit,), r=0.0)
    return acceptance


def resolve_auto(config: EngineConfig) -> tuple[EngineConfig, ModeChoice]:
    """The config with speculative_mode="auto" replaced by the chosen mode and its settings."""
    if config.model is not None and config.draft_model is None:
        return replace(config, speculative_mode="ar"), ModeChoice("ar", 0, "no draft model")
    world = torchrun_world()
    if world is not None and world[0] != 0:
        # this rank serves rank 0's plan: measuring here would only slow rank 0's measurement
        return replace(config, speculative_mode="ar"), ModeChoice("ar", 0, f"torchrun rank {world[0]}: serves rank "
                                                                            "0, which chooses the mode")
    try:
        seen = survey(config)
    except NotMeasured as missing:
        mode, where = ("ssd", "the draft on a device of its own") if placement_for(config)[0].ssd_draft else \
            ("sd", "no device for an SSD draft of its own")
        return replace(config, speculative_mode=mode), ModeChoice(mode, config.num_speculative_tokens,
                                                                  f"not measured: {missing}; {mode.upper()}, {where}")
    choice = _choose(seen)
    if config.tensor_parallel_size > 1 and seen.placement.device == "cpu" and world is None:
        single = replace(config, tensor_parallel_size=1)
        alone = survey(single)
        one = _choose(alone)
        ranks_s, one_s = choice.predicted_tok_s[choice.mode], one.predicted_tok_s[one.mode]
        if one_s > ranks_s:
            line = (f"tensor parallelism predicted slower: {config.tensor_parallel_size} ranks {ranks_s:.2f} tok/s "
                    f"({choice.mode}), one process {one_s:.2f} ({one.mode}); running one process (a mode given "
                    f"with --mode keeps the ranks)")
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
    return ModeChoice(best.mode, best.k, seen.how, {m: p.tokens_per_s for m, p in predictions.items()}, best.detail)


def size_ssd(config: EngineConfig) -> tuple[EngineConfig, ModeChoice | None]:
    """A forced SSD on CPU without tensor parallelism: budget B, draft format and fallback timing
    from this machine's costs at K, unless given or the pair was calibrated on this kind of CPU."""
    pinned = config.draft_dtype != "auto" and not needs_calibration(config.parts().speculative.ssd)
    if config.device != "cpu" or config.tensor_parallel_size > 1 or config.ssd_budget is not None or pinned:
        return config, None
    calibrations = find_calibrations(resolve_model_path(config), resolve_model_path(config, "draft"),
                                     config.calibration_dir or CONFIG_DIR)
    if calibrations and calibrations[0].measured.get("cpu_fingerprint") == cpu_fingerprint():
        return config, None  # calibrated on this kind of CPU: its measured budget stands
    seen = survey(config)
    if not seen.placement.ssd_draft:
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


def _apply(config: EngineConfig, choice: ModeChoice, placement: Placement, measured: MeasuredCosts) -> EngineConfig:
    """The choice written into the config; on CPU the cores too, as the prediction placed them
    (except under torchrun, whose ranks the engine does not place)."""
    on_cpu = placement.device == "cpu"
    if choice.mode == "ssd":
        budget = config.ssd_budget if config.ssd_budget is not None else choice.detail["budget"]
        changes = dict(speculative_mode="ssd", num_speculative_tokens=choice.k, ssd_budget=budget)
        if on_cpu:
            changes["draft_dtype"] = choice.detail.get("draft_format", measured.ssd_format)
            if torchrun_world() is None:
                changes["cpu_cores"] = format_core_sets(placement.ssd_ranks + [placement.ssd_draft])
        return replace(config, **changes)
    synthetic = config.synthetic or Synthetic()
    kept = Synthetic(synthetic.acceptance if choice.mode == "sd" else None)  # SD draws no lookups, AR no drafts
    changes = dict(speculative_mode=choice.mode, synthetic=kept if kept.acceptance is not None else None)
    if choice.mode == "sd":
        changes["num_speculative_tokens"] = choice.k
        if on_cpu:
            changes["draft_dtype"] = measured.sd_format
    if on_cpu and torchrun_world() is None:
        changes["cpu_cores"] = format_core_sets(placement.ranks)
        if len(placement.ranks) == 1:
            changes["num_threads"] = config.num_threads or len(placement.ranks[0])
    return replace(config, **changes)
