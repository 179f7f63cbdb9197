"""Benchmarks (not tests): our engine against transformers, side by side in one run.

    python benchmarks/bench.py --mode ar,hf-ar                       # AR: decode tok/s at batch 1/8, forward cost vs n
    python benchmarks/bench.py --mode ar,sd,hf-ar,hf-assisted --k 1,2,3,4,6   # SD sweep (batch 1)

    python benchmarks/bench.py --mode ar,ar-all,sd,ssd --k 4 --cores 0 --threads 1 --draft-cores 1   # SSD, paper placement

Modes: `ar` (our engine, no speculation), `sd` (our engine with the draft model, K drafts per
round), `ssd` (our engine, the draft in its own process on --draft-cores; one engine per K),
`ar-all` (our AR on --cores plus --draft-cores: every core SSD uses), `hf-ar` (transformers
`generate`), `hf-assisted` (transformers assisted generation with the draft as `assistant_model`,
K candidates per round, constant schedule, no confidence cut-off). With `ssd` the report adds
SSD/SD, SSD/AR, hit rates, T_p and Corollary 9's bounds computed from the same run.

Every mode runs in its own subprocess (so peak RSS is per engine and only one engine is ever in
memory), pinned to the same cores with the same thread count, on the same prompts and dtype (fp32).
A mode's subprocess serves all of its K values: the SD engine is built once with the largest K
and switched to each smaller K in place.

A run with `sd` or `hf-assisted` is an SD run: batch 1, greedy, `--new-tokens` (default 128) per
prompt, each prompt set (`--prompts`, default code,english) reported separately, our prefix cache
off (every K re-runs the same prompts; transformers has no such cache), plus the cost of
a verification forward (K+1 tokens) and of a draft step (1 token), each relative to one target
decode step. It writes `results/DATE-sd.md` (`DATE-ssd.*` when `ssd` runs), `DATE-sd.png` (tok/s vs K) and `DATE-sd.json`
(raw numbers; `python benchmarks/plot.py DATE-sd.json` redraws the plot). An AR run writes
`results/DATE-ar.md`.
"""
import argparse
import datetime
import json
import multiprocessing as mp
import os
import pickle
import platform
import resource
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # prompt_sets.py
FORWARD_SIZES = (1, 2, 4, 8, 16)
SD_MODES = ("sd", "ssd", "hf-assisted")


def load_prompts(name: str, count: int) -> list[str]:
    from prompt_sets import PromptSetError, load_prompt_set
    try:
        return load_prompt_set(name, count)
    except PromptSetError as error:
        sys.exit(f"error: {error}")


def _setup(args) -> None:
    os.sched_setaffinity(0, args.cores)
    import torch
    torch.set_num_threads(args.threads)


def _peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _best_of(reps: int, fn) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


# ---- forward costs: n new tokens after a prefix ------------------------------------------------
def _ours_forward_costs(runner, blocks, block_size: int, prefix: int, sizes, reps: int) -> dict[int, float]:
    """Seconds for one forward of n tokens (logits for all n rows) after a `prefix`-token prefix,
    on a ModelRunner with its own BlockManager (the target's or the draft's)."""
    from ssd_engine import SamplingParams
    from ssd_engine.engine.scheduler import ScheduledBatch
    from ssd_engine.engine.sequence import Sequence

    seq = Sequence(list(range(1000, 1000 + prefix)), SamplingParams(temperature=0), block_size)
    blocks.grow(seq, prefix)
    runner.forward(ScheduledBatch([seq], [prefix]), [[prefix - 1]])
    seq.num_computed_tokens = prefix
    costs = {}
    for n in sizes:
        blocks.grow(seq, prefix + n)
        seq.token_ids = seq.token_ids[:prefix] + [42] * n
        step = ScheduledBatch([seq], [n])
        costs[n] = _best_of(reps, lambda: runner.forward(step, [list(range(n))]))
    blocks.deallocate(seq)
    return costs


