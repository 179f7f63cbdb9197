"""Our engine's runners. Each runs in its own process (isolate.py) and measures every cell of
its mode: K x batch size x prompt set. SD and SSD build one engine per K: K is fixed when an
engine is built (it sizes position tables, CUDA graphs and the draft process's cache and payload).
`auto` builds one engine and lets it pick its mode and K; `ar-all` / `sd-all` are AR / SD on the
target's and the draft's cores together."""

import copy
import time

from suite.measure import Request, batches, cell, engine_peaks, merge_peaks, pin
from suite.probe import best_of

SSD_KEYS = (
    "cache_hit_rate",
    "cache_hit_rate_warm",
    "acceptance_on_hits",
    "acceptance_on_misses",
    "speculations_by_source",
    "draft_failures",
    "draft_build_s_per_round",
    "coordinator_wait_s_per_round",
    "verify_s_per_round",
    "glue_s_per_round",
    "T_p",
    "tokens_per_round_hit",
    "tokens_per_round_miss",
    "jit_s_per_round",
    "backup_rounds",
    "fanouts",
    "critical_batch_size",
    "branch_rows_per_build",
)
SPEC_KEYS = ("rounds", "drafted", "accepted", "acceptance_rate", "mean_acceptance_length")


def _params(opts, index: int):
    from ssd_engine import SamplingParams

    seed = (
        index if opts.temperature > 0 else None
    )  # sampled runs are reproducible request by request
    return SamplingParams(
        temperature=opts.temperature, max_tokens=opts.new_tokens, ignore_eos=True, seed=seed
    )


def measure(llm, opts, prompts: list[str], batch: int) -> dict:
    """Generate every prompt `batch` at a time; one cell of timings (see measure.cell)."""
    timed, started = [], time.perf_counter()
    for b, group in enumerate(batches(prompts, batch)):
        outs = llm.generate(
            group, [_params(opts, b * batch + i) for i in range(len(group))], use_tqdm=False
        )
        timed.append(
            [
                Request(o.metrics.ttft_s, o.metrics.e2e_s, len(o.token_ids), list(o.token_ids))
                for o in outs
            ]
        )
    return cell(timed, time.perf_counter() - started)


def _warm_up(llm, prompt: str, batch: int) -> None:
    from ssd_engine import SamplingParams

    llm.generate(
        [prompt] * batch,
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        use_tqdm=False,
    )


def _reset_counters(llm) -> None:
    """Fresh speculation counters, so a cell's acceptance and hit rates are its own."""
    engine = llm.engine
    if engine.speculator is not None:
        engine.spec_metrics.reset()
    if hasattr(engine.speculator, "metrics"):
        engine.speculator.metrics.reset()


def _cells(
    llm,
    opts,
    prompt_sets: dict,
    mode: str,
    progress,
    k: int | None = None,
    ran: str | None = None,
    tags: dict | None = None,
) -> list[dict]:
    """Every batch size x prompt set of one engine. `mode` names the rows; `ran` is the mode the
    engine runs (ar / sd / ssd; `auto` picks one), which decides the counters a row gets; `tags`
    go into every row (the draft's format, auto's choice)."""
    ran = ran or mode
    rows = []
    for batch in opts.batch:
        _reset_counters(llm)
        _warm_up(llm, next(iter(prompt_sets.values()))[0], batch)
        for name, prompts in prompt_sets.items():
            _reset_counters(llm)
            label = f"{mode}{f' K={k}' if k else ''} b={batch} {name}"
            progress("measuring", label)
            row = {
                "mode": mode,
                "set": name,
                "batch": batch,
                "k": k,
                **(tags or {}),
                **measure(llm, opts, prompts, batch),
            }
            if ran in ("sd", "ssd"):
                row.update(_spec_counters(llm, ran, k))
            rows.append(row)
            progress("done", label)
    return rows


def _spec_counters(llm, ran: str, k: int | None) -> dict:
    spec = llm.speculation_metrics()
    if ran == "sd" and k is not None and spec["drafted"] != k * spec["rounds"]:
        raise RuntimeError(
            f"K={k} not honoured: {spec['drafted']} drafts in {spec['rounds']} rounds"
        )
    counters = {key: spec.get(key) for key in SPEC_KEYS}
    if ran == "ssd":
        counters["ssd"] = {key: spec.get(key) for key in SSD_KEYS}
    return counters


