"""Saguaro benchmark (not a test): its three choices on the default pair, measured in one run.

    python benchmarks/bench_saguaro.py                      # all three parts, target core 0, draft core 1

1. fan-out at equal budget B, greedy: uniform vs geometric (Theorem 12 with i.i.d. acceptance alpha)
   vs auto (Theorem 12 on the measured outcome distribution P(k)): hit rate and tok/s;
2. Saguaro sampling: C in {1.0, 0.8, 0.5, 0.3} at T = 0.7: hit rate, acceptance, tok/s (Figure 5's shape);
3. fallback: batch sizes b in {1, 2, 4, 8, 16} with the just-in-time backup, the fast backup and
   the automatic b* rule (Figure 6's shape), one engine switched between rules in place.
Writes results/DATE-saguaro.{md,json,png}.
"""

import argparse
import datetime
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench import load_prompts  # noqa: E402
from suite.machine import machine_line  # noqa: E402

PARTS = ("fanout", "c", "batch")


def _llm(args, **options):
    from ssd_engine import LLM

    return LLM(
        args.model,
        draft_model=args.draft,
        speculative_mode="ssd",
        num_speculative_tokens=args.k,
        cpu_cores=f"{args.target_core};{args.draft_core}",
        enable_prefix_caching=False,
        **options,
    )


def _counters(llm) -> dict:
    m = llm.engine.speculator.metrics
    return dict(
        warm=sum(m.lookups_by_accepted[1:]),
        hits=sum(m.hits_by_accepted[1:]),
        rejected=sum(m.lookups_by_accepted[1:-1]),
        rejected_hits=sum(m.hits_by_accepted[1:-1]),
        drafted=sum(m.drafted.values()),
        accepted=sum(m.accepted.values()),
        backups=dict(m.backups),
        build=m.build_s,
        verify=m.verify_s,
        rounds=m.timed_rounds,
        vrounds=m.verify_rounds,
    )


def _timed(llm, prompts: list[str], params, batch: int) -> dict:
    """Generate `prompts` `batch` at a time; -> tok/s and the SSD counters of just this run."""
    before = _counters(llm)
    tokens, started = 0, time.perf_counter()
    for i in range(0, len(prompts), batch):
        tokens += sum(
            len(o.token_ids) for o in llm.generate(prompts[i : i + batch], params, use_tqdm=False)
        )
    seconds = time.perf_counter() - started
    after = _counters(llm)
    d = {
        key: after[key] - before[key]
        for key in (
            "warm",
            "hits",
            "rejected",
            "rejected_hits",
            "drafted",
            "accepted",
            "build",
            "verify",
            "rounds",
            "vrounds",
        )
    }
    backups = {
        key: after["backups"].get(key, 0) - before["backups"].get(key, 0)
        for key in after["backups"]
    }
    return dict(
        tok_s=tokens / seconds,
        tokens=tokens,
        seconds=seconds,
        hit_rate=d["hits"] / max(d["warm"], 1),
        acceptance=d["accepted"] / max(d["drafted"], 1),
        rejected=d["rejected"],
        rejected_hits=d["rejected_hits"],
        t_p=(d["build"] / max(d["rounds"], 1)) / max(d["verify"] / max(d["vrounds"], 1), 1e-9),
        backups={k: v for k, v in backups.items() if v},
    )


def part_fanout(args, prompts) -> list[dict]:
    from ssd_engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    rows = []
    for budget in args.budgets:
        for rule in ("uniform", "geometric", "auto"):
            with _llm(
                args, ssd_fanout=rule, ssd_budget=budget, ssd_fallback="jit", max_num_seqs=1
            ) as llm:
                fanout = llm.speculation_metrics()["fanouts"]["T=0"]
                _timed(llm, prompts[:1], SamplingParams(temperature=0, max_tokens=8), 1)  # warm-up
                result = _timed(llm, prompts, params, 1)
            rows.append(dict(budget=budget, rule=rule, fanout=fanout, **result))
            print(f"fanout B={budget} {rule} {fanout}: {result}", file=sys.stderr, flush=True)
    return rows


