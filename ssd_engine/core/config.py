"""EngineConfig: every engine option in one frozen, nested, validated config. Each option lives in
the section of the engine that reads it (core/config_sections.py, core/speculative_config.py) under
its own public name, unique across sections, so the flat keywords (`LLM(max_num_seqs=8)`,
`from_kwargs`, `with_options`) and the CLI flags (cli_args.py) map 1:1 onto it. Values derived from
the options are resolved here, on every construction, into resolved fields beside the options (an
option keeps what was given); checkpoint-dependent ones (max_model_len, num_kv_blocks) and the model
folders and formats are resolved by planning (planning/plan.py)."""

from dataclasses import dataclass, fields, replace

from ssd_engine.core.config_sections import (
    CacheConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from ssd_engine.core.option_checks import (
    check_choices,
    check_values,
    parse_fanout,
    unknown_option_message,
)
from ssd_engine.core.options import (
    Path,
    is_hook,
    is_section,
    option,
    option_fields,
    section,
    value_at,
)
from ssd_engine.core.speculative_config import SpeculativeConfig


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """The sections each part of the engine reads, and the seed of unseeded sampling. Built from
    flat options (`from_kwargs`) or another config (`with_options`), checked in one place
    (core/option_checks.py) and resolved on every construction, so any EngineConfig is valid."""

    model: ModelConfig = section(ModelConfig)
    speculative: SpeculativeConfig = section(SpeculativeConfig)
    scheduler: SchedulerConfig = section(SchedulerConfig)
    cache: CacheConfig = section(CacheConfig)
    parallel: ParallelConfig = section(ParallelConfig)
    seed: int = option(0, "seeds unseeded sampling")

    @property
    def compiled(self) -> bool:
        """Whether every runner (target, SD draft, SSD draft) compiles its forward
        (runtime/compiled_model.py). auto is off: compile time outweighs a typical run's gain."""
        return self.model.compile_model == "on" and not self.model.enforce_eager

    def __post_init__(self) -> None:
        speculative, model, scheduler = self.speculative, self.model, self.scheduler
        mode = speculative.requested_mode
        if mode is None:  # the default pair, or a user-given draft, means auto
            mode = "auto" if model.path is None or speculative.draft_model is not None else "ar"
        # every closed set of values, as each option declares it, and the device
        check_choices(self)
        tokens = scheduler.requested_max_num_batched_tokens
        if tokens is None:  # CPU: a long prompt's chunks beat one step (docs/CPU.md)
            tokens = 512 if model.device == "cpu" else 2048
        object.__setattr__(self, "scheduler", replace(scheduler, max_num_batched_tokens=tokens))
        speculative = replace(speculative, mode=mode)
        object.__setattr__(self, "speculative", speculative)
        check_values(self)  # each value's type and range, and combinations that cannot run
        object.__setattr__(self, "model", model.resolve(self.compiled))
        counts = parse_fanout(speculative.ssd.fanout, speculative.k)
        ssd = replace(
            speculative.ssd,
            saguaro_c=float(speculative.ssd.saguaro_c),
            fanout_counts=None if counts is None else tuple(counts),
        )
        object.__setattr__(self, "speculative", replace(speculative, ssd=ssd))

    @classmethod
    def from_kwargs(cls, **flat) -> "EngineConfig":
        """The config of these options, each by its public name (`max_num_seqs=8`); the others
        keep their defaults. An unknown name raises a one-line ValueError naming the closest."""
        return _build(cls, _routed(flat), ())

    def with_options(self, **flat) -> "EngineConfig":
        """This config with these options (public names) replaced, validated again, and every
        resolved value decided again from the options (a new device gives auto's dtype again)."""
        return _replaced(self, _routed(flat), ())

    def option_value(self, name: str) -> object:
        """The value of the option with public name `name` (`config.option_value("max_num_seqs")`)."""
        return value_at(self, next(iter(_routed({name: None}))))


def option_names() -> list[str]:
    """The public options' names, in declaration order: the hooks (benchmarks' and tests' keywords)
    are no public options, so an unknown name is never pointed at one."""
    return [name for name, (_, f) in option_fields(EngineConfig).items() if not is_hook(f)]


def _routed(flat: dict) -> dict[Path, object]:
    """Public names (and hooks) -> their fields' paths; an unknown one raises ValueError naming the
    closest public option."""
    known = option_fields(EngineConfig)
    for name in flat:
        if name not in known:
            raise ValueError(unknown_option_message(name, option_names()))
    return {known[name][0]: value for name, value in flat.items()}


def _build(kind: type, given: dict[Path, object], at: Path) -> object:
    """A `kind` (config or section) of the `given` values below path `at`, defaults elsewhere."""
    values = {}
    for f in fields(kind):
        here = at + (f.name,)
        if is_section(f):
            values[f.name] = _build(f.default_factory, given, here)
        elif here in given:
            values[f.name] = given[here]
    return kind(**values)


def _replaced(obj: object, given: dict[Path, object], at: Path) -> object:
    """`obj` with the `given` values below path `at` replaced (a section only where one changes)."""
    changes = {}
    for f in fields(obj):
        here = at + (f.name,)
        if is_section(f) and any(path[: len(here)] == here for path in given):
            changes[f.name] = _replaced(getattr(obj, f.name), given, here)
        elif here in given:
            changes[f.name] = given[here]
    return replace(obj, **changes) if changes else obj