def _draft_tag(llm) -> dict:
    """The draft's weight format the engine runs (None: no draft, e.g. auto chose AR)."""
    fmt = llm.engine.plan.draft_format
    return {"draft_format": fmt.name if fmt is not None else None}


def _engine_options(opts, with_draft: bool) -> dict:
    options = dict(
        num_threads=opts.threads,
        max_num_seqs=max(opts.batch),
        enable_prefix_caching=False,
        device=opts.device,
        dtype=opts.dtype,
        tensor_parallel_size=opts.tp,
        load_format=opts.load_format,
        tokenizer=opts.tokenizer,
        target_dtype=opts.target_dtype,
    )
    if opts.device == "cpu":
        options["cpu_weight_layout"] = opts.layout
        if opts.tp > 1 or with_draft:
            options["cpu_cores"] = opts.placement(with_draft)
    return options


def _ssd_options(opts) -> dict:
    """The SSD knobs the user set (unset: the engine's defaults)."""
    chosen = (
        ("ssd_fanout", opts.fanout),
        ("ssd_fallback", opts.fallback),
        ("ssd_budget", opts.budget),
        ("ssd_draft_host", opts.draft_host),
    )
    return {key: value for key, value in chosen if value is not None}


def _draft_options(opts, lookups: bool = False) -> dict:
    """What every engine with a draft takes: its format and, when set, the synthetic rates (the hit
    rate only where SSD may run: `lookups`)."""
    from ssd_engine.testing import Synthetic

    synthetic = Synthetic(opts.synthetic_acceptance, opts.synthetic_hit if lookups else None)
    return {
        "draft_dtype": opts.draft_dtype,
        "synthetic": synthetic if synthetic != Synthetic() else None,
    }


def probe_sizes(opts) -> list[int]:
    """Target forward sizes the cost probes time: 1, 2, 4, 8 rows, every verification (K + 1), and
    per batch size b its decode step (b rows) and verification (b (K + 1) rows)."""
    sizes = {1, 2, 4, 8} | {k + 1 for k in opts.k}
    return sorted(
        sizes | {b for b in opts.batch} | {b * (k + 1) for b in opts.batch for k in opts.k}
    )


