"""What a mode prediction rests on: placement, measured costs (cached per machine), acceptance."""

from dataclasses import dataclass, replace

from ssd_engine.core.config import EngineConfig
from ssd_engine.core.config_sections import ModelConfig
from ssd_engine.core.core_sets import format_core_sets
from ssd_engine.core.synthetic_hook import Synthetic
from ssd_engine.distributed.partition import check_splittable
from ssd_engine.kernels import gguf_cpu
from ssd_engine.layers.weight_formats import FORMATS
from ssd_engine.models.default_models import cache_dir
from ssd_engine.models.loader import load_config
from ssd_engine.models.model_paths import resolve_model_path
from ssd_engine.planning import gpu_costs
from ssd_engine.planning.costs import MeasuredCosts, Placement, load_or_measure
from ssd_engine.planning.mode_placement import placement_for, placement_key
from ssd_engine.planning.predict import Acceptance
from ssd_engine.saguaro.calibration import CONFIG_DIR, find_calibrations, model_fingerprint


@dataclass(frozen=True)
class Survey:
    """What a prediction rests on: where each mode runs and its measured costs."""

    placement: Placement
    measured: MeasuredCosts
    acceptance: Acceptance
    how: str


def survey(config: EngineConfig) -> Survey:
    """This machine's costs for the config's pair and placement (measured once, then cached).
    Raises NotMeasured where planning/costs.py cannot time the device."""
    target_path, draft_path = resolve_model_path(config), resolve_model_path(config, "draft")
    model, speculative = config.model, config.speculative
    tp, draft_dtype = config.parallel.tensor_parallel_size, speculative.draft_dtype
    if tp > 1:  # an unsplittable target fails here, naming its sizes, before any rank is started
        check_splittable(load_config(target_path, "dummy"), tp)
    placement, no_ssd = placement_for(config)
    key = "-".join(
        [
            placement_key(placement, tp),
            model_fingerprint(target_path)[:8],
            model_fingerprint(draft_path)[:8],
            draft_dtype,
        ]
        + (["+".join(FORMATS)] if draft_dtype == "auto" else [])  # another candidate: measured anew
        + ([model.target_dtype] if model.weight_format else [])
        # a GGUF target's costs are its kernels': another build of them is measured anew
        + ([gguf_cpu.library_key()] if model.weight_format in ("gguf", "gguf-int8") else [])
    )
    # the target as the engine would run it, less what a timing leaves out (its own threads,
    # tokenizer and load format, compiling, graphs on a CPU)
    timed = ModelConfig(
        target_path,
        dtype=model.dtype,
        device=model.device,
        attention_backend=model.attention_backend,
        fused_kernels=model.fused_kernels,
        weight_layout=model.weight_layout,
        graph_max_batch=model.graph_max_batch if placement.device != "cpu" else 0,
        weight_format=model.weight_format,
        row_independent=model.row_independent,
    )
    measured, cached = load_or_measure(
        key,
        str(cache_dir()),
        timed,
        replace(timed, path=draft_path),
        draft_dtype,
        placement,
        measure_gpu=gpu_costs.measure,
    )
    ssd = speculative.ssd
    calibrations = find_calibrations(target_path, draft_path, ssd.calibration_dir or CONFIG_DIR)
    how = (
        f"{'cached ' if cached else ''}costs measured on {len(placement.every)} "
        f"{'core(s)' if placement.device == 'cpu' else 'GPU(s)'} in {measured.seconds:.0f} s"
    )
    if tp > 1:
        how += (
            f", the target on {tp} tensor-parallel ranks ({_where(placement.ranks, placement.device)}), "
            f"SD's draft in rank 0"
        )
        if placement.ssd_draft:
            how += (
                f", SSD's ranks on {_where(placement.ssd_ranks, placement.device)} and its draft on "
                f"{_where([placement.ssd_draft], placement.device)}"
            )
    if no_ssd:
        how += f"; SSD not a candidate ({no_ssd})"
    how += f"; acceptance from {'the pair calibration' if calibrations else 'defaults (no calibration)'}"
    acceptance = with_synthetic(
        Acceptance.from_calibration(calibrations[0] if calibrations else None), config
    )
    if speculative.synthetic is not None:
        how += " (the synthetic acceptance / hit rates replace what they set)"
    return Survey(placement, measured, acceptance, how)


def _where(sets: list[list[int]], device: str) -> str:
    return (
        "cores " + format_core_sets(sets)
        if device == "cpu"
        else ", ".join(f"cuda:{g}" for s in sets for g in s)
    )


def with_synthetic(acceptance: Acceptance, config: EngineConfig) -> Acceptance:
    """Benchmarking: under a synthetic acceptance every draft is accepted with probability alpha, and
    under a synthetic hit rate a lookup hits with probability p whatever the fan-out (r = 0)."""
    synthetic = config.speculative.synthetic or Synthetic()
    if synthetic.acceptance is not None:
        acceptance = replace(acceptance, position_rates=(float(synthetic.acceptance),))
    if synthetic.hit is not None:
        acceptance = replace(acceptance, miss_by_fanout=(1.0 - synthetic.hit,), r=0.0)
    return acceptance