def _hf_forward_costs(model, prefix: int, sizes, reps: int) -> dict[int, float]:
    import torch
    from transformers import DynamicCache
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(torch.arange(1000, 1000 + prefix)[None], past_key_values=cache, use_cache=True)
        costs = {}
        for n in sizes:
            ids = torch.full((1, n), 42)
            pos = torch.arange(prefix, prefix + n)[None]

            def step():
                model(ids, position_ids=pos, past_key_values=cache, use_cache=True)
                cache.crop(-n)  # drop the n tokens again
            costs[n] = _best_of(reps, step)
    return costs


# ---- AR run: our engine ------------------------------------------------------------------------
def run_ours(args, prompts: list[str]) -> dict:
    _setup(args)
    from ssd_engine import LLM, SamplingParams

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
    result["forward"] = _ours_forward_costs(engine.runner, engine.block_manager, engine.config.block_size,
                                            args.prefix, FORWARD_SIZES, args.reps)
    result["peak_rss_gb"] = _peak_rss_gb()
    return result


# ---- AR run: transformers ----------------------------------------------------------------------
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
    result["forward"] = _hf_forward_costs(model, args.prefix, FORWARD_SIZES, args.reps)
    result["peak_rss_gb"] = _peak_rss_gb()
    return result


# ---- SD run: one entry per (prompt set, K); K is None for the AR baselines ---------------------
def _entry(k, tokens: int, seconds: float, outputs: list[list[int]], spec: dict | None) -> dict:
    entry = {"k": k, "tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds, "outputs": outputs}
    for key in ("rounds", "drafted", "accepted", "acceptance_rate", "mean_acceptance_length"):
        entry[key] = spec.get(key) if spec else None
    return entry


def _ours_timed(llm, prompts: list[str], new_tokens: int) -> tuple[int, float, list[list[int]]]:
    from ssd_engine import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    outputs, seconds = [], 0.0
    for prompt in prompts:  # batch 1
        start = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        seconds += time.perf_counter() - start
        outputs.append(list(out.token_ids))
    return sum(map(len, outputs)), seconds, outputs


def _ours_warmup(llm, prompt: str) -> None:
    from ssd_engine import SamplingParams
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)


def run_ours_ar_sd(args, prompt_sets: dict[str, list[str]]) -> dict:
    """`ar` in an SD run: batch 1 over each prompt set."""
    _setup(args)
    from ssd_engine import LLM

    llm = LLM(args.model, num_threads=args.threads, cpu_weight_layout=args.layout, max_num_seqs=1,
              enable_prefix_caching=False)
    runs = {}
    for name, prompts in prompt_sets.items():
        _ours_warmup(llm, prompts[0])
        runs[name] = [_entry(None, *_ours_timed(llm, prompts, args.new_tokens), None)]
    return {"runs": runs, "peak_rss_gb": _peak_rss_gb()}


def _set_k(llm, k: int) -> None:
    """Switch a live SD engine (built with the largest K) to K drafts per round. Everything sized
    by K at construction (RoPE table, admission lookahead) is sized for the largest K, so a
    smaller K fits; the metrics counters are per K and start fresh."""
    from ssd_engine.spec.metrics import SpecMetrics
    engine = llm.engine
    engine.speculator.k = k
    engine.spec_metrics = SpecMetrics(k)


def run_ours_sd(args, prompt_sets: dict[str, list[str]]) -> dict:
    _setup(args)
    from ssd_engine import LLM

    llm = LLM(args.model, draft_model=args.draft, speculative_mode="sd", num_speculative_tokens=max(args.k),
              num_threads=args.threads, cpu_weight_layout=args.layout, max_num_seqs=1, enable_prefix_caching=False)
    runs = {name: [] for name in prompt_sets}
    for k in args.k:
        for name, prompts in prompt_sets.items():
            _set_k(llm, k)
            _ours_warmup(llm, prompts[0])
            _set_k(llm, k)  # fresh counters for the timed prompts
            tokens, seconds, outputs = _ours_timed(llm, prompts, args.new_tokens)
            spec = llm.speculation_metrics()
            if spec["drafted"] != k * spec["rounds"]:
                raise RuntimeError(f"K={k} not honoured: {spec['drafted']} drafts in {spec['rounds']} rounds")
            runs[name].append(_entry(k, tokens, seconds, outputs, spec))

    engine = llm.engine
    block_size = engine.config.block_size
    target = _ours_forward_costs(engine.runner, engine.block_manager, block_size, args.prefix,
                                 sorted({1} | {k + 1 for k in args.k}), args.reps)
    draft = engine.speculator
    draft_step = _ours_forward_costs(draft.runner, draft.blocks, block_size, args.prefix, [1], args.reps)[1]
    costs = {"target_step_s": target[1], "draft_step_s": draft_step,
             "verify_s": {k: target[k + 1] for k in args.k}}
    return {"runs": runs, "costs": costs, "peak_rss_gb": _peak_rss_gb()}


