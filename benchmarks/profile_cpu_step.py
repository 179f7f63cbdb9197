"""Where a CPU decode step's time goes, by op (torch.profiler): an AR step and an SD round of the default
pair (or --model / --draft), the ops taking the most time first. Not a test.

    python benchmarks/profile_cpu_step.py --threads 2 --out benchmarks/results/DATE-cpu-step-profile.md
"""

import argparse
import datetime
import os
import sys
import time

import torch

# 150 token ids every vocabulary has (tiny test models too)
PROMPT = [3 + i % 250 for i in range(150)]
TOP_OPS = 12


def profile_mode(
    mode: str, k: int, threads: int, steps: int, model: str | None, draft: str | None
) -> list[str]:
    from ssd_engine import LLM, SamplingParams

    options = dict(
        speculative_mode=mode, num_threads=threads, cpu_cores=",".join(map(str, range(threads)))
    )
    if mode == "sd":
        options.update(num_speculative_tokens=k, draft_model=draft)
    with LLM(model, **options) as llm:
        engine = llm.engine
        engine.add_request(
            PROMPT,
            SamplingParams(temperature=0, max_tokens=8 * (k + 1) * (steps + 8), ignore_eos=True),
        )
        for _ in range(4):  # the prefill, then warm steps
            engine.step()
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = (time.perf_counter() - start) / steps
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                engine.step()
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in ops) or 1.0
    title = "AR step" if mode == "ar" else f"SD round, K = {k}"
    lines = [
        f"### {title}: {wall * 1e3:.1f} ms on the wall without the profiler (mean of {steps})",
        "",
        "| op | calls a step | ms a step (self) | share |",
        "|---|---|---|---|",
    ]
    for e in ops[:TOP_OPS]:
        lines.append(
            f"| `{e.key}` | {e.count / steps:.0f} | {e.self_cpu_time_total / steps / 1e3:.2f} "
            f"| {100 * e.self_cpu_time_total / total:.1f}% |"
        )
    return lines + [""]


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(
        prog="python benchmarks/profile_cpu_step.py", description=__doc__.splitlines()[0]
    )
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--k", type=int, default=4, help="K of the SD round")
    p.add_argument("--steps", type=int, default=10, help="steps (rounds) timed, then profiled")
    p.add_argument("--model", default=None, help="target (default: the built-in pair's)")
    p.add_argument("--draft", default=None, help="draft (default: the built-in pair's)")
    p.add_argument("--out", default=None, help="Markdown file (default: print only)")
    a = p.parse_args(argv)
    from suite.machine import machine_line

    lines = [
        f"# Where a CPU step's time goes ({datetime.date.today()})",
        "",
        f"`python benchmarks/profile_cpu_step.py {' '.join(argv if argv is not None else sys.argv[1:])}`",
        "",
        f"{machine_line('cpu')}; {a.threads} thread(s) on cores 0..{a.threads - 1}; greedy, batch 1, a "
        f"{len(PROMPT)}-token prompt; torch.profiler's self CPU time (a kernel's threads count once, in "
        "the op that started them).",
        "",
    ]
    lines += profile_mode("ar", 0, a.threads, a.steps, a.model, a.draft)
    lines += profile_mode("sd", a.k, a.threads, a.steps, a.model, a.draft)
    report = "\n".join(lines)
    print(report)
    if a.out:
        with open(a.out, "w") as f:
            f.write(report)
    return report


if __name__ == "__main__":
    main()
