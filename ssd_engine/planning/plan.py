"""Everything decided before an engine is built, in one frozen `Plan`.

The engine reads only the plan: its `config` is the EngineConfig resolved (mode, K, model folders,
every model's formats; K lives in `config.speculative.k`), and the options it was given are never
read again. GGUF files are converted here, before any weights load, so a conversion's working
memory never adds to a loaded target's."""

import logging
from dataclasses import dataclass, replace

from ssd_engine.core.config import EngineConfig
from ssd_engine.core.config_sections import ModelConfig
from ssd_engine.core.core_sets import parse_core_sets
from ssd_engine.distributed.placement import available_cores, plan_core_sets
from ssd_engine.models.model_paths import resolve_model_arg, resolve_model_path
from ssd_engine.planning import formats
from ssd_engine.planning.choose import ModeChoice, resolve_auto, size_ssd
from ssd_engine.planning.preflight import check_before_loading
from ssd_engine.saguaro.plan import SaguaroPlan, plan_saguaro
from ssd_engine.tensor_parallel.launch import torchrun_world

log = logging.getLogger("ssd_engine")


@dataclass(frozen=True)
class Plan:
    config: EngineConfig  # resolved: model.path and speculative.draft_model are folders on disk; model: the target's, formats decided
    # auto's choice, or a forced SSD's sizing; None when the mode was given
    choice: ModeChoice | None
    # CPU: SSD's per target rank then the draft's, or the one given set
    core_sets: list[list[int]] | None = None
    draft: ModelConfig | None = None  # SD / SSD: the draft's model, its format and device decided
    draft_format: formats.DraftFormat | None = None
    saguaro: SaguaroPlan | None = None  # SSD: fan-outs and the fallback rule

    @property
    def mode(self) -> str:
        return self.config.speculative.mode

    def describe_mode(self) -> str:
        return self.choice.describe() if self.choice else self.mode


def plan(options: EngineConfig) -> Plan:
    check_before_loading(options)
    config = convert_gguf_files(options)
    config = resolve_target_format(config)
    choice = None
    if config.speculative.mode == "auto":
        config, choice = resolve_auto(config)
    elif config.speculative.mode == "ssd":
        config, choice = size_ssd(config)
    target_path = resolve_model_path(config)
    draft_path = resolve_model_path(config, "draft") if config.speculative.mode != "ar" else None
    config = config.with_options(model=target_path, draft_model=draft_path)
    sets = core_sets(config)
    detail = choice.detail if choice else {}
    # auto's predicted SSD (T_p, T_jit)
    timing = (detail["t_p"], detail["t_jit"]) if "t_p" in detail else None
    saguaro = (
        plan_saguaro(config.speculative, target_path, draft_path, timing)
        if config.speculative.mode == "ssd"
        else None
    )
    decided = formats.decide(config, sets, saguaro)
    return Plan(
        replace(config, model=decided.target),
        choice,
        sets,
        decided.draft,
        decided.draft_format,
        saguaro,
    )


def core_sets(config: EngineConfig) -> list[list[int]] | None:
    """On CPU, SSD's disjoint core sets: one per target rank, then the draft's (None: too few cores,
    the draft shares them); otherwise the one set `cpu_cores` gives a single process, if any."""
    model, parallel = config.model, config.parallel
    if model.device != "cpu" or torchrun_world() is not None:
        return None
    if config.speculative.mode != "ssd":
        sets = parse_core_sets(parallel.cpu_cores) if parallel.cpu_cores else []
        return sets if len(sets) == 1 and parallel.tensor_parallel_size == 1 else None
    needed = parallel.tensor_parallel_size + 1
    if parallel.cpu_cores is None and len(available_cores()) < needed:
        log.warning(
            "SSD wants %d disjoint core sets (target ranks + draft) but this process may use %d "
            "cores; the draft shares them",
            needed,
            len(available_cores()),
        )
        return None
    return plan_core_sets(needed, parallel.cpu_cores)


def convert_gguf_files(options: EngineConfig) -> EngineConfig:
    """A GGUF file given as model / draft_model replaced by its converted (cached) folder."""
    changes = {}
    if options.model.path is not None:
        changes["model"] = resolve_model_arg(options.model.path)  # a folder comes back as given
    speculative = options.speculative
    if speculative.mode != "ar" and speculative.draft_model is not None:
        changes["draft_model"] = resolve_model_arg(speculative.draft_model, "draft")
    return options.with_options(**changes)


def resolve_target_format(options: EngineConfig) -> EngineConfig:
    """target_dtype="auto": gguf-int8 where the GGUF kernels run (a CPU target converted from a GGUF
    file whose blocks, per rank under tensor parallelism, are whole), else fp32. gguf-int8 rounds
    activations to int8 like llama.cpp (docs/CPU.md); fp32 keeps the checkpoint's values exactly."""
    model = options.model
    if model.target_dtype != "auto":
        return options
    from ssd_engine.kernels import gguf_cpu
    from ssd_engine.models.default_models import DefaultModelError
    from ssd_engine.models.gguf_files import source_gguf
    from ssd_engine.models.gguf_weights import GGUFFile
    from ssd_engine.models.loader import load_config

    if model.device != "cpu" or model.load_format == "dummy":
        return options.with_options(target_dtype="fp32")
    path = resolve_model_path(options)
    try:  # the cheap checks first: a plain folder never builds the kernels
        blocks = GGUFFile(source_gguf(path), load_config(path))
        blocks.check()
        # each rank keeps its slice's blocks: they must be whole
        ranks = options.parallel.tensor_parallel_size
        if ranks > 1:
            blocks.check_split(ranks)
    except (ValueError, DefaultModelError):
        # no GGUF, or one whose blocks the kernels do not read
        return options.with_options(target_dtype="fp32")
    return options.with_options(target_dtype="gguf-int8" if gguf_cpu.available() else "fp32")
