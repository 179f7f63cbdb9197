"""`speculative_mode="auto"` on a GPU: the mode it chooses from the forwards it timed there
(planning/gpu_costs.py), its predictions, and each candidate mode measured, side by side in one run.

    python benchmarks/gpu/bench_auto.py --device cuda --target configs/shapes/qwen2.5-7b \
        --draft configs/shapes/qwen2.5-coder-0.5b-instruct --alpha 0.8
    python benchmarks/gpu/bench_auto.py --device cpu --target configs/shapes/qwen2.5-coder-0.5b-instruct \
        --draft configs/shapes/qwen2.5-coder-0.5b-instruct --new-tokens 8 --prompt-len 16   # a CPU smoke

Random weights at real shapes (load_format="dummy"), acceptance drawn at --alpha
(a synthetic acceptance rate): a step's cost does not depend on the weights' values. Every mode runs the
same random-id prompts, greedy, EOS ignored. At each `--batch` size the engine first serves one warm-up
batch as large (every kernel and graph the timed batch needs is built, and the per-step choice has seen the
batch size, as a server has after its first requests), then `--repeats` timed batches; tok/s counts every
generated token over the timed call's wall time. auto (its plan, and by default its per-step choice of K or
plain decoding) picked right at a batch size when it is within 5% of the fastest mode measured there.
Writes DATE-auto-TAG.md and .json under --out.
"""

import argparse
import datetime
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/
REPO = os.path.dirname(HERE)
sys.path[:0] = [REPO, HERE]


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python benchmarks/gpu/bench_auto.py", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--target", required=True, help="target folder (config.json is enough)")
    p.add_argument("--draft", required=True, help="draft folder")
    p.add_argument("--device", default="cuda")
    p.add_argument(
        "--alpha", type=float, default=0.8, help="synthetic acceptance per drafted token"
    )
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument(
        "--batch",
        default="1",
        help="batch sizes, comma-separated (one engine per mode serves each)",
    )
    p.add_argument("--repeats", type=int, default=2, help="timed batches at each batch size")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--tag", default="")
    return p.parse_args(argv)


def run_mode(a, mode: str, k: int | None, prompts: list[list[int]], batches: list[int]) -> dict:
    """One engine in `mode` (auto: its choice): its plan, and per batch size the measured tok/s and the
    steps by the K they drafted (0: plain decoding)."""
    from ssd_engine import LLM, SamplingParams
    from ssd_engine.testing import Synthetic

    options = dict(speculative_mode=mode, load_format="dummy", device=a.device)
    if mode != "ar":
        options.update(draft_model=a.draft, synthetic=Synthetic(acceptance=a.alpha))
    if k is not None and mode != "ar":
        options["num_speculative_tokens"] = k
    if mode == "sd":
        options["speculation_per_step"] = (
            "off"  # SD every step: the baseline the per-step choice is held to
        )
    params = SamplingParams(temperature=0, max_tokens=a.new_tokens, ignore_eos=True)
    started = time.perf_counter()
    row: dict = {"mode": mode, "by_batch": {}}
    with LLM(a.target, **options) as llm:
        row["start_s"] = time.perf_counter() - started
        plan = llm.engine.plan
        row.update(ran=plan.mode, k=plan.config.speculative.k if plan.mode != "ar" else 0)
        if plan.choice is not None:
            row["choice"] = plan.choice.describe()
            row["predicted_tok_s"] = plan.choice.predicted_tok_s
        for batch in batches:
            llm.generate(
                [p[::-1] for p in prompts[:batch]], params, use_tqdm=False
            )  # warm-up (docstring)
            llm.engine.reset_speculation_metrics()
            tok_s = []
            for repeat in range(a.repeats):
                chunk = prompts[repeat * batch : (repeat + 1) * batch]
                began = time.perf_counter()
                outs = llm.generate(chunk, params, use_tqdm=False)
                tok_s.append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - began))
            steps = llm.engine.speculation_metrics().get("steps_by_k", {})
            row["by_batch"][batch] = {"tok_s": sum(tok_s) / len(tok_s), "steps_by_k": steps}
            print(
                f"{mode} (ran {row['ran']} K={row['k']}) batch {batch}: {row['by_batch'][batch]['tok_s']:.1f} tok/s"
                f"{f', steps by K {steps}' if steps else ''}",
                flush=True,
            )
    if "choice" in row:
        print(f"  {row['choice']}", flush=True)
    return row


def main(argv: list[str] | None = None) -> dict:
    a = parse(argv)
    import torch
    from bench_synthetic import random_prompts

    batches = [int(b) for b in a.batch.split(",")]
    prompts = random_prompts(a.repeats * max(batches), a.prompt_len, a.target, a.draft)
    device = torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu"
    auto = run_mode(a, "auto", None, prompts, batches)
    k = auto["k"] or 4
    rows = [auto] + [run_mode(a, mode, k, prompts, batches) for mode in ("ar", "sd")]
    verdicts = {}
    for batch in batches:
        measured = {r["mode"]: r["by_batch"][batch]["tok_s"] for r in rows}
        best = max(measured, key=measured.get)
        verdicts[batch] = {
            "fastest_measured": best,
            "picked_right": measured["auto"] >= 0.95 * measured[best],
        }
    result = {
        "device": device,
        "date": datetime.date.today().isoformat(),
        "target": a.target,
        "draft": a.draft,
        "alpha": a.alpha,
        "prompt_len": a.prompt_len,
        "new_tokens": a.new_tokens,
        "rows": rows,
        "auto_ran": auto["ran"],
        "by_batch": verdicts,
    }
    os.makedirs(a.out, exist_ok=True)
    stem = os.path.join(a.out, f"{result['date']}-auto{'-' + a.tag if a.tag else ''}")
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    lines = [
        f"# auto on {device}: {os.path.basename(a.target)} + {os.path.basename(a.draft)}, alpha {a.alpha}",
        "",
        f"Random weights, {a.repeats} timed batches of {a.prompt_len}-random-id prompts at each batch size, "
        f"{a.new_tokens} new tokens, greedy. sd = SD every step (speculation_per_step=off); auto = the "
        "default (its plan, and the per-step choice of K or plain decoding).",
        "",
        f"auto's plan: {auto.get('choice', auto['ran'])}",
        "",
        "| batch | auto tok/s | auto's steps by K | ar tok/s | sd tok/s | fastest | auto within 5% |",
        "|---|---|---|---|---|---|---|",
    ]
    for batch in batches:
        cells = [r["by_batch"][batch] for r in rows]
        lines.append(
            f"| {batch} | {cells[0]['tok_s']:.1f} | {cells[0]['steps_by_k'] or '-'} | {cells[1]['tok_s']:.1f} | "
            f"{cells[2]['tok_s']:.1f} | {verdicts[batch]['fastest_measured']} | "
            f"{'yes' if verdicts[batch]['picked_right'] else 'no'} |"
        )
    predicted = auto.get("predicted_tok_s", {})
    if predicted:
        lines += [
            "",
            "Plan's predicted batch-1 tok/s: "
            + ", ".join(f"{m} {v:.1f}" for m, v in predicted.items()),
        ]
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


if __name__ == "__main__":
    main()