def run_ours_ar_all(args, prompt_sets: dict[str, list[str]]) -> dict:
    """`ar-all`: our AR on every core an SSD run uses (target's + draft's), for an honest baseline."""
    import copy
    wide = copy.copy(args)
    wide.cores = set(args.cores) | set(args.draft_cores)
    wide.threads = len(wide.cores)
    return run_ours_ar_sd(wide, prompt_sets)


def run_ours_ssd(args, prompt_sets: dict[str, list[str]]) -> dict:
    """SSD: this process (the target, rank 0) on --cores, the draft process on --draft-cores.
    One engine per K (K sizes the draft process's cache and payload)."""
    os.sched_setaffinity(0, set(args.cores) | set(args.draft_cores))
    from ssd_engine import LLM
    from ssd_engine.spec.metrics import SpecMetrics
    from ssd_engine.spec.ssd_metrics import SSDMetrics

    placement = f"{','.join(map(str, sorted(args.cores)))};{','.join(map(str, sorted(args.draft_cores)))}"
    runs = {name: [] for name in prompt_sets}
    for k in args.k:
        llm = LLM(args.model, draft_model=args.draft, speculative_mode="ssd", num_speculative_tokens=k,
                  cpu_cores=placement, ssd_fanout=args.fanout, ssd_fallback=args.fallback,
                  cpu_weight_layout=args.layout, max_num_seqs=1, enable_prefix_caching=False)
        for name, prompts in prompt_sets.items():
            _ours_warmup(llm, prompts[0])
            llm.engine.spec_metrics = SpecMetrics(k)  # fresh counters for the timed prompts
            llm.engine.speculator.metrics = SSDMetrics(k)
            tokens, seconds, outputs = _ours_timed(llm, prompts, args.new_tokens)
            spec = llm.speculation_metrics()
            entry = _entry(k, tokens, seconds, outputs, spec)
            entry["ssd"] = {key: spec[key] for key in SSD_KEYS}
            runs[name].append(entry)
        llm.close()
    return {"runs": runs, "placement": placement, "peak_rss_gb": _peak_rss_gb()}


SSD_KEYS = ("cache_hit_rate", "cache_hit_rate_warm", "cache_hit_rate_by_k", "acceptance_on_hits",
            "acceptance_on_misses", "speculations_by_source", "draft_failures", "draft_build_s_per_round",
            "coordinator_wait_s_per_round", "verify_s_per_round", "T_p", "tokens_per_round_hit",
            "tokens_per_round_miss", "jit_s_per_round")


def _hf_load(path: str):
    import torch
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _hf_timed(model, tok, prompts: list[str], new_tokens: int, **extra) -> tuple[int, float, list[list[int]]]:
    outputs, seconds = [], 0.0
    for prompt in prompts:  # batch 1 (assisted generation supports nothing else)
        enc = tok([prompt], return_tensors="pt")
        start = time.perf_counter()
        out = model.generate(**enc, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=tok.pad_token_id, **extra)
        seconds += time.perf_counter() - start
        outputs.append(out[0, enc["input_ids"].shape[1]:].tolist())
    return sum(map(len, outputs)), seconds, outputs


def run_hf_ar_sd(args, prompt_sets: dict[str, list[str]]) -> dict:
    """`hf-ar` in an SD run: batch 1 over each prompt set."""
    _setup(args)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    model = _hf_load(args.model)
    runs = {}
    for name, prompts in prompt_sets.items():
        _hf_timed(model, tok, prompts[:1], 8)  # warm-up
        runs[name] = [_entry(None, *_hf_timed(model, tok, prompts, args.new_tokens), None)]
    return {"runs": runs, "peak_rss_gb": _peak_rss_gb()}