def _wide(opts):
    """The options with the target's and the draft's cores as one set, for the modes that are not
    split across them (ar-all, sd-all): the honest baseline for SSD, which uses both sets."""
    wide = copy.copy(opts)
    wide.cores = set(opts.cores) | set(opts.draft_cores)
    wide.threads = max(len(wide.cores) // opts.tp, 1)  # every core busy, none oversubscribed
    return wide


def run_ar(opts, prompt_sets: dict, progress, mode: str = "ar") -> dict:
    pin(opts.cores, opts.threads, opts.device)
    from ssd_engine import LLM

    with LLM(opts.model, speculative_mode="ar", **_engine_options(opts, False)) as llm:
        rows = _cells(llm, opts, prompt_sets, mode, progress, ran="ar")
        costs = {
            "target_forward_s": forward_costs(
                llm.engine.runner, llm.engine.block_manager, opts, probe_sizes(opts)
            )
        }
        peaks = engine_peaks(llm)
    return {"rows": rows, "costs": costs, "peaks": peaks}


def run_ar_all(opts, prompt_sets: dict, progress) -> dict:
    """`ar-all`: our AR on every core an SSD run uses (target's + draft's)."""
    return run_ar(_wide(opts), prompt_sets, progress, mode="ar-all")


def run_sd(opts, prompt_sets: dict, progress, mode: str = "sd") -> dict:
    pin(opts.cores, opts.threads, opts.device)
    from ssd_engine import LLM

    rows, costs, peaks = [], {}, {}
    for k in opts.k:
        # SD at this K drafts every step: the cell measures K's rounds (auto's cells measure the default)
        with LLM(
            opts.model,
            draft_model=opts.draft,
            speculative_mode="sd",
            num_speculative_tokens=k,
            speculation_per_step="off",
            **_draft_options(opts),
            **_engine_options(opts, False),
        ) as llm:
            rows += _cells(
                llm, opts, prompt_sets, mode, progress, k=k, ran="sd", tags=_draft_tag(llm)
            )
            if k == max(opts.k):  # its positions cover every verification width measured
                costs = _sd_costs(llm.engine, opts)
            peaks = merge_peaks(peaks, engine_peaks(llm))
    return {"rows": rows, "costs": costs, "peaks": peaks}


def _sd_costs(engine, opts) -> dict:
    """The SD engine's forwards timed alone. A helper, so no name holds the engine past its `with`:
    a closed engine still holds its models, and the next K's engine would load beside them (the
    process's peak memory then counted two engines: 4.76 GB where one takes 2.87)."""
    draft = forward_costs(
        engine.speculator.runner, engine.speculator.blocks, opts, sorted({1} | set(opts.batch))
    )
    return {
        "target_forward_s": forward_costs(
            engine.runner, engine.block_manager, opts, sorted({1} | {n + 1 for n in opts.k})
        ),
        "draft_step_s": draft.get(1),
        "draft_forward_s": draft,
    }


def run_sd_all(opts, prompt_sets: dict, progress) -> dict:
    """`sd-all`: our SD, target and in-process draft together on every core an SSD run uses."""
    return run_sd(_wide(opts), prompt_sets, progress, mode="sd-all")


def run_ssd(opts, prompt_sets: dict, progress) -> dict:
    """The target (rank 0) is this process; the draft process gets its own cores / GPU. The engine
    pins each side to its core set (cpu_cores), so this process first may use all of them."""
    pin(set(opts.cores) | set(opts.draft_cores), opts.threads, opts.device)
    from ssd_engine import LLM

    rows, peaks = [], {}
    for k in opts.k:
        with LLM(
            opts.model,
            draft_model=opts.draft,
            speculative_mode="ssd",
            num_speculative_tokens=k,
            **_draft_options(opts, lookups=True),
            **_engine_options(opts, True),
            **_ssd_options(opts),
        ) as llm:
            rows += _cells(
                llm, opts, prompt_sets, "ssd", progress, k=k, ran="ssd", tags=_draft_tag(llm)
            )
            peaks = merge_peaks(peaks, engine_peaks(llm))
    return {"rows": rows, "costs": {}, "peaks": peaks}


def auto_tags(llm) -> tuple[str, int | None, dict]:
    """(the mode an `auto` engine runs, its K, the row tags), from the engine's plan."""
    plan = llm.engine.plan
    choice, ran = plan.choice, plan.mode
    k = plan.config.speculative.k if ran in ("sd", "ssd") else None
    predicted = dict(choice.predicted_tok_s) if choice is not None else None
    return (
        ran,
        k,
        {**_draft_tag(llm), "chosen_mode": ran, "chosen_k": k, "predicted_tok_s": predicted},
    )


def run_auto(opts, prompt_sets: dict, progress) -> dict:
    """`auto`: the engine predicts AR, SD and SSD on every core (the target's sets, then the draft's,
    so it can split them for SSD), runs the fastest with its own K and threads: one engine, no K sweep."""
    every = set(opts.cores) | set(opts.draft_cores)
    pin(every, len(every), opts.device)
    from ssd_engine import LLM

    options = {
        **_engine_options(opts, True),
        "num_threads": None,
    }  # the engine sizes each side's threads
    with LLM(
        opts.model,
        draft_model=opts.draft,
        speculative_mode="auto",
        **_draft_options(opts, lookups=True),
        **options,
        **_ssd_options(opts),
    ) as llm:
        ran, k, tags = auto_tags(llm)
        rows = _cells(llm, opts, prompt_sets, "auto", progress, k=k, ran=ran, tags=tags)
        choice = llm.engine.plan.choice
        peaks = engine_peaks(llm)
    return {
        "rows": rows,
        "costs": {},
        "peaks": peaks,
        "mode_choice": choice.describe() if choice else None,
    }


def forward_costs(runner, blocks, opts, sizes: list[int]) -> dict[int, float]:
    """Seconds for one forward of n new tokens after an `opts.prefix`-token prefix, best of `opts.reps`."""
    return best_of(runner, blocks, opts.prefix, sizes, opts.reps)


RUNNERS = {
    "ar": run_ar,
    "ar-all": run_ar_all,
    "sd": run_sd,
    "sd-all": run_sd_all,
    "ssd": run_ssd,
    "auto": run_auto,
}
