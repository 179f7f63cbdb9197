"""EngineConfig's speculative section and its SSD sub-section (core/config_sections.py says how a
section declares its options). Inside the engine K is `speculative.k` and the mode
`speculative.mode` (speculative_mode as given, unset decided; `auto` is replaced by planning's
choice through `with_options`)."""

from dataclasses import dataclass

from ssd_engine.core.option_choices import (
    DRAFT_DTYPES,
    FANOUT_RULES,
    PER_STEP_POLICIES,
    SPECULATIVE_MODES,
    SSD_DRAFT_HOSTS,
    SSD_FALLBACKS,
)
from ssd_engine.core.options import hook, option, resolved, section
from ssd_engine.core.synthetic_hook import Synthetic


@dataclass(frozen=True, slots=True)
class SSDConfig:
    """The asynchronous draft's policy: fan-out, its budget, and what a cache miss takes."""

    fanout: str | int | tuple = option(
        "auto",
        "SSD bonus candidates per accepted count k: auto (Theorem 12 "
        "on the calibration's measured P(k)), geometric (Theorem 12 "
        "with i.i.d. acceptance alpha), uniform, one integer, or K+1 "
        "comma-separated integers",
        name="ssd_fanout",
    )
    budget: int | None = option(
        None,
        "B, the sum of the SSD fan-out; unset: the calibration's measured time budget",
        name="ssd_budget",
        at_least=0,
    )
    fit_window: bool = option(
        True,
        "shrink the SSD fan-out at run time while the draft's cache build outlasts "
        "the target's verification (T_p > 1); an explicit integer ssd_fanout is "
        "always kept as given",
        name="ssd_fit_window",
    )
    fallback: str = option(
        "auto",
        "what an SSD cache miss takes: jit (the draft drafts now), fast (n-gram, "
        "else random), auto (jit below the critical batch size b*, else fast)",
        SSD_FALLBACKS,
        name="ssd_fallback",
    )
    critical_batch: float | None = option(
        None,
        "pins b* for ssd_fallback=auto; unset: from running estimates",
        name="ssd_critical_batch",
        at_least=0,
    )
    saguaro_c: float = option(
        1.0,
        "Saguaro sampling: the draft's top-F probabilities times C, in [0, 1] (1: plain sampling)",
        at_least=0,
        at_most=1,
    )
    calibration_dir: str | None = option(
        None, "folder of Saguaro calibrations; unset: the repo's configs/"
    )
    draft_host: str = option(
        "auto",
        "where the SSD draft runs: process (its own process, on its own cores or "
        "GPU; the production shape), thread (a thread of the engine process on "
        "its own CUDA stream, so on one GPU its kernels can overlap the "
        "target's; on CPU it shares the engine's cores), auto (thread when the "
        "draft shares the target's one GPU, where it measured faster; else "
        "process)",
        SSD_DRAFT_HOSTS,
        name="ssd_draft_host",
    )
    fanout_counts: tuple[int, ...] | None = resolved(
        None,
        "ssd_fanout as K+1 integers (one given applies to every k); None for a rule (auto / "
        "geometric / uniform) the engine resolves from its calibration",
    )

    @property
    def fanout_rule(self) -> str | None:
        """auto / geometric / uniform; None when the user gave the fan-out's integers."""
        return self.fanout if isinstance(self.fanout, str) and self.fanout in FANOUT_RULES else None

    @property
    def fits_window(self) -> bool:
        """Whether builds are cut to the verification window: never for the user's integers."""
        return self.fit_window and self.fanout_rule is not None


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Whether and how a draft speculates: the mode, the draft, K, and SSD's policy."""

    draft_model: str | None = option(
        None,
        "draft model folder or .gguf file (same tokenizer as the model); unset "
        "with no model: the built-in default draft",
    )
    requested_mode: str | None = option(
        None,
        "ar: no speculation; sd: a colocated draft; ssd: speculative "
        "speculative decoding with the draft in its own process; auto: the "
        "one (and its K) predicted fastest on this machine's cores; unset: "
        "auto when a draft is known, else ar",
        SPECULATIVE_MODES,
        name="speculative_mode",
    )
    k: int = option(4, "K: draft tokens per round", name="num_speculative_tokens", at_least=1)
    per_step: str = option(
        "goodput",
        "SD: goodput (each step drafts any k from 0 to K, whichever this "
        "engine predicts emits the most tokens per second at that batch size "
        "from its measured step times and acceptance; auto gives it one K "
        "above its predicted best; a batch holding a seeded request drafts "
        "the starting K, so its tokens never depend on the batch), off "
        "(every step drafts K)",
        PER_STEP_POLICIES,
        name="speculation_per_step",
    )
    draft_dtype: str = option(
        "auto",
        "the draft's weight format (its precision never changes the output): auto "
        "picks the fastest this CPU runs, measured once per machine; int8/int4 are "
        "weight-only with bf16 activations, q4k is GGUF Q4_K blocks with int8 "
        "activations (AVX-512 VNNI), all three CPU only",
        DRAFT_DTYPES,
    )
    prompt_window: int | None = option(
        None,
        "the draft reads a long prompt's first 4 tokens and its last N only (its context never changes the "
        "output, only acceptance), so less of a prompt is read twice; unset: 128 for SD on CPU (docs/CPU.md), "
        "the whole prompt on a GPU and for SSD, whose draft reads it beside the target's prefill",
        name="draft_prompt_window",
        at_least=0,
    )
    draft_timeout_s: float = option(
        30.0, "SSD: seconds after which a draft reply counts as a dead draft", above=0
    )
    ssd: SSDConfig = section(SSDConfig)
    synthetic: Synthetic | None = hook(
        "benchmarks and tests only: drafts accepted and SSD lookups hit at set "
        "rates (core/synthetic_hook.py Synthetic); outputs are then NOT the "
        "target's"
    )
    mode: str = resolved(
        "auto", "the speculative_mode option decided: as given, or unset's auto / ar for the models"
    )

    @property
    def synthetic_acceptance(self) -> float | None:
        """Benchmarking: P(a draft token is accepted), not the target's law."""
        rate = self.synthetic.acceptance if self.synthetic else None
        return None if rate is None else float(rate)

    @property
    def synthetic_hit(self) -> float | None:
        """Benchmarking: P(an SSD lookup hits), drawn on the draft side."""
        rate = self.synthetic.hit if self.synthetic else None
        return None if rate is None else float(rate)
