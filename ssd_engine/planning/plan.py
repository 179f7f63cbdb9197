"""Everything decided before an engine is built, in one frozen `Plan`.

The engine reads only the plan: K lives in `parts.speculative.k` alone, and the flat options are
never read again. GGUF files are converted here, before any weights load, so a conversion's working
memory never adds to a loaded target's."""
from dataclasses import dataclass, replace

from ssd_engine.core.config import EngineConfig
from ssd_engine.core.config_parts import Config
from ssd_engine.models.model_paths import resolve_model_arg, resolve_model_path
from ssd_engine.planning.choose import ModeChoice, resolve_auto, size_ssd
from ssd_engine.planning.preflight import check_before_loading


@dataclass(frozen=True)
class Plan:
    parts: Config               # model.path and speculative.draft_model are folders on disk
    choice: ModeChoice | None   # auto's choice, or a forced SSD's sizing; None when the mode was given

    @property
    def mode(self) -> str:
        return self.parts.speculative.mode

    @property
    def timing(self) -> tuple[float, float] | None:
        """auto's predicted SSD (T_p, T_jit), which seed its fallback rule; None where not predicted."""
        detail = self.choice.detail if self.choice else {}
        return (detail["t_p"], detail["t_jit"]) if "t_p" in detail else None

    def describe_mode(self) -> str:
        return self.choice.describe() if self.choice else self.mode


def plan(options: EngineConfig) -> Plan:
    check_before_loading(options)
    options = convert_gguf_files(options)
    options = resolve_target_format(options)
    choice = None
    if options.speculative_mode == "auto":
        options, choice = resolve_auto(options)
    elif options.speculative_mode == "ssd":
        options, choice = size_ssd(options)
    parts = options.parts()
    model = replace(parts.model, path=resolve_model_path(options))
    draft = resolve_model_path(options, "draft") if parts.speculative.mode != "ar" else None
    return Plan(replace(parts, model=model, speculative=replace(parts.speculative, draft_model=draft)), choice)


def convert_gguf_files(options: EngineConfig) -> EngineConfig:
    """A GGUF file given as model / draft_model replaced by its converted (cached) folder."""
    changes = {}
    if options.model is not None:
        changes["model"] = resolve_model_arg(options.model)  # a folder comes back as given
    if options.speculative_mode != "ar" and options.draft_model is not None:
        changes["draft_model"] = resolve_model_arg(options.draft_model, "draft")
    return replace(options, **changes)


def resolve_target_format(options: EngineConfig) -> EngineConfig:
    """target_dtype="auto": gguf-int8 where the GGUF kernels run (a CPU target converted from a GGUF
    file whose blocks, per rank under tensor parallelism, are whole), else fp32. gguf-int8 rounds
    activations to int8 like llama.cpp (docs/CPU.md); fp32 keeps the checkpoint's values exactly."""
    if options.target_dtype != "auto":
        return options
    from ssd_engine.kernels import gguf_cpu
    from ssd_engine.models.default_models import DefaultModelError
    from ssd_engine.models.gguf_files import source_gguf
    from ssd_engine.models.gguf_weights import GGUFFile
    from ssd_engine.models.loader import load_config

    if options.device != "cpu" or options.load_format == "dummy":
        return replace(options, target_dtype="fp32")
    path = resolve_model_path(options)
    try:  # the cheap checks first: a plain folder never builds the kernels
        blocks = GGUFFile(source_gguf(path), load_config(path))
        blocks.check()
        if options.tensor_parallel_size > 1:  # each rank keeps its slice's blocks: they must be whole
            blocks.check_split(options.tensor_parallel_size)
    except (ValueError, DefaultModelError):
        return replace(options, target_dtype="fp32")  # no GGUF, or one whose blocks the kernels do not read
    return replace(options, target_dtype="gguf-int8" if gguf_cpu.available() else "fp32")
