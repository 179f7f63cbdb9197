"""CLI: python -m ssd_engine.calibrate [--model M --draft-model D] --temperature T

Measures what Saguaro needs for one model pair at one temperature (three short SSD runs: fan-out
1 and 3 with just-in-time backup, then fast backup only) and writes it as JSON under configs/."""

import datetime
import logging
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ssd_engine.cli_args import ArgumentParser, add_engine_args, engine_options, fail
from ssd_engine.core.config import EngineConfig
from ssd_engine.saguaro.calibration import (
    CONFIG_DIR,
    Calibration,
    best_budget,
    budget_from_timings,
    fit_power_law,
    miss_curve,
    model_fingerprint,
)
from ssd_engine.saguaro.fanout import expected_hit_rate, fanout_for_outcomes
from ssd_engine.saguaro.source import Source
from ssd_engine.utils.machine import cpu_fingerprint

PROMPTS = Path(__file__).resolve().parent / "saguaro" / "calibration_prompts.txt"
ENGINE_FIELDS_SET_HERE = (
    "speculative_mode",
    "ssd_fanout",
    "ssd_fallback",
    "ssd_budget",
    "calibration_dir",
)


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="python -m ssd_engine.calibrate",
        description=__doc__.splitlines()[0],
        allow_abbrev=False,
    )
    parser.add_argument(
        "--temperature", type=float, required=True, help="sampling temperature to calibrate for"
    )
    parser.add_argument(
        "--num-prompts",
        type=int,
        default=8,
        help="calibration prompts to run (bundled set, cycled)",
    )
    parser.add_argument(
        "--new-tokens", type=int, default=48, help="tokens generated per prompt in the main run"
    )
    parser.add_argument(
        "--out-dir",
        default=str(CONFIG_DIR),
        help="where the JSON goes (the engine looks in configs/)",
    )
    add_engine_args(parser, skip=("seed",) + ENGINE_FIELDS_SET_HERE)
    return parser


def load_prompts(count: int) -> list[str]:
    lines = [
        ln.rstrip("\n").replace("\\n", "\n")
        for ln in PROMPTS.read_text().splitlines()
        if ln.strip()
    ]
    return (lines * count)[:count]


def _run(options: dict, prompts: list[str], temperature: float, new_tokens: int, **overrides):
    """One SSD run -> its SSDMetrics and the resolved model paths."""
    from ssd_engine import LLM, SamplingParams
    from ssd_engine.models.model_paths import resolve_model_path

    with (
        tempfile.TemporaryDirectory() as nowhere,
        LLM(
            **{**options, **overrides, "speculative_mode": "ssd", "calibration_dir": nowhere}
        ) as llm,
    ):
        llm.generate(
            prompts[:1],
            SamplingParams(temperature=temperature, max_tokens=4, seed=0),
            use_tqdm=False,
        )
        llm.engine.reset_speculation_metrics()  # drop the warm-up's counters
        params = [
            SamplingParams(temperature=temperature, max_tokens=new_tokens, seed=i, ignore_eos=True)
            for i in range(len(prompts))
        ]
        for prompt, p in zip(prompts, params):  # batch 1: the budget is per sequence
            llm.generate([prompt], p, use_tqdm=False)
        return (
            llm.engine.ssd_metrics,
            llm.engine.model_path,
            resolve_model_path(llm.config, "draft"),
        )


