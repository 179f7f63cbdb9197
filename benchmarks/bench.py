"""Benchmarks (not tests): our engine against transformers, side by side in one run.

    python benchmarks/bench.py --mode ar,hf-ar

Every mode runs in its own subprocess (so peak RSS is per engine and models never share memory),
pinned to the same cores with the same thread count, on the same prompts and dtype (fp32).
Writes a dated Markdown table to benchmarks/results/.
"""
import argparse
import datetime
import multiprocessing as mp
import os
import platform
import resource
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
FORWARD_SIZES = (1, 2, 4, 8, 16)


def load_prompts(name: str, count: int) -> list[str]:
    with open(os.path.join(HERE, "prompts", f"{name}.txt")) as f:
        prompts = [line.rstrip("\n").replace("\\n", "\n") for line in f if line.strip()]
    return (prompts * count)[:count]


def _setup(args) -> None:
    os.sched_setaffinity(0, args.cores)
    import torch
    torch.set_num_threads(args.threads)


def _peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


# ---- our engine ----------------------------------------------------------------------------
def run_ours(args, prompts: list[str]) -> dict:
    _setup(args)
    import torch
    from ssd_engine import LLM, SamplingParams
    from ssd_engine.engine.scheduler import ScheduledBatch

    llm = LLM(args.model, num_threads=args.threads, cpu_weight_layout=args.layout, max_num_seqs=max(args.batch))
    result = {"decode": {}}
    for batch in args.batch:
        params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm-up
        start = time.perf_counter()
        tokens = 0
        for i in range(0, args.num_prompts, batch):
            outs = llm.generate(prompts[i:i + batch], params, use_tqdm=False)
            tokens += sum(len(o.token_ids) for o in outs)
        result["decode"][batch] = tokens / (time.perf_counter() - start)

    engine = llm.engine
    seq = engine.add_request(list(range(1000, 1000 + args.prefix)), SamplingParams(temperature=0, max_tokens=32))
    batch = engine.scheduler.schedule()
    engine.runner.forward(batch, [[args.prefix - 1]])
    seq.num_computed_tokens = args.prefix
    costs = {}
    for n in FORWARD_SIZES:
        engine.block_manager.grow(seq, args.prefix + n)
        seq.token_ids = seq.token_ids[:args.prefix] + [42] * n
        step = ScheduledBatch([seq], [n])
        costs[n] = _best_of(args.reps, lambda: engine.runner.forward(step, [list(range(n))]))
    result["forward"] = costs
    result["peak_rss_gb"] = _peak_rss_gb()
    return result


# ---- transformers ------------------------------------------------------------------------
def run_hf(args, prompts: list[str]) -> dict:
    _setup(args)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    result = {"decode": {}}
    for batch in args.batch:
        model.generate(**tok(prompts[:1], return_tensors="pt"), max_new_tokens=2, do_sample=False)
        start, tokens = time.perf_counter(), 0
        for i in range(0, args.num_prompts, batch):
            enc = tok(prompts[i:i + batch], return_tensors="pt", padding=True)
            out = model.generate(**enc, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                 do_sample=False, pad_token_id=tok.pad_token_id)
            tokens += (out.shape[1] - enc["input_ids"].shape[1]) * out.shape[0]
        result["decode"][batch] = tokens / (time.perf_counter() - start)

    from transformers import DynamicCache
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(torch.arange(1000, 1000 + args.prefix)[None], past_key_values=cache, use_cache=True)
        costs = {}
        for n in FORWARD_SIZES:
            ids = torch.full((1, n), 42)
            pos = torch.arange(args.prefix, args.prefix + n)[None]

            def step():
                model(ids, position_ids=pos, past_key_values=cache, use_cache=True)
                cache.crop(-n)  # drop the n tokens again
            costs[n] = _best_of(args.reps, step)
    result["forward"] = costs
    result["peak_rss_gb"] = _peak_rss_gb()
    return result


def _best_of(reps: int, fn) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


RUNNERS = {"ar": run_ours, "hf-ar": run_hf}


def _child(mode, args, prompts, queue):
    queue.put(RUNNERS[mode](args, prompts))


def run_isolated(mode: str, args, prompts) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(mode, args, prompts, queue))
    proc.start()
    proc.join()  # results are small, so the child's queue flush never blocks its exit
    if proc.exitcode != 0:
        raise SystemExit(f"mode {mode} failed (exit code {proc.exitcode}); see the traceback above")
    return queue.get()


def machine_line(args) -> str:
    import torch
    cpu = platform.processor() or "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"{cpu}, {os.cpu_count()} cores visible; cores {sorted(args.cores)}, {args.threads} thread(s); "
            f"torch {torch.__version__}, fp32; python {platform.python_version()}")


def report(args, results: dict[str, dict]) -> str:
    lines = [f"# AR benchmark, {datetime.date.today().isoformat()}", "",
             f"Machine: {machine_line(args)}", f"Model: {args.model}",
             f"Command: `python benchmarks/bench.py {' '.join(sys.argv[1:])}`", "",
             f"## Decode throughput (greedy, {args.new_tokens} new tokens, {args.num_prompts} code prompts)", "",
             "| batch | " + " | ".join(f"{m} tok/s" for m in results) + " | ar / hf-ar |",
             "|---" * (len(results) + 2) + "|"]
    for batch in args.batch:
        values = [results[m]["decode"][batch] for m in results]
        ratio = (results["ar"]["decode"][batch] / results["hf-ar"]["decode"][batch]
                 if {"ar", "hf-ar"} <= results.keys() else float("nan"))
        lines.append(f"| {batch} | " + " | ".join(f"{v:.2f}" for v in values) + f" | {ratio:.2f}x |")
    lines += ["", f"## One forward of n new tokens after a {args.prefix}-token prefix (best of {args.reps})", "",
              "| n | " + " | ".join(f"{m} ms | {m} vs n=1" for m in results) + " |",
              "|---" * (2 * len(results) + 1) + "|"]
    for n in FORWARD_SIZES:
        cells = []
        for m in results:
            cost = results[m]["forward"]
            cells.append(f"{cost[n] * 1e3:.0f} | {cost[n] / cost[1]:.2f}x")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines += ["", "Peak RSS: " + ", ".join(f"{m} {results[m]['peak_rss_gb']:.1f} GB" for m in results), ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="ar,hf-ar", help="comma-separated: " + ", ".join(RUNNERS))
    parser.add_argument("--model", default=None, help="HF folder (default: the built-in target)")
    parser.add_argument("--prompts", default="code")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--batch", default="1,8", help="comma-separated batch sizes")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prefix", type=int, default=200)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cores", default="0", help="comma-separated core ids to pin to")
    parser.add_argument("--layout", default="dual", help="our cpu_weight_layout")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args()
    args.batch = [int(b) for b in args.batch.split(",")]
    args.cores = {int(c) for c in args.cores.split(",")}
    modes = [m for m in args.mode.split(",") if m]
    unknown = [m for m in modes if m not in RUNNERS]
    if unknown:
        parser.error(f"unknown mode {unknown[0]!r}; choose from {', '.join(RUNNERS)}")
    if args.model is None:
        from ssd_engine.default_models import resolve_default_model
        args.model = resolve_default_model("target")
    prompts = load_prompts(args.prompts, args.num_prompts)
    results = {}
    for mode in modes:
        print(f"running {mode} ...", file=sys.stderr, flush=True)
        results[mode] = run_isolated(mode, args, prompts)
    text = report(args, results)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{datetime.date.today().isoformat()}-ar.md")
    with open(path, "w") as f:
        f.write(text)
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
