"""Where a batched decode step's time goes on a GPU (torch.profiler), for three engines side by side:
AR, SD every step (speculation_per_step=off), and an SD engine whose per-step choice drafts nothing
(plain steps inside an SD engine: what the goodput choice runs when K does not pay). Not a test.

    python benchmarks/gpu/profile_steps.py --device cuda --target configs/shapes/qwen2.5-coder-1.5b-instruct \
        --draft configs/shapes/qwen2.5-coder-0.5b-instruct --batch 8 --out benchmarks/results/DATE-profile-steps-cuda.md

Random weights (load_format="dummy"), synthetic acceptance --alpha, greedy; every request prefilled,
then warm steps, then `--steps` timed steps (wall per step, tokens per step), the same number profiled
by torch.profiler (host calls a step: graph replays, launches, synchronisations, copies; the ops taking
the most host and device time) and again by cProfile (the Python functions the wall time is spent in)."""

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import torch

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/
sys.path[:0] = [os.path.dirname(HERE), HERE]
TOP = 12
PY_TOP = 30
HOST_CALLS = (
    "cudaGraphLaunch",
    "cudaLaunchKernel",
    "cuLaunchKernel",
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpyAsync",
    "cudaStreamWaitEvent",
)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python benchmarks/gpu/profile_steps.py", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--target", required=True, help="target folder (config.json is enough)")
    p.add_argument("--draft", required=True, help="draft folder")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--k", type=int, default=2, help="draft tokens a round (SD)")
    p.add_argument(
        "--alpha", type=float, default=0.8, help="synthetic acceptance per drafted token"
    )
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--out", required=True, help="the report's .md path")
    return p.parse_args(argv)


def engine_steps(a, name: str) -> list[str]:
    """One engine: its timed steps, then its profiled steps, as report lines."""
    from bench_synthetic import random_prompts

    from ssd_engine import LLM, SamplingParams
    from ssd_engine.engine import step_choice
    from ssd_engine.testing import Synthetic

    options = dict(
        speculative_mode="ar" if name == "ar" else "sd", load_format="dummy", device=a.device
    )
    if name != "ar":
        options.update(
            draft_model=a.draft,
            num_speculative_tokens=a.k,
            synthetic=Synthetic(acceptance=a.alpha),
            speculation_per_step="off" if name == "sd" else "goodput",
        )
    choose = step_choice.StepChoice.choose
    if name == "sd-plain":  # every step plain: the choice's K = 0 arm alone
        step_choice.StepChoice.choose = lambda self, running, draft: (
            self.steps_by_k.update([0]) or 0
        )
    params = SamplingParams(
        temperature=0, max_tokens=a.prompt_len + 4 * a.steps * (a.k + 1), ignore_eos=True
    )
    prompts = random_prompts(a.batch, a.prompt_len, a.target, a.draft)
    try:
        with LLM(a.target, **options) as llm:
            engine = llm.engine
            for prompt in prompts:
                engine.add_request(prompt, params)
            while len(engine.scheduler.running) < a.batch or any(
                s.num_output_tokens == 0 for s in engine.scheduler.running
            ):
                engine.step()
            for _ in range(4):
                engine.step()
            sync = torch.cuda.synchronize if a.device.startswith("cuda") else (lambda: None)
            emitted = lambda: sum(len(s.token_ids) for s in engine.scheduler.running)  # noqa: E731
            sync()
            before, began = emitted(), time.perf_counter()
            for _ in range(a.steps):
                engine.step()
            sync()
            wall = (time.perf_counter() - began) / a.steps
            tokens = (emitted() - before) / a.steps
            activities = [torch.profiler.ProfilerActivity.CPU]
            if a.device.startswith("cuda"):
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            with torch.profiler.profile(activities=activities) as prof:
                for _ in range(a.steps):
                    engine.step()
                sync()
            python = cProfile.Profile()  # the Python functions the steps spend their wall time in
            python.enable()
            for _ in range(a.steps):
                engine.step()
            sync()
            python.disable()
    finally:
        step_choice.StepChoice.choose = choose
    events = prof.key_averages()
    calls = {e.key: e.count / a.steps for e in events if e.key in HOST_CALLS}
    lines = [
        f"## {name}: {wall * 1e3:.2f} ms a step, {tokens:.2f} tokens a step ({tokens / wall:.0f} tok/s)",
        "",
        "Host calls a step: "
        + (", ".join(f"{k} {v:.1f}" for k, v in sorted(calls.items())) or "none"),
        "",
        "| op (most host time first) | calls a step | host us a step | device us a step |",
        "|---|---|---|---|",
    ]
    device_us = lambda e: getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0)  # noqa: E731
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:TOP]:
        lines.append(
            f"| {e.key[:80]} | {e.count / a.steps:.1f} | {e.self_cpu_time_total / a.steps:.0f} | "
            f"{device_us(e) / a.steps:.0f} |"
        )
    lines += [
        "",
        "| kernel (most device time first) | calls a step | device us a step |",
        "|---|---|---|",
    ]
    for e in sorted(events, key=lambda e: -(getattr(e, "self_device_time_total", 0) or 0))[:TOP]:
        lines.append(
            f"| {e.key[:80]} | {e.count / a.steps:.1f} | {(getattr(e, 'self_device_time_total', 0) or 0) / a.steps:.0f} |"
        )
    text = io.StringIO()
    pstats.Stats(python, stream=text).sort_stats("cumulative").print_stats(PY_TOP)
    lines += [
        "",
        "Python functions by cumulative wall time over the steps (cProfile):",
        "",
        "```",
        *[line for line in text.getvalue().splitlines() if line.strip()][-PY_TOP - 1 :],
        "```",
    ]
    print("\n".join(lines[:3]), flush=True)
    return lines + [""]


def main(argv: list[str] | None = None) -> None:
    a = parse(argv)
    device = torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu"
    lines = [
        f"# Batched decode steps profiled: {os.path.basename(a.target)} + {os.path.basename(a.draft)} on {device}",
        "",
        f"torch {torch.__version__}; batch {a.batch}, K {a.k}, alpha {a.alpha}, prompts of {a.prompt_len} "
        f"random ids, {a.steps} timed and {a.steps} profiled steps after warm ones.",
        "",
    ]
    for name in ("ar", "sd", "sd-plain"):
        lines += engine_steps(a, name)
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        # after each engine: a run stopped at its limit keeps what it measured
        with open(a.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
