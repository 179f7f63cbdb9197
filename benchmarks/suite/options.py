"""bench.py's command line. With no flags: the built-in default pair, 4 HumanEval problems x 64
new tokens, greedy, batch 1, K = 4, modes ar, sd, ssd; the target (and AR, SD) on core 0, the SSD
draft process on core 1 (the paper's placement: SSD adds the draft's own device). `ar-all`,
`sd-all` and `auto` get both sets: what SSD's two sets are worth to a mode that is not split."""

import argparse
import os
from dataclasses import dataclass, field

from ssd_engine.core.core_sets import format_core_sets
from ssd_engine.core.option_choices import DRAFT_DTYPES, TARGET_DTYPES

MODES = ("ar", "ar-all", "sd", "sd-all", "ssd", "auto", "hf-ar", "hf-assisted")
SPECULATIVE = ("sd", "sd-all", "ssd", "auto", "hf-assisted")  # need a draft checkpoint
SPLIT = (
    "ssd",
    "auto",
)  # the draft gets (ssd) or may get (auto) its own core set: the sets must be disjoint
RESULTS_DIR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results"
)  # committed results


@dataclass
class BenchOptions:
    modes: list[str]
    prompt_sets: list[str]
    num_prompts: int
    new_tokens: int
    batch: list[int]
    k: list[int]
    draft_dtype: str
    temperature: float
    model: str | None
    draft: str | None
    device: str
    dtype: str
    tp: int
    cores: set[int]
    draft_cores: set[int]
    threads: int
    layout: str
    fanout: str | None
    fallback: str | None
    prefix: int
    reps: int
    passes: int
    out: str
    tag: str
    readme: bool
    budget: int | None = None  # SSD's ssd_budget (unset: the engine's)
    load_format: str = "auto"  # dummy: random weights from config.json (our engine only)
    tokenizer: str | None = None  # our engine's tokenizer folder (a dummy model may lack one)
    synthetic_acceptance: float | None = (
        None  # benchmarking only: drafts accepted at this rate (sd, ssd, auto)
    )
    synthetic_hit: float | None = None  # benchmarking only: SSD cache lookups hit at this rate
    draft_host: str | None = (
        None  # SSD's ssd_draft_host: process or thread (unset: the engine's auto)
    )
    target_dtype: str = "auto"  # our target's Linear format (EngineConfig.target_dtype)
    argv: list[str] = field(default_factory=list)

    def placement(self, with_draft: bool) -> str:
        """cpu_cores for our engine: --cores split evenly over the TP ranks, then the draft's set."""
        cores = sorted(self.cores)
        per_rank = len(cores) // self.tp
        sets = [cores[r * per_rank : (r + 1) * per_rank] for r in range(self.tp)]
        if with_draft:
            sets.append(sorted(self.draft_cores))
        return format_core_sets(sets)

    def placement_text(self) -> str:
        if self.device.startswith("cuda"):
            gpus = ", ".join(str(g) for g in range(self.tp))
            if self.draft_host == "thread":
                return (
                    f"target on GPU {gpus} (TP {self.tp}); SSD draft as a thread of the engine process on its "
                    f"own CUDA stream, on GPU {self.tp} when that GPU exists, else on the last GPU, shared"
                )
            if self.draft_host == "process":
                return (
                    f"target on GPU {gpus} (TP {self.tp}); SSD draft process on GPU {self.tp} when that GPU "
                    f"exists, else on the last GPU, shared with the target"
                )
            return (
                f"target on GPU {gpus} (TP {self.tp}); SSD draft process on GPU {self.tp} when that GPU exists, "
                f"else a thread of the engine process on its own CUDA stream on the last GPU, shared (auto)"
            )
        return (
            f"target (and ar, sd, hf-*) on cores {sorted(self.cores)} with {self.threads} thread(s), TP {self.tp}; "
            f"SSD draft process on cores {sorted(self.draft_cores)}; ar-all, sd-all and auto on both"
        )


def _csv(text: str, cast=str) -> list:
    return [cast(x.strip()) for x in text.split(",") if x.strip()]