def _median_step(metrics) -> tuple[int, float]:
    samples = metrics.step_samples
    rows = max(r for r, _ in samples)
    widest = sorted(s for r, s in samples if r == rows)
    return rows, widest[len(widest) // 2]


def calibrate(options: dict, temperature: float, num_prompts: int, new_tokens: int) -> Calibration:
    prompts = load_prompts(num_prompts)
    k = EngineConfig.from_kwargs(**options).speculative.k
    main, target_path, draft_path = _run(
        options, prompts, temperature, new_tokens, ssd_fanout=1, ssd_fallback="jit"
    )
    wide, _, _ = _run(
        options, prompts[:2], temperature, new_tokens // 2, ssd_fanout=3, ssd_fallback="jit"
    )
    fast, _, _ = _run(
        options, prompts[:4], temperature, new_tokens // 2, ssd_fanout=0, ssd_fallback="fast"
    )

    primary = (Source.HIT.label, Source.JIT.label)
    drafted = sum(main.drafted.get(s, 0) for s in primary)
    alpha = sum(main.accepted.get(s, 0) for s in primary) / max(drafted, 1)
    misses = miss_curve([a + b for a, b in zip(main.rank_counts(), wide.rank_counts())])
    r, coeff = fit_power_law(misses)
    verify_s = main.verify_s / max(main.verify_rounds, 1)
    glue_s = main.glue_s / max(main.timed_rounds, 1)
    (rows1, step1), (rows2, step2) = _median_step(main), _median_step(wide)
    per_row = max((step2 - step1) / (rows2 - rows1), 0.0) if rows2 != rows1 else 0.0
    step_s = lambda rows: step1 + per_row * (rows - rows1)
    miss_at = lambda f: misses[f - 1] if f <= len(misses) else misses[-1]
    fits = budget_from_timings(verify_s, glue_s, step_s, k)
    rounds_per_accepted = [sum(col) for col in zip(*main.rounds_by_accepted.values())]
    outcome_probs = [n / sum(rounds_per_accepted) for n in rounds_per_accepted]
    budget = best_budget(
        verify_s, glue_s, step_s, k, outcome_probs, r, miss_at, miss_cost_s=k * step_s(1)
    )
    fanout = fanout_for_outcomes(outcome_probs, r, budget)
    e_primary, _ = main.tokens_per_round((Source.HIT, Source.JIT))
    e_fast, _ = fast.tokens_per_round((Source.FAST,))
    return Calibration(
        target=model_fingerprint(target_path),
        draft=model_fingerprint(draft_path),
        temperature=temperature,
        k=k,
        alpha=round(alpha, 4),
        outcome_probs=[round(p, 4) for p in outcome_probs],
        r=round(r, 4),
        miss_coeff=round(coeff, 4),
        miss_by_fanout=[round(m, 4) for m in misses],
        budget=budget,
        budget_fits=fits,
        t_p=round((glue_s + k * step_s(budget)) / verify_s, 4),
        e_primary=round(e_primary, 4),
        e_fast=round(e_fast, 4),
        p_hit=round(expected_hit_rate(fanout, outcome_probs, miss_at), 4),
        t_slow=round(main.jit_s / main.jit_rounds / verify_s, 4) if main.jit_rounds else None,
        timings=dict(
            verify_s=round(verify_s, 4),
            glue_s=round(glue_s, 4),
            step_s_at_rows={str(rows1): round(step1, 4), str(rows2): round(step2, 4)},
            step_s_per_extra_row=round(per_row, 5),
        ),
        measured=dict(
            target_name=Path(target_path).name,
            draft_name=Path(draft_path).name,
            fanout_at_budget=fanout,
            outcomes_ranked=sum(main.rank_counts()),
            rounds=main.verify_rounds,
            prompts=num_prompts,
            new_tokens=new_tokens,
            date=datetime.date.today().isoformat(),
            machine=f"{platform.machine()} {platform.processor()}",
            cpu_fingerprint=cpu_fingerprint(),
            engine_options=dict(options),
            commit=_commit(),
        ),
    )


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = build_parser().parse_args(argv)
    if args.temperature < 0:
        fail(f"--temperature must be >= 0, got {args.temperature}")
    if args.num_prompts < 1 or args.new_tokens < 8:
        fail("--num-prompts must be >= 1 and --new-tokens >= 8")
    started = time.perf_counter()
    try:
        cal = calibrate(engine_options(args), args.temperature, args.num_prompts, args.new_tokens)
    except ValueError as error:
        fail(str(error))
    path = cal.save(Path(args.out_dir))
    print(
        f"[calibrate] alpha={cal.alpha} r={cal.r} budget B={cal.budget} (fits in a verification: {cal.budget_fits}) "
        f"fan-out={cal.measured['fanout_at_budget']} T_p={cal.t_p} p_hit={cal.p_hit} "
        f"E_p={cal.e_primary} E_fast={cal.e_fast} ({time.perf_counter() - started:.0f} s) -> {path}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