class _AssistCounter:
    """Counts drafted/accepted candidates of transformers' assisted generation by wrapping
    `AssistedCandidateGenerator.update_candidate_strategy(input_ids, scores, num_matches)`,
    which every verification round calls with the target scores of the candidates plus the
    bonus position and the number of candidates accepted."""

    def __init__(self) -> None:
        from transformers.generation.candidate_generator import AssistedCandidateGenerator
        self.rounds = self.drafted = self.accepted = 0
        original = AssistedCandidateGenerator.update_candidate_strategy
        counter = self

        def update_candidate_strategy(gen, input_ids, scores, num_matches):
            drafted = scores.shape[1] - 1
            if drafted > 0:  # rounds without candidates (length cap) are plain target steps
                counter.rounds += 1
                counter.drafted += drafted
                counter.accepted += int(num_matches)
            return original(gen, input_ids, scores, num_matches)
        AssistedCandidateGenerator.update_candidate_strategy = update_candidate_strategy

    def reset(self) -> None:
        self.rounds = self.drafted = self.accepted = 0

    def summary(self) -> dict:
        if not self.rounds:
            return {}
        return {"rounds": self.rounds, "drafted": self.drafted, "accepted": self.accepted,
                "acceptance_rate": self.accepted / self.drafted,
                "mean_acceptance_length": 1 + self.accepted / self.rounds}


def run_hf_assisted(args, prompt_sets: dict[str, list[str]]) -> dict:
    _setup(args)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    model, draft = _hf_load(args.model), _hf_load(args.draft)
    counter = _AssistCounter()
    runs = {name: [] for name in prompt_sets}
    for k in args.k:
        # transformers reads these from the assistant's generation config: exactly K candidates a round
        draft.generation_config.num_assistant_tokens = k
        draft.generation_config.num_assistant_tokens_schedule = "constant"
        draft.generation_config.assistant_confidence_threshold = 0.0  # 0 = no early stop, no threshold tuning
        for name, prompts in prompt_sets.items():
            _hf_timed(model, tok, prompts[:1], 8, assistant_model=draft)  # warm-up
            counter.reset()
            tokens, seconds, outputs = _hf_timed(model, tok, prompts, args.new_tokens, assistant_model=draft)
            spec = counter.summary()
            if spec and spec["drafted"] > k * spec["rounds"]:
                raise RuntimeError(f"K={k} not honoured: {spec['drafted']} candidates in {spec['rounds']} rounds")
            runs[name].append(_entry(k, tokens, seconds, outputs, spec))

    target = _hf_forward_costs(model, args.prefix, sorted({1} | {k + 1 for k in args.k}), args.reps)
    draft_step = _hf_forward_costs(draft, args.prefix, [1], args.reps)[1]
    costs = {"target_step_s": target[1], "draft_step_s": draft_step,
             "verify_s": {k: target[k + 1] for k in args.k}}
    return {"runs": runs, "costs": costs, "peak_rss_gb": _peak_rss_gb()}


AR_RUNNERS = {"ar": run_ours, "hf-ar": run_hf}
SD_RUNNERS = {"ar": run_ours_ar_sd, "ar-all": run_ours_ar_all, "sd": run_ours_sd, "ssd": run_ours_ssd,
              "hf-ar": run_hf_ar_sd, "hf-assisted": run_hf_assisted}
MODES = ("ar", "ar-all", "sd", "ssd", "hf-ar", "hf-assisted")


def _child(kind: str, mode: str, args, payload, path: str) -> None:
    result = (SD_RUNNERS if kind == "sd" else AR_RUNNERS)[mode](args, payload)
    with open(path, "wb") as f:
        pickle.dump(result, f)