def parse(argv: list[str]) -> BenchOptions:
    p = argparse.ArgumentParser(
        prog="python benchmarks/bench.py",
        description="AR / SD / SSD and transformers' peers side by side, in the paper's table shape.",
    )
    p.add_argument("--mode", default="ar,sd,ssd", help="comma-separated, from: " + ", ".join(MODES))
    p.add_argument(
        "--prompts",
        default="humaneval",
        help="comma-separated prompt sets: humaneval, gsm8k, alpaca, mtbench, code, english",
    )
    p.add_argument("--num-prompts", type=int, default=4, help="prompts per set")
    p.add_argument(
        "--new-tokens", type=int, default=64, help="tokens generated per prompt (EOS ignored)"
    )
    p.add_argument("--batch", default="1", help="comma-separated batch sizes")
    p.add_argument("--k", default="4", help="comma-separated draft lengths K")
    p.add_argument(
        "--draft-dtype",
        default="auto",
        choices=DRAFT_DTYPES,
        help="our draft's weight format (sd, sd-all, ssd, auto); auto: the engine measures and picks",
    )
    p.add_argument(
        "--target-dtype",
        default="auto",
        choices=TARGET_DTYPES,
        help="our target's weight format (every mode of ours); gguf keeps the GGUF's own blocks (the "
        "checkpoint's values); bf16/int8/int4 re-quantize it: a different "
        "model, which SD/SSD reproduce exactly (transformers' peers keep the checkpoint)",
    )
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument(
        "--model",
        default=None,
        help="target HF folder or .gguf file (converted once into the engine's "
        "cache; default: the built-in target)",
    )
    p.add_argument(
        "--draft",
        default=None,
        help="draft HF folder or .gguf file (default: the built-in draft; needed with --model)",
    )
    p.add_argument(
        "--device", default="cpu", help="cpu | cuda (TP target on GPUs 0..N-1, the draft on GPU N)"
    )
    p.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks of our target")
    p.add_argument(
        "--cores",
        default="0",
        help="CPU: cores of the target (split over --tp ranks), AR, SD, hf-*",
    )
    p.add_argument(
        "--draft-cores",
        default="1",
        help="CPU: cores of the SSD draft process (ar-all, sd-all, auto add them to --cores)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads per process (default: cores per rank)",
    )
    p.add_argument("--layout", default="auto", help="our cpu_weight_layout")
    p.add_argument(
        "--fanout",
        default=None,
        help="SSD fan-out (default: the engine's, auto from the calibration)",
    )
    p.add_argument(
        "--fallback",
        default=None,
        help="SSD miss fallback jit | fast | auto (default: the engine's)",
    )
    p.add_argument(
        "--budget",
        type=int,
        default=None,
        help="SSD budget B, the fan-out's sum (default: the engine's)",
    )
    p.add_argument(
        "--draft-host",
        default=None,
        choices=("process", "thread"),
        help="where the SSD draft runs: its own process, or a thread of the engine on its own CUDA stream "
        "(default: the engine's, process)",
    )
    p.add_argument(
        "--load-format",
        default="auto",
        choices=("auto", "dummy"),
        help="our engine's load_format: dummy builds random weights from config.json (no checkpoint)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="our engine's tokenizer folder (default: the model folder)",
    )
    p.add_argument(
        "--synthetic-acceptance",
        type=float,
        default=None,
        metavar="ALPHA",
        help="BENCHMARKING ONLY, outputs are not the target's: sd / ssd / auto accept each draft token "
        "with probability ALPHA instead of verifying it",
    )
    p.add_argument(
        "--synthetic-hit",
        type=float,
        default=None,
        metavar="P",
        help="BENCHMARKING ONLY: each SSD cache lookup hits with probability P",
    )
    p.add_argument(
        "--prefix", type=int, default=200, help="prefix length of the forward-cost probes"
    )
    p.add_argument(
        "--reps", type=int, default=3, help="repetitions of each forward-cost probe (0: skip them)"
    )
    p.add_argument(
        "--passes",
        type=int,
        default=1,
        help="run the mode list this many times, alternating its order (A B C, C B A, ...), and average: "
        "a drifting machine's trend cancels from ratios between modes",
    )
    p.add_argument(
        "--out",
        default=None,
        help="results folder (default: benchmarks/results, where the committed results live)",
    )
    p.add_argument(
        "--tag", default="", help="appended to the result files' names: DATE-bench-TAG.*"
    )
    p.add_argument(
        "--readme",
        action="store_true",
        help="also put the headline table into README.md's benchmark section",
    )
    a = p.parse_args(argv)

    modes = _csv(a.mode)
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        p.error(
            f"unknown mode {unknown[0]!r}; choose from {', '.join(MODES)}"
            if unknown
            else "--mode is empty"
        )
    batch, k = _csv(a.batch, int), sorted(set(_csv(a.k, int)))
    if not batch or min(batch) < 1:
        p.error("--batch needs batch sizes >= 1")
    if not k or min(k) < 1:
        p.error("--k needs draft lengths >= 1")
    if a.passes < 1:
        p.error("--passes must be >= 1")
    if a.temperature < 0:
        p.error("--temperature must be >= 0")
    for flag, value in (
        ("--synthetic-acceptance", a.synthetic_acceptance),
        ("--synthetic-hit", a.synthetic_hit),
    ):
        if value is not None and not 0 <= value <= 1:
            p.error(f"{flag} must be in [0, 1], got {value}")
    real_only = [m for m in modes if m.startswith("hf-")]
    if real_only and (
        a.load_format != "auto" or a.synthetic_acceptance is not None or a.synthetic_hit is not None
    ):
        p.error(
            f"{real_only[0]} runs transformers on the real checkpoint: --load-format dummy and --synthetic-* "
            f"are our engine's"
        )
    if a.budget is not None and a.budget < 0:
        p.error("--budget must be >= 0")
    if a.device != "cpu" and not a.device.startswith("cuda"):
        p.error(f"--device must be cpu or cuda, got {a.device!r}")
    cores, draft_cores = set(_csv(a.cores, int)), set(_csv(a.draft_cores, int))
    if a.device == "cpu" and len(cores) < a.tp:
        p.error(f"--tp {a.tp} needs at least {a.tp} cores in --cores")
    if a.device != "cpu" and a.draft_dtype in ("int8", "int4"):
        p.error(f"--draft-dtype {a.draft_dtype} is CPU-only; on {a.device} use auto, bf16 or fp32")
    if a.device != "cpu" and a.target_dtype in ("gguf", "int8", "int4"):
        p.error(f"--target-dtype {a.target_dtype} is CPU-only; on {a.device} use fp32 or bf16")
    if a.device == "cpu" and any(m in SPLIT for m in modes) and cores & draft_cores:
        p.error(
            f"--cores and --draft-cores overlap on {sorted(cores & draft_cores)}: the draft needs its own cores"
        )
    speculative = any(m in SPECULATIVE for m in modes)
    if a.model is not None and a.draft is None and speculative:
        p.error("--model was given, so " + " / ".join(SPECULATIVE) + " need --draft too")
    from ssd_engine.models.model_paths import resolve_model_arg

    # folders as given; a GGUF converted here, once, and None the built-in pair's: every mode
    # (transformers' peers too) then reads the same folder
    model = resolve_model_arg(a.model, "target")
    draft = resolve_model_arg(a.draft, "draft") if a.draft is not None or speculative else None
    out = a.out or RESULTS_DIR
    return BenchOptions(
        modes=modes,
        prompt_sets=_csv(a.prompts),
        num_prompts=a.num_prompts,
        new_tokens=a.new_tokens,
        batch=batch,
        k=k,
        draft_dtype=a.draft_dtype,
        temperature=a.temperature,
        model=model,
        draft=draft,
        device=a.device,
        dtype=a.dtype or ("bfloat16" if a.device.startswith("cuda") else "float32"),
        tp=a.tp,
        cores=cores,
        draft_cores=draft_cores,
        threads=a.threads or max(len(cores) // a.tp, 1),
        layout=a.layout,
        fanout=a.fanout,
        fallback=a.fallback,
        prefix=a.prefix,
        reps=a.reps,
        passes=a.passes,
        out=out,
        tag=a.tag,
        readme=a.readme,
        budget=a.budget,
        load_format=a.load_format,
        tokenizer=a.tokenizer,
        synthetic_acceptance=a.synthetic_acceptance,
        synthetic_hit=a.synthetic_hit,
        draft_host=a.draft_host,
        target_dtype=a.target_dtype,
        argv=list(argv),
    )