def part_c(args, prompts) -> list[dict]:
    from ssd_engine import SamplingParams

    rows = []
    for c in args.c_values:
        params = [
            SamplingParams(temperature=0.7, max_tokens=args.new_tokens, ignore_eos=True, seed=i)
            for i in range(len(prompts))
        ]
        with _llm(args, saguaro_c=c, ssd_fallback="jit", max_num_seqs=1) as llm:
            fanout = llm.speculation_metrics()["fanouts"]
            _timed(llm, prompts[:1], SamplingParams(temperature=0.7, max_tokens=8, seed=99), 1)
            result = _timed_each(llm, prompts, params)
        rows.append(dict(c=c, fanout=fanout, **result))
        print(f"C={c}: {result}", file=sys.stderr, flush=True)
    return rows


def _timed_each(llm, prompts, params_list) -> dict:
    """Batch 1 with one seeded SamplingParams per prompt; counters summed over the prompts."""
    parts = [_timed(llm, [p], params, 1) for p, params in zip(prompts, params_list)]
    tokens, seconds = sum(p["tokens"] for p in parts), sum(p["seconds"] for p in parts)
    weight = lambda key: sum(p[key] * p["tokens"] for p in parts) / tokens
    rejected = sum(p["rejected"] for p in parts)
    return dict(
        tok_s=tokens / seconds,
        tokens=tokens,
        seconds=seconds,
        hit_rate=weight("hit_rate"),
        acceptance=weight("acceptance"),
        t_p=weight("t_p"),
        rejected=rejected,
        hit_rate_after_rejection=sum(p["rejected_hits"] for p in parts) / max(rejected, 1),
    )


def part_batch(args, prompts) -> list[dict]:
    from ssd_engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.batch_tokens, ignore_eos=True)
    rows = []
    with _llm(args, max_num_seqs=max(args.batches)) as llm:
        policy = llm.engine.speculator.policy
        _timed(llm, prompts[:2], SamplingParams(temperature=0, max_tokens=8), 2)  # warm-up
        for batch in args.batches:
            batch_prompts = (prompts * batch)[:batch]
            for rule in ("jit", "fast", "auto"):
                policy.mode = rule  # the same engine, so only the rule differs
                result = _timed(llm, batch_prompts, params, batch)
                rows.append(
                    dict(batch=batch, rule=rule, critical_batch=policy.critical_batch, **result)
                )
                print(f"b={batch} {rule}: {rows[-1]}", file=sys.stderr, flush=True)
        estimates = vars(policy.estimates)
    return rows, estimates