def run_isolated(kind: str, mode: str, args, payload) -> dict:
    """Run mode's runner of an AR or SD run (`kind`) in a fresh spawned process; its result comes
    back through a file (SD results carry every output's token ids, more than a pipe buffer holds)."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.pkl")
        proc = ctx.Process(target=_child, args=(kind, mode, args, payload, path))
        proc.start()
        proc.join()
        if proc.exitcode != 0 or not os.path.exists(path):
            raise SystemExit(f"mode {mode} failed (exit code {proc.exitcode}); see the traceback above")
        with open(path, "rb") as f:
            return pickle.load(f)


def run_modes(kind: str, modes: list[str], args, payload) -> dict:
    results = {}
    for mode in modes:
        print(f"running {mode} ...", file=sys.stderr, flush=True)
        results[mode] = run_isolated(kind, mode, args, payload)
    return results


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


def _command_line() -> str:
    return f"`python benchmarks/bench.py {' '.join(sys.argv[1:])}`"


def report(args, results: dict[str, dict]) -> str:
    lines = [f"# AR benchmark, {datetime.date.today().isoformat()}", "",
             f"Machine: {machine_line(args)}", f"Model: {args.model}",
             f"Command: {_command_line()}", "",
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


# ---- SD report ------------------------------------------------------------------------------
BASELINE = {"sd": "ar", "ssd": "ar", "ar-all": "ar", "hf-assisted": "hf-ar"}
ENGINE_OF = {"sd": "ours", "hf-assisted": "transformers"}


def _fmt(value, spec: str, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def _matches(outputs: list[list[int]], reference: list[list[int]]) -> str:
    same = sum(a == b for a, b in zip(outputs, reference))
    return f"{same}/{len(reference)}"


def _predicted(costs: dict | None, k: int, mean_len: float | None) -> float | None:
    """Speedup over the same engine's AR if each round cost K draft steps + one verification and
    nothing else: L / (K * draft/target + verify/target)."""
    if not costs or not mean_len:
        return None
    step = costs["target_step_s"]
    return mean_len / (k * costs["draft_step_s"] / step + costs["verify_s"][k] / step)


def sd_report(args, results: dict[str, dict]) -> str:
    modes = list(results)
    lines = [f"# SD / SSD benchmark, {datetime.date.today().isoformat()}", "",
             f"Machine: {machine_line(args)}", f"Target: {args.model}", f"Draft: {args.draft}",
             f"Command: {_command_line()}", "",
             f"Batch 1, greedy, {args.new_tokens} new tokens per prompt (EOS ignored), prompts one after another. "
             "tok/s = generated tokens / wall time of the generate calls (prefill included). "
             "Acceptance rate = accepted / drafted; mean acceptance length = tokens emitted per verification "
             "round, bonus included (vLLM definitions); for hf-assisted counted from transformers' own "
             "per-round match counts. `= AR` = outputs identical to the same engine's AR outputs. "
             "`predicted` = L / (K·draft + verify) with the costs measured below: the speedup over the same "
             "engine's AR if a round cost nothing but its forwards.", ""]
    lines += headline_section(args, results)
    for name in args.prompt_sets:
        base = {m: results[m]["runs"][name][0] for m in ("ar", "hf-ar") if m in results}
        count = len(next(iter(results.values()))["runs"][name][0]["outputs"])
        lines += [f"## {name} prompts ({count})", "",
                  "| mode | K | tok/s | vs ar | vs hf-ar | acceptance rate | mean acceptance length "
                  "| predicted | = AR |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for mode in modes:
            for entry in results[mode]["runs"][name]:
                vs = [_fmt(entry["tok_s"] / base[b]["tok_s"] if b in base else None, ".2f", "x") for b in ("ar", "hf-ar")]
                ref = BASELINE.get(mode)
                same = _matches(entry["outputs"], base[ref]["outputs"]) if ref in base else "-"
                k = entry["k"]
                predicted = _predicted(results[mode].get("costs"), k, entry["mean_acceptance_length"]) if k else None
                lines.append(f"| {mode} | {k or '-'} | {entry['tok_s']:.2f} | {vs[0]} | {vs[1]} "
                             f"| {_fmt(entry['acceptance_rate'], '.3f') if k else '-'} "
                             f"| {_fmt(entry['mean_acceptance_length'], '.2f') if k else '-'} "
                             f"| {_fmt(predicted, '.2f', 'x') if k else '-'} | {same} |")
        if {"ar", "hf-ar"} <= base.keys():
            lines.append("")
            lines.append(f"ar outputs identical to hf-ar outputs: {_matches(base['ar']['outputs'], base['hf-ar']['outputs'])}")
        lines.append("")

    if "ssd" in results:
        lines += ssd_section(args, results)
    costed = [m for m in modes if results[m].get("costs")]
    if costed:
        lines += [f"## Forward costs after a {args.prefix}-token prefix (best of {args.reps}), "
                  "relative to one target decode step (1 token)", "",
                  "| engine | target step ms | draft step ms | draft / target | "
                  + " | ".join(f"verify K={k} (n={k + 1}) ms / ×step" for k in args.k) + " |",
                  "|---" * (4 + len(args.k)) + "|"]
        for mode in costed:
            c = results[mode]["costs"]
            step = c["target_step_s"]
            cells = [f"{c['verify_s'][k] * 1e3:.1f} / {c['verify_s'][k] / step:.2f}x" for k in args.k]
            lines.append(f"| {ENGINE_OF[mode]} ({mode}) | {step * 1e3:.1f} | {c['draft_step_s'] * 1e3:.1f} "
                         f"| {c['draft_step_s'] / step:.2f}x | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["Peak RSS: " + ", ".join(f"{m} {results[m]['peak_rss_gb']:.1f} GB" for m in results), ""]
    return "\n".join(lines)


def headline_section(args, results: dict[str, dict]) -> list[str]:
    """The paper's headline table (Appendix B.3 column order) when AR, SD and SSD all ran: per
    prompt set and averaged over sets (mean tok/s; ratios of the means), at the largest K both SD and
    SSD measured."""
    if not {"ar", "sd", "ssd"} <= results.keys():
        return []
    ks = {e["k"] for e in results["sd"]["runs"][args.prompt_sets[0]]} & {
        e["k"] for e in results["ssd"]["runs"][args.prompt_sets[0]]}
    if not ks:
        return []
    k = max(ks)
    lines = [f"## Headline (K = {k}; the paper's columns)", "", "| prompts | AR tok/s | SD tok/s | SSD tok/s | SSD/SD | SSD/AR |",
             "|---|---|---|---|---|---|"]
    rows = []
    for name in args.prompt_sets:
        ar = results["ar"]["runs"][name][0]["tok_s"]
        sd = next(e["tok_s"] for e in results["sd"]["runs"][name] if e["k"] == k)
        ssd = next(e["tok_s"] for e in results["ssd"]["runs"][name] if e["k"] == k)
        rows.append((name, ar, sd, ssd))
    if len(rows) > 1:
        rows.append(("average",) + tuple(sum(r[i] for r in rows) / len(rows) for i in (1, 2, 3)))
    for name, ar, sd, ssd in rows:
        lines.append(f"| {name} | {ar:.2f} | {sd:.2f} | {ssd:.2f} | {ssd / sd:.2f}x | {ssd / ar:.2f}x |")
    return lines + [""]


def ssd_section(args, results: dict[str, dict]) -> list[str]:
    """SSD against SD and AR from the same run, with Corollary 9's bounds on SSD/SD:
    (1 + T_SD)(p_hit E_p + 1 - p_hit) / E_SD <= SSD/SD <= (1 + T_SD) E_p / E_SD, where T_SD = K draft
    steps / one verification (SD's measured costs), E_SD = SD's mean acceptance length, E_p = 1 + K x
    SSD's acceptance on cache hits, p_hit = SSD's cache-hit rate."""
    sd_costs = results.get("sd", {}).get("costs")
    lines = [f"## SSD (target on cores {sorted(args.cores)}, draft process on cores {sorted(args.draft_cores)}; "
             f"fan-out {args.fanout}, miss fallback {args.fallback})", "",
             "T_p = draft cache-build time per round / coordinator verification time per round. "
             "Bounds: Corollary 9 with this run's SD costs and acceptance (see ssd_section in bench.py).", "",
             "Theorem 7: predicted SSD/AR = [p E_p + (1-p) E_b] / [p max(1, T_p) + (1-p)(1 + T_b)] from this run's "
             "warm hit rate p, tokens per hit / miss round E_p / E_b, T_p, and T_b = just-in-time drafting time / "
             "verification (0 with the fast backup).", "",
             "| prompts | K | SSD tok/s | SSD/SD | SSD/AR | SSD/AR-all | hit rate (after 1st round) | acceptance "
             "(hits / misses) | E_p | T_p | Cor. 9 lower | Cor. 9 upper | SSD/SD ÷ upper | Thm 7 SSD/AR | "
             "measured ÷ Thm 7 | speculations |",
             "|---" * 16 + "|"]
    for name in args.prompt_sets:
        ar = results.get("ar", {}).get("runs", {}).get(name, [None])[0]
        ar_all = results.get("ar-all", {}).get("runs", {}).get(name, [None])[0]
        sd = {e["k"]: e for e in results.get("sd", {}).get("runs", {}).get(name, [])}
        for e in results["ssd"]["runs"][name]:
            k, m = e["k"], e["ssd"]
            e_p = 1 + k * m["acceptance_on_hits"] if m["acceptance_on_hits"] else None
            lower = upper = vs_sd = None
            if k in sd and sd_costs:
                t_sd = k * sd_costs["draft_step_s"] / sd_costs["verify_s"][k]
                e_sd = sd[k]["mean_acceptance_length"]
                vs_sd = e["tok_s"] / sd[k]["tok_s"]
                p_hit = m["cache_hit_rate"]
                if e_p:
                    upper = (1 + t_sd) * e_p / e_sd
                    lower = (1 + t_sd) * (p_hit * e_p + 1 - p_hit) / e_sd
            predicted = _theorem7(m)
            vs_ar = e["tok_s"] / ar["tok_s"] if ar else None
            lines.append(
                f"| {name} | {k} | {e['tok_s']:.2f} | {_fmt(vs_sd, '.2f', 'x')} "
                f"| {_fmt(e['tok_s'] / ar['tok_s'] if ar else None, '.2f', 'x')} "
                f"| {_fmt(e['tok_s'] / ar_all['tok_s'] if ar_all else None, '.2f', 'x')} "
                f"| {m['cache_hit_rate']:.3f} ({m['cache_hit_rate_warm']:.3f}) "
                f"| {m['acceptance_on_hits']:.3f} / {m['acceptance_on_misses']:.3f} | {_fmt(e_p, '.2f')} "
                f"| {m['T_p']:.2f} | {_fmt(lower, '.2f', 'x')} | {_fmt(upper, '.2f', 'x')} "
                f"| {_fmt(vs_sd / upper if vs_sd and upper else None, '.2f')} | {_fmt(predicted, '.2f', 'x')} "
                f"| {_fmt(vs_ar / predicted if vs_ar and predicted else None, '.2f')} | {m['speculations_by_source']} |")
    lines.append("")
    return lines


def _theorem7(m: dict) -> float | None:
    """Theorem 7's SSD/AR from one run's SSD metrics (None when a needed number is missing)."""
    from ssd_engine.saguaro.speedup import ssd_speedup
    if "tokens_per_round_hit" not in m or not m["verify_s_per_round"] or not m["tokens_per_round_hit"]:
        return None
    t_b = m["jit_s_per_round"] / m["verify_s_per_round"]
    e_b = m["tokens_per_round_miss"] or 1.0
    return ssd_speedup(m["cache_hit_rate_warm"], m["tokens_per_round_hit"], e_b, m["T_p"], t_b)


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
    print(f"wrote {path}", file=sys.stderr)


def _without_outputs(results: dict) -> dict:
    """The results minus every output's token ids (only used for the `= AR` column)."""
    return {mode: {**r, "runs": {name: [{k: v for k, v in e.items() if k != "outputs"} for e in entries]
                                 for name, entries in r["runs"].items()}} for mode, r in results.items()}


def _csv(text: str, cast=str) -> list:
    return [cast(x) for x in text.split(",") if x.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="ar,hf-ar", help="comma-separated: " + ", ".join(MODES))
    parser.add_argument("--model", default=None, help="target HF folder (default: the built-in target)")
    parser.add_argument("--draft", default=None, help="draft HF folder for sd/hf-assisted "
                        "(default: the built-in draft; required with --model)")
    parser.add_argument("--prompts", default=None,
                        help="comma-separated prompt sets from benchmarks/prompts/ (default: code for AR runs, "
                             "code,english for SD runs)")
    parser.add_argument("--num-prompts", "--max-prompts", dest="num_prompts", type=int, default=8,
                        help="prompts per set")
    parser.add_argument("--batch", default=None, help="comma-separated batch sizes (AR runs; default 1,8)")
    parser.add_argument("--k", default="1,2,3,4,6", help="comma-separated draft lengths K (SD runs)")
    parser.add_argument("--new-tokens", type=int, default=None, help="default: 32 for AR runs, 128 for SD runs")
    parser.add_argument("--prefix", type=int, default=200)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cores", default="0,1", help="comma-separated core ids to pin to")
    parser.add_argument("--layout", default="auto", help="our cpu_weight_layout")
    parser.add_argument("--draft-cores", default="1", help="SSD: comma-separated cores of the draft process "
                        "(the target, AR and SD run on --cores)")
    parser.add_argument("--fanout", default="1", help="SSD fan-out: one int or K+1 of them")
    parser.add_argument("--fallback", default="jit", help="SSD miss fallback: jit | fast")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args()
    args.cores = set(_csv(args.cores, int))
    args.draft_cores = set(_csv(args.draft_cores, int))
    modes = _csv(args.mode)
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown mode {unknown[0]!r}; choose from {', '.join(MODES)}")
    if not modes:
        parser.error("--mode is empty")
    sd_run = any(m in SD_MODES for m in modes)
    if args.model is None:
        from ssd_engine.default_models import resolve_default_model
        args.model = resolve_default_model("target")
        if sd_run and args.draft is None:
            args.draft = resolve_default_model("draft")
    if sd_run and args.draft is None:
        parser.error("--model was given, so sd/hf-assisted need --draft too")
    stamp = datetime.date.today().isoformat()
    os.makedirs(args.out, exist_ok=True)

    if not sd_run:
        args.batch = _csv(args.batch or "1,8", int)
        args.new_tokens = args.new_tokens or 32
        if "," in (args.prompts or ""):
            parser.error("an AR run takes one prompt set (several are for SD runs)")
        prompts = load_prompts(args.prompts or "code", args.num_prompts)
        text = report(args, run_modes("ar", modes, args, prompts))
        print(text)
        _write(os.path.join(args.out, f"{stamp}-ar.md"), text)
        return

    if args.batch not in (None, "1"):
        parser.error("SD runs are batch 1 (transformers' assisted generation supports nothing else)")
    args.batch = [1]
    args.k = sorted(set(_csv(args.k, int)))
    if not args.k or min(args.k) < 1:
        parser.error("--k needs draft lengths >= 1")
    args.new_tokens = args.new_tokens or 128
    args.prompt_sets = _csv(args.prompts or "code,english")
    prompt_sets = {name: load_prompts(name, args.num_prompts) for name in args.prompt_sets}
    results = run_modes("sd", modes, args, prompt_sets)
    text = sd_report(args, results)
    print(text)
    base = os.path.join(args.out, f"{stamp}-{'ssd' if 'ssd' in modes else 'sd'}")
    _write(base + ".md", text)
    raw = {"date": stamp, "machine": machine_line(args), "command": _command_line(), "target": args.model,
           "draft": args.draft, "new_tokens": args.new_tokens, "k": args.k, "prompt_sets": args.prompt_sets,
           "results": _without_outputs(results)}
    _write(base + ".json", json.dumps(raw, indent=1))
    try:
        from plot import plot_sd
        plot_sd(raw, base + ".png")
        print(f"wrote {base}.png", file=sys.stderr)
    except ImportError as error:
        print(f"no plot ({error}); pip install matplotlib, then python benchmarks/plot.py {base}.json",
              file=sys.stderr)


if __name__ == "__main__":
    main()
