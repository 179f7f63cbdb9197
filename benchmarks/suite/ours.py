"""Our engine's runners. Each runs in its own process (isolate.py) and measures every cell of
its mode: K x batch size x prompt set. SD and SSD build one engine per K: K is fixed when an
engine is built (it sizes position tables, CUDA graphs and the draft process's cache and payload)."""
import copy
import time

from suite.probe import best_of
from suite.measure import Request, batches, cell, engine_peaks, merge_peaks, pin

SSD_KEYS = ("cache_hit_rate", "cache_hit_rate_warm", "acceptance_on_hits", "acceptance_on_misses",
            "speculations_by_source", "draft_failures", "draft_build_s_per_round", "coordinator_wait_s_per_round",
            "verify_s_per_round", "glue_s_per_round", "T_p", "tokens_per_round_hit", "tokens_per_round_miss",
            "jit_s_per_round", "backup_rounds", "fanouts", "critical_batch_size")
SPEC_KEYS = ("rounds", "drafted", "accepted", "acceptance_rate", "mean_acceptance_length")


def _params(opts, index: int):
    from ssd_engine import SamplingParams
    seed = index if opts.temperature > 0 else None  # sampled runs are reproducible request by request
    return SamplingParams(temperature=opts.temperature, max_tokens=opts.new_tokens, ignore_eos=True, seed=seed)


def measure(llm, opts, prompts: list[str], batch: int) -> dict:
    """Generate every prompt `batch` at a time; one cell of timings (see measure.cell)."""
    timed, started = [], time.perf_counter()
    for b, group in enumerate(batches(prompts, batch)):
        outs = llm.generate(group, [_params(opts, b * batch + i) for i in range(len(group))], use_tqdm=False)
        timed.append([Request(o.metrics.ttft_s, o.metrics.e2e_s, len(o.token_ids), list(o.token_ids)) for o in outs])
    return cell(timed, time.perf_counter() - started)


def _warm_up(llm, prompt: str, batch: int) -> None:
    from ssd_engine import SamplingParams
    llm.generate([prompt] * batch, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)


def _reset_counters(llm) -> None:
    """Fresh speculation counters, so a cell's acceptance and hit rates are its own."""
    engine = llm.engine
    if engine.speculator is not None:
        engine.spec_metrics.reset()
    if hasattr(engine.speculator, "metrics"):
        engine.speculator.metrics.reset()


def _cells(llm, opts, prompt_sets: dict, mode: str, k: int | None, progress) -> list[dict]:
    rows = []
    for batch in opts.batch:
        _reset_counters(llm)
        _warm_up(llm, next(iter(prompt_sets.values()))[0], batch)
        for name, prompts in prompt_sets.items():
            _reset_counters(llm)
            label = f"{mode}{f' K={k}' if k else ''} b={batch} {name}"
            progress("measuring", label)
            row = {"mode": mode, "set": name, "batch": batch, "k": k, **measure(llm, opts, prompts, batch)}
            if k is not None:
                spec = llm.speculation_metrics()
                if mode == "sd" and spec["drafted"] != k * spec["rounds"]:
                    raise RuntimeError(f"K={k} not honoured: {spec['drafted']} drafts in {spec['rounds']} rounds")
                row.update({key: spec.get(key) for key in SPEC_KEYS})
                if mode == "ssd":
                    row["ssd"] = {key: spec.get(key) for key in SSD_KEYS}
            rows.append(row)
            progress("done", label)
    return rows


def _engine_options(opts, with_draft: bool) -> dict:
    options = dict(num_threads=opts.threads, max_num_seqs=max(opts.batch), enable_prefix_caching=False,
                   device=opts.device, dtype=opts.dtype, tensor_parallel_size=opts.tp)
    if opts.device == "cpu":
        options["cpu_weight_layout"] = opts.layout
        if opts.tp > 1 or with_draft:
            options["cpu_cores"] = opts.placement(with_draft)
    return options


def run_ar(opts, prompt_sets: dict, progress) -> dict:
    pin(opts.cores, opts.threads, opts.device)
    from ssd_engine import LLM
    with LLM(opts.model, speculative_mode="ar", **_engine_options(opts, False)) as llm:
        rows = _cells(llm, opts, prompt_sets, "ar", None, progress)
        costs = {"target_forward_s": forward_costs(llm.engine.runner, llm.engine.block_manager, llm.engine.config,
                                                   opts, sorted({1, 2, 4, 8} | {k + 1 for k in opts.k}))}
        peaks = engine_peaks(llm)
    return {"rows": rows, "costs": costs, "peaks": peaks}


def run_ar_all(opts, prompt_sets: dict, progress) -> dict:
    """`ar-all`: our AR on every core an SSD run uses (target's + draft's): the honest baseline for SSD."""
    wide = copy.copy(opts)
    wide.cores = set(opts.cores) | set(opts.draft_cores)
    wide.threads = len(wide.cores)
    result = run_ar(wide, prompt_sets, progress)
    for row in result["rows"]:
        row["mode"] = "ar-all"
    return result


def run_sd(opts, prompt_sets: dict, progress) -> dict:
    pin(opts.cores, opts.threads, opts.device)
    from ssd_engine import LLM
    rows, costs, peaks = [], {}, {}
    for k in opts.k:
        with LLM(opts.model, draft_model=opts.draft, speculative_mode="sd", num_speculative_tokens=k,
                 **_engine_options(opts, False)) as llm:
            rows += _cells(llm, opts, prompt_sets, "sd", k, progress)
            engine = llm.engine
            if k == max(opts.k):  # its positions cover every verification width measured
                costs = {"target_forward_s": forward_costs(engine.runner, engine.block_manager, engine.config, opts,
                                                           sorted({1} | {n + 1 for n in opts.k})),
                         "draft_step_s": forward_costs(engine.speculator.runner, engine.speculator.blocks,
                                                       engine.config, opts, [1]).get(1)}
            peaks = merge_peaks(peaks, engine_peaks(llm))
    return {"rows": rows, "costs": costs, "peaks": peaks}


def run_ssd(opts, prompt_sets: dict, progress) -> dict:
    """The target (rank 0) is this process; the draft process gets its own cores / GPU. The engine
    pins each side to its core set (cpu_cores), so this process first may use all of them."""
    pin(set(opts.cores) | set(opts.draft_cores), opts.threads, opts.device)
    from ssd_engine import LLM
    extra = {key: value for key, value in (("ssd_fanout", opts.fanout), ("ssd_fallback", opts.fallback)) if value}
    rows, peaks = [], {}
    for k in opts.k:
        with LLM(opts.model, draft_model=opts.draft, speculative_mode="ssd", num_speculative_tokens=k,
                 **_engine_options(opts, True), **extra) as llm:
            rows += _cells(llm, opts, prompt_sets, "ssd", k, progress)
            peaks = merge_peaks(peaks, engine_peaks(llm))
    return {"rows": rows, "costs": {}, "peaks": peaks}


def forward_costs(runner, blocks, config, opts, sizes: list[int]) -> dict[int, float]:
    """Seconds for one forward of n new tokens after an `opts.prefix`-token prefix, best of `opts.reps`."""
    return best_of(runner, blocks, config, opts.prefix, sizes, opts.reps)


RUNNERS = {"ar": run_ar, "ar-all": run_ar_all, "sd": run_sd, "ssd": run_ssd}
