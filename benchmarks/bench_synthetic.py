"""Speed without meaningful weights: AR, SD and SSD on random weights at real shapes
(load_format="dummy") with acceptance and SSD cache hits drawn at set rates (synthetic_acceptance
alpha, synthetic_hit p), next to the paper's predictions from the same run's measured costs.

    python benchmarks/bench_synthetic.py                     # the default pair's shapes, alpha 0.5,0.7,0.9
    python benchmarks/bench_synthetic.py --target configs/shapes/qwen2.5-7b --k 2,4 --budget 2,4,8 --batch 1,4
    python benchmarks/bench_synthetic.py --device cuda --target configs/shapes/qwen2.5-7b --alpha 0.8 --k 4

Sweeps alpha, K, the SSD budget B (the fan-out's sum) and the hit rate p, at each batch size: AR
runs once, SD once per alpha (every K), SSD once per (alpha, B, p) (every K), each in its own
pinned process through the bench suite (benchmarks/suite/): AR and SD on --cores, SSD's draft
process on --draft-cores. Prompts are random token ids (a shape folder has no tokenizer). Writes
benchmarks/results/DATE-synthetic[-TAG].md (tables), .json (every number) and .png (speedups
against alpha, and measured against predicted); how predictions are computed:
benchmarks/suite/synthetic_report.py.
"""

import argparse
import datetime
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SHAPES = os.path.join(REPO, "configs", "shapes")


def _csv(text: str, cast=str) -> list:
    return [cast(x.strip()) for x in text.split(",") if x.strip()]


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python benchmarks/bench_synthetic.py", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--target",
        default=os.path.join(SHAPES, "qwen2.5-coder-1.5b-instruct"),
        help="target folder (config.json is enough; default: the default target's shapes)",
    )
    p.add_argument(
        "--draft",
        default=os.path.join(SHAPES, "qwen2.5-coder-0.5b-instruct"),
        help="draft folder (default: the default draft's shapes)",
    )
    p.add_argument(
        "--alpha", default="0.5,0.7,0.9", help="synthetic acceptance rates, comma-separated"
    )
    p.add_argument("--k", default="2,4", help="draft lengths K")
    p.add_argument("--budget", default="4", help="SSD budgets B (the fan-out's sum)")
    p.add_argument("--hit", default="0.9", help="SSD synthetic hit rates p")
    p.add_argument("--batch", default="1", help="batch sizes")
    p.add_argument(
        "--device",
        default="cpu",
        help="cpu | cuda: on one GPU the SSD draft process shares it with the target",
    )
    p.add_argument(
        "--draft-host",
        default=None,
        choices=("process", "thread"),
        help="SSD's draft: its own process (default), or a thread of the engine on its own CUDA stream",
    )
    p.add_argument(
        "--fallback", default="jit", choices=("jit", "fast", "auto"), help="what an SSD miss takes"
    )
    p.add_argument(
        "--draft-dtype", default="auto", choices=("auto", "fp32", "bf16", "int8", "int4")
    )
    p.add_argument("--prompt-len", type=int, default=64, help="tokens per random-id prompt")
    p.add_argument("--num-prompts", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--cores", default="0", help="cores of the target (and AR, SD)")
    p.add_argument("--draft-cores", default="1", help="cores of the SSD draft process")
    p.add_argument(
        "--prefix", type=int, default=128, help="prefix length of the forward-cost probes"
    )
    p.add_argument(
        "--reps", type=int, default=2, help="repetitions of each forward-cost probe (best counts)"
    )
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--tag", default="")
    a = p.parse_args(argv)
    a.alpha, a.k, a.batch = _csv(a.alpha, float), _csv(a.k, int), _csv(a.batch, int)
    a.budget, a.hit = _csv(a.budget, int), _csv(a.hit, float)
    if not all(0 <= v <= 1 for v in a.alpha + a.hit):
        p.error("--alpha and --hit take rates in [0, 1]")
    if a.reps < 1:
        p.error("--reps must be >= 1: the predictions need the measured forward costs")
    return a


def random_prompts(
    count: int, length: int, target: str, draft: str, seed: int = 0
) -> list[list[int]]:
    """Token ids every model of the pair has (no tokenizer needed), the same on every run."""
    import torch

    from ssd_engine.models.loader import load_config

    vocab = min(load_config(path, "dummy").vocab_size for path in (target, draft))
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (count, length), generator=generator).tolist()


def shown(path: str) -> str:
    """A folder as the report names it: relative to the repository when inside it."""
    full = os.path.abspath(path)
    return os.path.relpath(full, REPO) if full.startswith(REPO + os.sep) else os.path.basename(full)


