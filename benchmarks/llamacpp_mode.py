"""bench.py's llama.cpp anchor: modes `llamacpp` (on `ar`'s cores) and `llamacpp-all` (on `ar-all`'s:
the target's and the draft's). llama-cpp-python decodes the target's GGUF file from the very token
ids our tokenizer makes of the same prompts, for the same number of new tokens, greedy at
temperature 0, batch 1, in a spawned process of its own; timed like our modes (prefill apart from
decode) and compared token by token with our `ar`.

benchmarks/suite/ knows only our engine's and transformers' modes: bench.py takes these out of
--mode (split_argv), runs them in their places of every pass (run_modes) and appends their section
to the report (section_lines).
"""

import argparse
import copy
import importlib.util
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

MODES = ("llamacpp", "llamacpp-all")
INSTALL = 'pip install "ssd_engine[llamacpp]"'
WARM_UP_TOKENS = 8  # as many as our modes' warm-up generates


class LlamaCppError(ValueError):
    """A llama.cpp mode cannot run: bench.py prints it as one `error: ...` line."""


def split_argv(argv: list[str]) -> tuple[list[str], list[str], str | None]:
    """(bench.py's command line for suite/options.py, every mode in --mode's order, the --model value as
    given). The command line is unchanged without a llama.cpp mode; with one, --mode keeps only ours
    (`ar` when none: options.parse needs a mode, and bench.py then runs none of ours), because
    options.parse rejects modes it does not know and turns a GGUF --model into its converted folder."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--mode", default=None)
    pre.add_argument("--model", default=None)
    known, rest = pre.parse_known_args(argv)
    modes = [m.strip() for m in (known.mode or "").split(",") if m.strip()]
    if not any(m in MODES for m in modes):
        return list(argv), modes, known.model
    ours = [m for m in modes if m not in MODES]
    model = [] if known.model is None else ["--model", known.model]
    return rest + ["--mode", ",".join(ours or ["ar"])] + model, modes, known.model


def require_llama_cpp() -> None:
    if importlib.util.find_spec("llama_cpp") is None:  # found, not imported: that loads the library
        raise LlamaCppError(
            f"mode llamacpp needs llama-cpp-python, which is not installed: {INSTALL}"
        )


def load_llama(**options):
    """llama_cpp.Llama(**options); on an AMX host without llama.cpp's repacked weights, whose AMX path
    crashes there on batched matmuls (as llama-bench's `--repack 0` and llama-server's `--no-repack`)."""
    import llama_cpp
    from llama_cpp import llama_cpp as api

    from ssd_engine.utils.machine import cpu_flags

    if "amx_tile" in cpu_flags() and not getattr(api, "_repack_off", False):
        defaults = api.llama_model_default_params

        def without_repack():  # Llama.__init__ reads its model parameters from here
            params = defaults()
            params.use_extra_bufts = False
            return params

        api.llama_model_default_params, api._repack_off = without_repack, True
    return llama_cpp.Llama(**options)


def gguf_for(model: str | None) -> str:
    """The GGUF file llama.cpp loads for bench.py's --model value: a GGUF file itself, else the one
    the target's folder was converted from (the built-in target's joined into its folder, once: the
    file a gguf target reads too)."""
    from ssd_engine.models.gguf_files import is_gguf_file, source_gguf
    from ssd_engine.models.model_paths import resolve_model_arg

    if model is not None and is_gguf_file(model):
        return os.path.abspath(model)
    try:
        return str(source_gguf(resolve_model_arg(model)))
    except ValueError:
        raise LlamaCppError(
            f"mode llamacpp needs the target as a GGUF file: {model} is not one and records none in "
            f"its marker; pass --model FILE.gguf"
        ) from None


def check(opts) -> None:
    """What llama.cpp cannot run like our modes: refused before anything loads."""
    if opts.device != "cpu":
        raise LlamaCppError("mode llamacpp runs on CPU only (--device cpu)")
    if (
        opts.load_format != "auto"
        or opts.synthetic_acceptance is not None
        or opts.synthetic_hit is not None
    ):
        raise LlamaCppError(
            "mode llamacpp runs the real GGUF: --load-format dummy and --synthetic-* are our engine's"
        )


def placement(mode: str, opts) -> tuple[set[int], int]:
    """(cores, threads): `llamacpp` where `ar` runs, with every thread of ar's ranks together;
    `llamacpp-all` where `ar-all` runs (suite/ours.py's _wide), the same way."""
    from suite.ours import _wide

    where = _wide(opts) if mode == "llamacpp-all" else opts
    return set(where.cores), where.threads * where.tp


def placement_text(modes: list[str], opts) -> str:
    """What bench.py adds to its placement line for the llama.cpp modes that run ("" for none)."""
    parts = []
    for mode in (m for m in modes if m in MODES):
        cores, threads = placement(mode, opts)
        parts.append(f"{mode} on cores {sorted(cores)} with {threads} thread(s)")
    return "; " + ", ".join(parts) if parts else ""


def tokenize(opts, prompt_sets: dict[str, list[str]]) -> dict[str, list[list[int]]]:
    """The prompts as our engine encodes them (its tokenizer, its call), so both decode the same ids."""
    from ssd_engine.models.tokenizer_source import load_tokenizer

    tokenizer = load_tokenizer(opts.model, opts.tokenizer, opts.load_format, 0)
    return {name: [tokenizer.encode(p) for p in prompts] for name, prompts in prompt_sets.items()}


def run_modes(modes: list[str], opts, prompt_sets: dict, gguf: str | None) -> dict[str, dict]:
    """suite/isolate.py's run_modes, the llama.cpp modes taking their places in every pass's order."""
    from suite import isolate, passes

    if not any(m in MODES for m in modes):
        return isolate.run_modes(modes, opts, prompt_sets)
    ids = tokenize(opts, prompt_sets)
    one_pass = copy.copy(opts)
    one_pass.passes = 1
    per_pass: dict[str, list[dict]] = {mode: [] for mode in modes}
    for index in range(opts.passes):
        for mode in passes.order(modes, index):
            if mode in MODES:
                print(f"{mode}: measuring {gguf}", file=sys.stderr)
                # its own process, as each of our modes: memory and thread pools never mix
                with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
                    result = pool.submit(
                        measure, mode, opts, ids, gguf, *placement(mode, opts)
                    ).result()
            else:
                result = isolate.run_modes([mode], one_pass, prompt_sets)[mode]
            per_pass[mode].append(result)
    return {mode: passes.merge(results) for mode, results in per_pass.items()}


def measure(
    mode: str, opts, ids: dict[str, list[list[int]]], gguf: str, cores: set[int], threads: int
) -> dict:
    """One llama.cpp mode's cells, one per prompt set, batch 1 (llama-cpp-python's Llama decodes one sequence)."""
    from suite.measure import Request, cell, own_peak_gb

    os.sched_setaffinity(0, cores)  # before llama.cpp starts its threads: they inherit the mask
    import llama_cpp

    longest = max(len(p) for prompts in ids.values() for p in prompts)
    llm = load_llama(
        model_path=gguf,
        n_threads=threads,
        n_threads_batch=threads,
        n_ctx=longest + max(opts.new_tokens, WARM_UP_TOKENS),
        verbose=False,
    )
    generate(llm, next(iter(ids.values()))[0], WARM_UP_TOKENS, opts.temperature)
    rows = []
    for name, prompts in ids.items():
        started, timed = time.perf_counter(), []
        for prompt in prompts:
            ttft, latency, out = generate(llm, prompt, opts.new_tokens, opts.temperature)
            timed.append([Request(ttft, latency, len(out), out)])
        rows.append(
            {
                "mode": mode,
                "set": name,
                "batch": 1,
                "k": None,
                **cell(timed, time.perf_counter() - started),
            }
        )
    return {
        "rows": rows,
        "costs": {},
        "peaks": {"engine": own_peak_gb()},
        "gguf": gguf,
        "llama_cpp_version": llama_cpp.__version__,
        "cores": sorted(cores),
        "threads": threads,
    }


def generate(
    llm, prompt: list[int], new_tokens: int, temperature: float
) -> tuple[float, float, list[int]]:
    """(seconds to the first new token, to the last, the tokens): EOS does not stop generate(), as
    ignore_eos does not stop our modes."""
    # else generate() reuses the KV of a prefix shared with the previous prompt; ours runs without prefix caching
    llm.reset()
    # greedy at temperature 0; else plain temperature sampling (llama.cpp's top_k 0, top_p 1, min_p 0 are off)
    sampling = dict(
        temp=temperature,
        top_k=1 if temperature == 0 else 0,
        top_p=1.0,
        min_p=0.0,
        repeat_penalty=1.0,
    )
    out, begin, ttft = [], time.perf_counter(), 0.0
    for token in llm.generate(prompt, **sampling):
        if not out:
            ttft = time.perf_counter() - begin
        out.append(int(token))
        if len(out) == new_tokens:
            break
    return ttft, time.perf_counter() - begin, out


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """How far two sets of greedy outputs agree: tokens equal at the same position, identical outputs,
    and the mean count of tokens before an output's first difference (after it the two continue from
    different text, so later positions agree only by chance)."""
    pairs = list(zip(ours, theirs))
    firsts = [
        next((i for i, (a, b) in enumerate(zip(o, t)) if a != b), min(len(o), len(t)))
        for o, t in pairs
    ]
    return {
        "same": sum(a == b for o, t in pairs for a, b in zip(o, t)),
        "tokens": sum(min(len(o), len(t)) for o, t in pairs),
        "identical": sum(o == t for o, t in pairs),
        "outputs": len(pairs),
        "before_first_difference": sum(firsts) / len(firsts) if firsts else None,
    }


def section_lines(raw: dict) -> list[str]:
    """The report's llama.cpp section: each llama.cpp mode against our AR on the same cores, and its
    tokens against our `ar`'s (else `ar-all`'s)."""
    from suite.report import rows_of

    ran = [m for m in MODES if m in raw["results"]]
    if not ran:
        return []
    first = raw["results"][ran[0]]
    lines = [
        f"## llama.cpp (llama-cpp-python {first.get('llama_cpp_version')}, `{first.get('gguf')}`)",
        "",
        "The target's GGUF decoded by llama.cpp from our tokenizer's ids of the same prompts, batch 1; decode "
        "tok/s as ours (prefill excluded). Same tokens: equal to our AR's at the same position; llama.cpp "
        "computes with quantized weights and activations, so greedy paths part sooner or later.",
        "",
        "| mode | cores | prompts | decode tok/s | ours on the same cores | ours / llama.cpp | same tokens "
        "| identical outputs | tokens before the first difference |",
        "|---" * 9 + "|",
    ]
    for mode in ran:
        ours_mode = mode.replace("llamacpp", "ar")
        ref_mode = next((m for m in ("ar", "ar-all") if rows_of(raw, m, batch=1)), None)
        for row in rows_of(raw, mode):
            mine = rows_of(raw, ours_mode, set=row["set"], batch=1)
            speed = mine[0]["decode_tok_s"] if mine else None
            ref = (
                rows_of(raw, ref_mode, set=row["set"], batch=1)
                if ref_mode and raw["temperature"] == 0
                else []
            )
            agree = agreement(ref[0]["outputs"], row["outputs"]) if ref else None
            vs_ours = "n/a | n/a"
            if speed and row["decode_tok_s"]:
                vs_ours = f"{speed:.2f} ({ours_mode}) | {speed / row['decode_tok_s']:.2f}x"
            same = (
                f"{agree['same']}/{agree['tokens']} {ref_mode} ({agree['same'] / agree['tokens']:.0%}) "
                f"| {agree['identical']}/{agree['outputs']} | {agree['before_first_difference']:.1f}"
                if agree and agree["tokens"]
                else "- | - | -"
            )
            lines.append(
                f"| {mode} | {raw['results'][mode].get('cores')} | {row['set']} | {row['decode_tok_s']:.2f} "
                f"| {vs_ours} | {same} |"
            )
    return lines + [""]
