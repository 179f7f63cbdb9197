"""`speculative_mode="auto"` on a GPU: the mode it chooses from the forwards it timed there
(planning/gpu_costs.py), its predictions, and each candidate mode measured, side by side in one run.

    python benchmarks/gpu/bench_auto.py --device cuda --target configs/shapes/qwen2.5-7b \
        --draft configs/shapes/qwen2.5-coder-0.5b-instruct --alpha 0.8
    python benchmarks/gpu/bench_auto.py --device cpu --target configs/shapes/qwen2.5-coder-0.5b-instruct \
        --draft configs/shapes/qwen2.5-coder-0.5b-instruct --new-tokens 8 --prompt-len 16   # a CPU smoke

Random weights at real shapes (load_format="dummy"), acceptance drawn at --alpha
(a synthetic acceptance rate): a step's cost does not depend on the weights' values. Every mode runs the
same random-id prompts at batch 1, greedy, EOS ignored, after one warm-up request as long; tok/s counts every
generated token over the timed call's wall time. auto picked right when its mode is the fastest
measured (or within its 5% margin of AR). Writes DATE-auto-TAG.md and .json under --out.
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
    p = argparse.ArgumentParser(prog="python benchmarks/gpu/bench_auto.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="target folder (config.json is enough)")
    p.add_argument("--draft", required=True, help="draft folder")
    p.add_argument("--device", default="cuda")
    p.add_argument("--alpha", type=float, default=0.8, help="synthetic acceptance per drafted token")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=2)
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--tag", default="")
    return p.parse_args(argv)


def run_mode(a, mode: str, k: int | None, prompts: list[list[int]]) -> dict:
    """One engine in `mode` (auto: its choice): its plan and measured tok/s over the prompts."""
    from ssd_engine import LLM, SamplingParams
    from ssd_engine.testing import Synthetic
    options = dict(speculative_mode=mode, load_format="dummy", device=a.device)
    if mode != "ar":
        options.update(draft_model=a.draft, synthetic=Synthetic(acceptance=a.alpha))
    if k is not None and mode != "ar":
        options["num_speculative_tokens"] = k
    params = SamplingParams(temperature=0, max_tokens=a.new_tokens, ignore_eos=True)
    started = time.perf_counter()
    with LLM(a.target, **options) as llm:
        start_s = time.perf_counter() - started
        plan = llm.engine.plan
        # a whole warm-up request: every kernel the timed ones launch is compiled (the first engine
        # in a process compiles Triton's kernels for each shape it meets; later ones find them)
        llm.generate([prompts[0][::-1]], params, use_tqdm=False)
        tok_s = []
        for prompt in prompts:  # batch 1: one request at a time
            began = time.perf_counter()
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            tok_s.append(len(out.token_ids) / (time.perf_counter() - began))
    row = {"mode": mode, "ran": plan.mode, "k": plan.parts.speculative.k if plan.mode != "ar" else 0,
           "tok_s": sum(tok_s) / len(tok_s), "start_s": start_s}
    if plan.choice is not None:
        row["choice"] = plan.choice.describe()
        row["predicted_tok_s"] = plan.choice.predicted_tok_s
    print(f"{mode}: ran {row['ran']} K={row['k']}: {row['tok_s']:.1f} tok/s (start {start_s:.1f} s)"
          + (f"\n  {row['choice']}" if "choice" in row else ""), flush=True)
    return row


def main(argv: list[str] | None = None) -> dict:
    a = parse(argv)
    import torch
    from bench_synthetic import random_prompts

    from ssd_engine.models.loader import load_config
    vocab = min(load_config(p, "dummy").vocab_size for p in (a.target, a.draft))
    prompts = random_prompts(a.num_prompts, a.prompt_len, vocab)
    device = torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu"
    auto = run_mode(a, "auto", None, prompts)
    k = auto["k"] or 4
    rows = [auto] + [run_mode(a, mode, k, prompts) for mode in ("ar", "sd")]
    measured = {r["mode"]: r["tok_s"] for r in rows[1:]}
    best = max(measured, key=measured.get)
    result = {"device": device, "date": datetime.date.today().isoformat(), "target": a.target, "draft": a.draft,
              "alpha": a.alpha, "prompt_len": a.prompt_len, "new_tokens": a.new_tokens, "rows": rows,
              "auto_ran": auto["ran"], "fastest_measured": best,
              "picked_right": auto["ran"] == best or (auto["ran"] == "ar" and measured[best] < 1.05 * measured["ar"])}
    os.makedirs(a.out, exist_ok=True)
    stem = os.path.join(a.out, f"{result['date']}-auto{'-' + a.tag if a.tag else ''}")
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    lines = [f"# auto on {device}: {os.path.basename(a.target)} + {os.path.basename(a.draft)}, alpha {a.alpha}", "",
             f"Random weights, batch 1, {a.num_prompts} prompts of {a.prompt_len} random ids, {a.new_tokens} new "
             "tokens, greedy.", "", "| run | ran | K | tok/s | predicted tok/s |", "|---|---|---|---|---|"]
    predicted = auto.get("predicted_tok_s", {})
    for r in rows:
        guess = predicted.get(r["ran"])
        lines.append(f"| {r['mode']} | {r['ran']} | {r['k']} | {r['tok_s']:.1f} | "
                     f"{'' if guess is None else f'{guess:.1f}'} |")
    lines += ["", f"auto's choice: {auto.get('choice', auto['ran'])}", "",
              f"Fastest measured: {best}; auto picked right: {result['picked_right']}."]
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


if __name__ == "__main__":
    main()