def report(args, raw: dict) -> str:
    def setting(part: str, key: str):
        return raw.get("settings", {}).get(part, {}).get(key, getattr(args, key))

    lines = [
        f"# Saguaro benchmark, {raw['date']}",
        "",
        f"Machine: {raw['machine']}",
        f"Placement: target (coordinator) on core {args.target_core}, draft process on core {args.draft_core}, "
        f"1 thread each; K = {args.k}; fp32; default pair (Qwen2.5-Coder 1.5B / 0.5B, Q4_K_M dequantised)",
        f"Command: `{raw.get('command', 'python benchmarks/bench_saguaro.py')}`",
    ]
    for again in raw.get("remeasured", []):
        lines.append(
            f"Part `{again['parts']}` re-measured on {again['date']} with the same placement: "
            f"`{again.get('command', '')}` (the numbers it replaced are kept in the JSON under `superseded`)"
        )
    lines.append("")
    if "fanout" in raw:
        lines += [
            f"## 1. Fan-out at equal budget B (greedy, {setting('fanout', 'num_prompts')} code prompts x "
            f"{setting('fanout', 'new_tokens')} "
            "tokens, batch 1, just-in-time backup)",
            "",
            "| B | rule | F_0..F_K | hit rate (after round 1) | tok/s | T_p |",
            "|---|---|---|---|---|---|",
        ]
        for r in raw["fanout"]:
            lines.append(
                f"| {r['budget']} | {r['rule']} | {r['fanout']} | {r['hit_rate']:.3f} | {r['tok_s']:.2f} | "
                f"{r['t_p']:.2f} |"
            )
    if "c" in raw:
        lines += [
            "",
            f"## 2. Saguaro sampling constant C (T = 0.7, {setting('c', 'num_prompts')} code prompts x "
            f"{setting('c', 'new_tokens')} tokens, batch 1, calibrated geometric fan-out)",
            "",
            "| C | hit rate (after round 1) | hit rate after a rejection (k < K; lookups) | acceptance | tok/s | T_p |",
            "|---|---|---|---|---|---|",
        ]
        for r in raw["c"]:
            after = (
                f"{r['hit_rate_after_rejection']:.3f} ({r['rejected']})" if "rejected" in r else "-"
            )
            lines.append(
                f"| {r['c']} | {r['hit_rate']:.3f} | {after} | {r['acceptance']:.3f} | {r['tok_s']:.2f} | "
                f"{r['t_p']:.2f} |"
            )
    if "batch" in raw:
        lines += [
            "",
            f"## 3. Fallback vs batch size (greedy, {setting('batch', 'batch_tokens')} tokens per sequence, "
            "calibrated geometric fan-out)",
            "",
            f"Running estimates at the end: {json.dumps({k: round(v, 3) for k, v in raw['estimates'].items()})}",
            "",
            "| b | jit tok/s | fast tok/s | auto tok/s | auto's choice (rounds) | b* | auto / best fixed |",
            "|---|---|---|---|---|---|---|",
        ]
        for b in args.batches:
            by = {r["rule"]: r for r in raw["batch"] if r["batch"] == b}
            best = max(by["jit"]["tok_s"], by["fast"]["tok_s"])
            lines.append(
                f"| {b} | {by['jit']['tok_s']:.2f} | {by['fast']['tok_s']:.2f} | {by['auto']['tok_s']:.2f} | "
                f"{by['auto']['backups']} | {by['auto']['critical_batch']:.2f} | "
                f"{by['auto']['tok_s'] / best:.3f} |"
            )
    return "\n".join(lines) + "\n"


