"""Benchmark (not a test): tensor-parallel AR decode against one process, side by side in one run.

    python benchmarks/micro/bench_tp.py                      # default target, cores 0,1
    python benchmarks/micro/bench_tp.py --model DIR --batch 1,4 --new-tokens 32

Configurations, each in its own fresh process (so memory and thread pools never mix):
  tp1-Nt  TP=1, one process with N threads on all the given cores (what `generate` does today)
  tp2     TP=2, rank 0 and rank 1 each pinned to one half of the cores (shared-memory collectives)
  tp2-gloo the same with every collective on gloo over loopback
  tp1-half TP=1 on half the cores: what one rank of tp2 has to itself
Greedy, EOS ignored, the same code prompts for every configuration; tok/s = generated tokens /
wall time of `generate` (prefill included, prompts are short). Writes results/DATE-tp.md.
"""

import argparse
import datetime
import json
import os
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/
sys.path.insert(0, HERE)
from bench import load_prompts  # noqa: E402
from suite.dated_report import write_dated_report  # noqa: E402
from suite.machine import machine_line  # noqa: E402
from suite.measure import vm_hwm_gb  # noqa: E402


def child(spec: dict) -> dict:
    os.sched_setaffinity(0, spec["cores"])
    from ssd_engine import LLM, SamplingParams

    options = {"tensor_parallel_size": spec["tp"], "max_num_seqs": max(spec["batch"])}
    if spec["tp"] > 1:
        options["cpu_cores"] = ";".join(str(c) for c in spec["rank_cores"])
    else:
        options["num_threads"] = len(spec["cores"])
    start = time.perf_counter()
    llm = LLM(spec["model"], **options)
    load_s = time.perf_counter() - start
    prompts = spec["prompts"]
    params = SamplingParams(temperature=0, max_tokens=spec["new_tokens"], ignore_eos=True)
    result = {"load_s": load_s, "decode": {}, "outputs": None}
    for batch in spec["batch"]:
        llm.generate(
            prompts[:1], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False
        )  # warm-up
        start, tokens, outputs = time.perf_counter(), 0, []
        for i in range(0, len(prompts), batch):
            outs = llm.generate(prompts[i : i + batch], params, use_tqdm=False)
            tokens += sum(len(o.token_ids) for o in outs)
            outputs += [list(o.token_ids) for o in outs]
        result["decode"][batch] = tokens / (time.perf_counter() - start)
        result["outputs"] = result["outputs"] or outputs
    workers = getattr(
        llm.engine.runner, "processes", {}
    )  # read while they live: their parent may be a fork server
    result["peak_rss_gb"] = {
        f"rank {rank}": vm_hwm_gb(process.pid) for rank, process in workers.items()
    }
    llm.close()
    result["peak_rss_gb"]["rank 0"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return result


def run_child(spec: dict) -> dict:
    env = {**os.environ, **spec.get("env", {})}
    proc = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    if proc.returncode != 0:
        raise SystemExit(
            f"{spec['name']} failed (exit code {proc.returncode}); see its traceback above"
        )
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["decode"] = {int(b): v for b, v in result["decode"].items()}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=None, help="target HF folder (default: the built-in target)"
    )
    parser.add_argument(
        "--cores", default="0,1", help="comma-separated cores; tp2 splits them in two halves"
    )
    parser.add_argument("--batch", default="1,4")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    if args.model is None:
        from ssd_engine.models.default_models import resolve_default_model

        args.model = resolve_default_model("target")
    cores = [int(c) for c in args.cores.split(",")]
    half = len(cores) // 2
    if half < 1:
        raise SystemExit("--cores needs at least 2 cores (one per rank)")
    base = dict(
        model=args.model,
        prompts=load_prompts("code", args.num_prompts),
        new_tokens=args.new_tokens,
        batch=[int(b) for b in args.batch.split(",")],
    )
    tp2 = dict(
        base,
        tp=2,
        cores=cores,
        rank_cores=[",".join(map(str, cores[:half])), ",".join(map(str, cores[half:]))],
    )
    configs = [
        dict(
            base,
            name=f"tp1-{len(cores)}t",
            tp=1,
            cores=cores,
            placement=f"1 process, cores {cores}, {len(cores)} threads",
        ),
        dict(
            tp2,
            name="tp2",
            placement=f"rank 0 cores {cores[:half]}, rank 1 cores {cores[half:]}, {half} thread(s) each",
        ),
        dict(
            tp2,
            name="tp2-gloo",
            env={"SSD_ENGINE_TP_SHM": "0"},
            placement="as tp2, every collective on gloo (SSD_ENGINE_TP_SHM=0)",
        ),
        dict(
            base,
            name="tp1-half",
            tp=1,
            cores=cores[:half],
            placement=f"1 process, cores {cores[:half]}, {half} thread(s)",
        ),
    ]
    results = {}
    for spec in configs:
        print(f"running {spec['name']} ...", file=sys.stderr, flush=True)
        results[spec["name"]] = run_child(spec)
    reference = results[configs[0]["name"]]
    lines = [
        f"# Tensor-parallel AR benchmark, {datetime.date.today().isoformat()}",
        "",
        f"Machine: {machine_line()}; cores {cores}",
        f"Model: {args.model}",
        f"Command: `python benchmarks/micro/bench_tp.py {' '.join(sys.argv[1:])}`",
        f"Greedy, {args.new_tokens} new tokens, {args.num_prompts} code prompts, fp32.",
        "",
        "| config | placement | "
        + " | ".join(f"batch {b} tok/s" for b in base["batch"])
        + " | vs "
        + configs[0]["name"]
        + " (batch 1) | same tokens | load s | peak RSS GB |",
        "|---" * (len(base["batch"]) + 6) + "|",
    ]
    for spec in configs:
        r = results[spec["name"]]
        same = "yes" if r["outputs"] == reference["outputs"] else "NO"
        rss = ", ".join(f"{k} {v:.1f}" for k, v in r["peak_rss_gb"].items() if v > 0.01)
        lines.append(
            f"| {spec['name']} | {spec['placement']} | "
            + " | ".join(f"{r['decode'][b]:.2f}" for b in base["batch"])
            + f" | {r['decode'][base['batch'][0]] / reference['decode'][base['batch'][0]]:.2f}x | {same}"
            + f" | {r['load_s']:.1f} | {rss} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    print(f"wrote {write_dated_report(args.out, 'tp', text)}", file=sys.stderr)


if __name__ == "__main__":
    main()