def bench_argv(
    a, mode: str, alpha: float | None = None, budget: int | None = None, hit: float | None = None
):
    """bench.py's flags for one mode of the sweep (parsed, and validated, by suite/options.py)."""
    argv = [
        "--model",
        a.target,
        "--draft",
        a.draft,
        "--mode",
        mode,
        "--load-format",
        "dummy",
        "--k",
        ",".join(map(str, a.k)),
        "--batch",
        ",".join(map(str, a.batch)),
        "--draft-dtype",
        a.draft_dtype,
        "--new-tokens",
        str(a.new_tokens),
        "--cores",
        a.cores,
        "--draft-cores",
        a.draft_cores,
        "--prefix",
        str(a.prefix),
        "--reps",
        str(a.reps),
        "--fallback",
        a.fallback,
        "--device",
        a.device,
    ]
    if alpha is not None:
        argv += ["--synthetic-acceptance", str(alpha)]
    if budget is not None:
        argv += ["--budget", str(budget), "--synthetic-hit", str(hit)]
    if a.draft_host is not None:
        argv += ["--draft-host", a.draft_host]
    return argv


def sweep_runs(a) -> list[dict]:
    """The sweep's runs in order, each with bench.py's flags: AR once, then per alpha SD and SSD at every
    budget and hit rate (a GPU session can check them all without running one)."""
    runs = [{"mode": "ar", "argv": bench_argv(a, "ar")}]
    for alpha in a.alpha:
        runs.append({"mode": "sd", "alpha": alpha, "argv": bench_argv(a, "sd", alpha)})
        runs += [
            {
                "mode": "ssd",
                "alpha": alpha,
                "budget": budget,
                "hit": hit,
                "argv": bench_argv(a, "ssd", alpha, budget, hit),
            }
            for budget in a.budget
            for hit in a.hit
        ]
    return runs


def _say(mode: str, cell: dict, rows: list[dict]) -> None:
    """Each cell's figures as it ends: a sweep stopped at a time limit (a lent GPU's) keeps what it got."""
    for row in rows:
        print(
            f"{mode} {cell} batch {row['batch']} k {row['k']}: decode {row['decode_tok_s']:.1f} tok/s"
            + (f", acceptance {row['acceptance_rate']:.2f}" if "acceptance_rate" in row else ""),
            file=sys.stderr,
            flush=True,
        )


def run_sweep(a) -> dict:
    from suite import host_speed, isolate, options
    from suite.machine import machine_line

    from ssd_engine.utils.machine import describe

    prompt_sets = {"random-ids": random_prompts(a.num_prompts, a.prompt_len, a.target, a.draft)}
    ar_run, *runs = sweep_runs(a)
    ar_opts = options.parse(ar_run["argv"])
    speed_before = host_speed.measure()
    sweep = {
        "date": datetime.date.today().isoformat(),
        "machine": machine_line(a.device),
        "cpu": describe(),
        "placement": ar_opts.placement_text(),
        "target": shown(a.target),
        "draft": shown(a.draft),
        "command": "python benchmarks/bench_synthetic.py " + " ".join(a.argv),
        "prompt_len": a.prompt_len,
        "num_prompts": a.num_prompts,
        "new_tokens": a.new_tokens,
        "fallback": a.fallback,
        "prefix": a.prefix,
        "reps": a.reps,
        "alpha": a.alpha,
        "k": a.k,
        "budget": a.budget,
        "hit": a.hit,
        "batch": a.batch,
        "ar": isolate.run_modes(["ar"], ar_opts, prompt_sets)["ar"],
        "runs": [],
    }
    _say("ar", {}, sweep["ar"]["rows"])
    for run in runs:
        mode, argv = run.pop("mode"), run.pop("argv")
        result = isolate.run_modes([mode], options.parse(argv), prompt_sets)[mode]
        extra = (
            {"draft_forward_s": result["costs"].get("draft_forward_s")}
            if mode == "sd"
            else {"peaks": result["peaks"]}
        )
        sweep["runs"].append({"mode": mode, **run, "rows": result["rows"], **extra})
        _say(mode, run, result["rows"])
    speed_after = host_speed.measure()
    sweep["machine"] += "; " + host_speed.describe(speed_before, speed_after)
    sweep["host_speed"] = host_speed.as_dict(speed_before, speed_after)
    return sweep


def write(sweep: dict, out: str, tag: str) -> list[str]:
    from suite.synthetic_report import cells, markdown, plot

    lines = cells(sweep)
    sweep["cells"] = lines
    os.makedirs(out, exist_ok=True)
    base = os.path.join(out, f"{sweep['date']}-synthetic" + (f"-{tag}" if tag else ""))
    text = markdown(sweep, lines)
    print(text)
    with open(base + ".md", "w") as f:
        f.write(text)
    with open(base + ".json", "w") as f:
        json.dump(sweep, f)
    written = [base + ".md", base + ".json"]
    try:
        written.append(plot(sweep, lines, base + ".png"))
    except ImportError as error:
        print(f"no plot ({error}): pip install matplotlib", file=sys.stderr)
    print("wrote " + ", ".join(written), file=sys.stderr)
    return written


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    a = parse(argv)
    a.argv = argv
    sweep = run_sweep(a)
    write(sweep, a.out, a.tag)
    return sweep


if __name__ == "__main__":
    main()