def plot(args, raw: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [p for p in PARTS if p in raw]
    fig, axes = plt.subplots(1, len(parts), figsize=(5.2 * len(parts), 4.2), squeeze=False)
    for ax, part in zip(axes[0], parts):
        if part == "fanout":
            labels = [f"B={r['budget']}\n{r['rule']}" for r in raw["fanout"]]
            ax.bar(
                range(len(labels)),
                [r["hit_rate"] for r in raw["fanout"]],
                color=[
                    {"uniform": "tab:gray", "geometric": "tab:green", "auto": "tab:blue"}[r["rule"]]
                    for r in raw["fanout"]
                ],
            )
            ax.set_xticks(range(len(labels)), labels)
            ax.set_ylabel("cache hit rate (after round 1)")
            ax.set_title("fan-out at equal budget B")
        elif part == "c":
            cs = [r["c"] for r in raw["c"]]
            ax.plot(cs, [r["hit_rate"] for r in raw["c"]], "o-", label="cache hit rate")
            if all("hit_rate_after_rejection" in r for r in raw["c"]):
                ax.plot(
                    cs,
                    [r["hit_rate_after_rejection"] for r in raw["c"]],
                    "^-",
                    label="hit rate after a rejection",
                )
            ax.plot(cs, [r["acceptance"] for r in raw["c"]], "s--", label="acceptance")
            ax.set_xlabel("Saguaro C (T = 0.7)")
            ax.invert_xaxis()
            ax.legend()
            ax.set_title("Saguaro sampling")
        else:
            for rule, style in (("jit", "o-"), ("fast", "s-"), ("auto", "^--")):
                pts = [(r["batch"], r["tok_s"]) for r in raw["batch"] if r["rule"] == rule]
                ax.plot(*zip(*pts), style, label=rule)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("batch size b")
            ax.set_ylabel("tok/s")
            ax.legend()
            ax.set_title("fallback: jit vs fast vs b* rule")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--model", default=None)
    parser.add_argument("--draft", default=None)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--target-core", type=int, default=0)
    parser.add_argument("--draft-core", type=int, default=1)
    parser.add_argument("--num-prompts", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument(
        "--budgets", default="auto,10", help="B values for part 1; auto = the calibration's"
    )
    parser.add_argument("--c-values", default="1.0,0.8,0.5,0.3")
    parser.add_argument("--batches", default="1,2,4,8,16")
    parser.add_argument("--batch-tokens", type=int, default=24)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument(
        "--update",
        default=None,
        help="an earlier DATE-saguaro.json: re-measure --parts into it "
        "(what they replace is kept under 'superseded')",
    )
    args = parser.parse_args()
    args.c_values = [float(c) for c in args.c_values.split(",")]
    args.batches = [int(b) for b in args.batches.split(",")]
    args.cores = {args.target_core, args.draft_core}
    args.threads = 1
    prompts = load_prompts("code", args.num_prompts)
    args.budgets = [
        _calibrated_budget(args) if b == "auto" else int(b) for b in args.budgets.split(",")
    ]
    command = "python benchmarks/bench_saguaro.py " + " ".join(sys.argv[1:])
    raw = dict(
        date=datetime.date.today().isoformat(),
        machine=f"{machine_line()}; target core {args.target_core}, draft core {args.draft_core}",
        args=vars(args).copy(),
        command=command.strip(),
    )
    raw["args"]["cores"] = sorted(args.cores)
    # a result names where it was written relative to the checkout, not this machine's layout
    raw["args"]["out"] = os.path.relpath(os.path.abspath(args.out), os.path.dirname(HERE))
    if args.update:
        with open(args.update) as f:
            earlier = json.load(f)
        replaced = {p: earlier.pop(p) for p in args.parts.split(",") if p in earlier}
        if replaced:
            earlier.setdefault("superseded", []).append(dict(replaced, args=earlier["args"]))
            earlier.setdefault("remeasured", []).append(
                dict(date=raw["date"], parts=args.parts, args=raw["args"], command=raw["command"])
            )
        raw = earlier
    # --parts "" --update F: just redraw F's report and plot
    for part in filter(None, args.parts.split(",")):
        raw.setdefault("settings", {})[part] = dict(
            num_prompts=args.num_prompts, new_tokens=args.new_tokens, batch_tokens=args.batch_tokens
        )
        if part == "fanout":
            raw["fanout"] = part_fanout(args, prompts)
        elif part == "c":
            raw["c"] = part_c(args, prompts)
        elif part == "batch":
            raw["batch"], raw["estimates"] = part_batch(
                args, load_prompts("code", max(args.batches))
            )
        else:
            parser.error(f"unknown part {part!r}; choose from {PARTS}")
    stem = (
        args.update[: -len(".json")]
        if args.update
        else os.path.join(args.out, f"{raw['date']}-saguaro")
    )
    with open(stem + ".json", "w") as f:
        json.dump(raw, f, indent=1)
    plot(args, raw, stem + ".png")
    text = report(args, raw)
    with open(stem + ".md", "w") as f:
        f.write(
            text
            + f"\nPlot: `{os.path.basename(stem)}.png`; raw numbers: `{os.path.basename(stem)}.json`.\n"
        )
    print(text)


def _calibrated_budget(args) -> int:
    from ssd_engine.core.config import EngineConfig
    from ssd_engine.models.model_paths import resolve_model_path
    from ssd_engine.saguaro.calibration import find_calibrations

    config = EngineConfig(model=args.model, draft_model=args.draft)
    found = find_calibrations(resolve_model_path(config), resolve_model_path(config, "draft"))
    if not found:
        sys.exit(
            "no calibration for this pair: run `python -m ssd_engine.calibrate --temperature 0` first"
        )
    return found[0].budget


if __name__ == "__main__":
    main()
