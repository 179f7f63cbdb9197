"""A user's request end to end: a prompt of L tokens plus an answer of N, ours against llama.cpp.

    python benchmarks/bench_request.py                                   # built-in pair, L = 128, 512, 2048, N = 128
    python benchmarks/bench_request.py --runners ar,auto,llamacpp --lengths 512 --new-tokens 64
    python benchmarks/bench_request.py --runners ar:gguf-int8,llamacpp   # a runner in another target format
    python benchmarks/bench_request.py --runners auto,auto/draft_vocab_size=32768   # a runner with an engine option

Each prompt is L token ids of real code (HumanEval prompts joined, the last L tokens of them), the same
ids for every runner. A runner is one of our modes (`ar`, `sd`, `ssd`, `auto`: the default), optionally
`:FORMAT` for a target_dtype and `/OPTION=VALUE` for any other engine option, or `llamacpp` (llama-cpp-python on the same GGUF file, `pip install
"ssd_engine[llamacpp]"`, as bench.py's llamacpp mode runs it). Each runs in a child process of its own on the same cores,
greedy, EOS ignored, one request at a time after a warm-up one, and reports time to first token (TTFT:
the prompt's prefill and the first token), the decode rate after it, and the request's whole latency.
Writes benchmarks/results/DATE-request[-TAG].md, .json and -latency.png (each request's latency, split
into TTFT and decode), with the CPU named.
"""

import argparse
import json
import sys

from suite.dated_report import (
    BENCHMARKS,
    add_output_flags,
    child_result,
    core_list,
    header,
    pinned,
    run_facts,
    write_dated_result,
)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python benchmarks/bench_request.py", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--runners",
        default="ar,auto,llamacpp",
        help="ours: ar, sd, ssd, auto (optionally MODE:TARGET_DTYPE, then /OPTION=VALUE ...); and llamacpp",
    )
    p.add_argument("--lengths", default="128,512,2048", help="prompt lengths in tokens")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument(
        "--model", default=None, help="target folder or GGUF file (default: the built-in pair's)"
    )
    p.add_argument(
        "--draft", default=None, help="draft for sd / ssd / auto (default: the built-in pair's)"
    )
    add_output_flags(p, "cores of every runner (default: all visible)")
    a = p.parse_args(argv)
    a.runners = [r.strip() for r in a.runners.split(",") if r.strip()]
    a.lengths = [int(x) for x in a.lengths.split(",") if x.strip()]
    a.cores = core_list(a.cores)
    for runner in a.runners:
        try:
            split_runner(runner)
        except ValueError:
            p.error(
                f"unknown runner {runner!r}: ar, sd, ssd, auto (each optionally :TARGET_DTYPE, then "
                "/OPTION=VALUE ...) or llamacpp"
            )
    if a.new_tokens < 2 or not a.lengths or min(a.lengths) < 1:
        p.error("--new-tokens >= 2 and positive --lengths are needed")
    return a


def prompt_ids(lengths: list[int], model: str | None) -> dict[int, list[int]]:
    """L token ids of real code per length: HumanEval prompts joined, their last L tokens."""
    from prompt_sets import load_prompt_set

    from ssd_engine.models.model_paths import resolve_model_arg
    from ssd_engine.models.tokenizer_source import load_tokenizer

    tokenizer = load_tokenizer(resolve_model_arg(model), None, "auto", 0)
    ids: list[int] = []
    for text in load_prompt_set("humaneval", 164):
        ids += tokenizer.encode(text)
        if len(ids) >= max(lengths):
            break
    if len(ids) < max(lengths):
        raise SystemExit(
            f"error: HumanEval holds {len(ids)} tokens, fewer than --lengths {max(lengths)}"
        )
    return {n: ids[-n:] for n in lengths}


OURS = """
import json, sys
from ssd_engine import LLM, SamplingParams
spec = json.loads(sys.argv[1])
params = SamplingParams(temperature=0.0, max_tokens=spec["new_tokens"], ignore_eos=True)
with LLM(**spec["options"]) as llm:
    llm.generate([spec["prompts"][0][:16]], params, use_tqdm=False)  # warm-up
    rows = []
    for ids in spec["prompts"]:
        m = llm.generate([ids], params, use_tqdm=False)[0].metrics
        rows.append({"ttft_s": m.ttft_s, "latency_s": m.e2e_s, "decode_tok_s": m.decode_tokens_per_s})
    rows.append({"mode": llm.engine.plan.mode, "k": llm.engine.k})
print("RESULT " + json.dumps(rows))
"""

LLAMACPP = """
import json, os, sys
spec = json.loads(sys.argv[1])
sys.path.insert(0, spec["benchmarks"])
from llamacpp_mode import generate, load_llama  # bench.py's llama.cpp request: greedy, EOS ignored, timed as ours
threads = len(os.sched_getaffinity(0))
model = load_llama(model_path=spec["gguf"], n_ctx=max(map(len, spec["prompts"])) + spec["new_tokens"] + 8,
                   n_threads=threads, n_threads_batch=threads, verbose=False)
generate(model, spec["prompts"][0][:16], 4, 0.0)  # warm-up
rows = []
for ids in spec["prompts"]:
    ttft, latency, out = generate(model, ids, spec["new_tokens"], 0.0)
    rows.append({"ttft_s": ttft, "latency_s": latency, "decode_tok_s": (len(out) - 1) / (latency - ttft)})
print("RESULT " + json.dumps(rows + [{"mode": "llama.cpp"}]))
"""


def split_runner(runner: str) -> tuple[str, str, dict]:
    """`MODE[:TARGET_DTYPE][/OPTION=VALUE ...]` -> (mode, target dtype or "", engine options, each
    value read as JSON where it parses: numbers, true, null); ValueError where it is none of these."""
    head, *extras = runner.split("/")
    mode, _, fmt = head.partition(":")
    if (
        mode not in ("ar", "sd", "ssd", "auto", "llamacpp")
        or (mode == "llamacpp" and runner != mode)
        or any("=" not in extra for extra in extras)
    ):
        raise ValueError(runner)
    return (
        mode,
        fmt,
        {key: _json_or_text(value) for key, _, value in (extra.partition("=") for extra in extras)},
    )


def run_child(a, runner: str, prompts: list[list[int]]) -> tuple[list[dict], dict]:
    mode, fmt, extras = split_runner(runner)
    spec = {"prompts": prompts, "new_tokens": a.new_tokens}
    if mode == "llamacpp":
        from llamacpp_mode import gguf_for, require_llama_cpp

        require_llama_cpp()
        spec["gguf"], spec["benchmarks"], code = gguf_for(a.model), BENCHMARKS, LLAMACPP
    else:
        options = {"speculative_mode": mode, "enable_prefix_caching": False}
        if a.model:
            options["model"] = a.model
        if a.draft and mode != "ar":
            options["draft_model"] = a.draft
        if fmt:
            options["target_dtype"] = fmt
        options.update(extras)
        spec["options"], code = options, OURS
    rows, done = child_result(pinned(a.cores) + [sys.executable, "-c", code, json.dumps(spec)])
    if rows is None:
        raise SystemExit(
            f"error: runner {runner} failed: {done.stderr.strip().splitlines()[-1:] or done.returncode}"
        )
    *rows, chosen = rows
    return rows, chosen


def _json_or_text(value: str):
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def markdown(result: dict) -> str:
    lines = header(
        f"A request end to end: prompt + {result['new_tokens']}-token answer, {result['date']}",
        result["machine"],
        result["command"],
        f"Cores: {result['cores']} (every runner, in turn)",
        f"Model: {result['model']}; greedy, EOS ignored, one request at a time after a warm-up; "
        "prompts: the last L tokens of HumanEval's prompts joined, the same ids for every runner",
    ) + [
        "| prompt tokens | runner | ran as | TTFT s | decode tok/s | latency s | llama.cpp's latency / this |",
        "|---|---|---|---|---|---|---|",
    ]
    anchor = result["runs"].get("llamacpp")
    for index, length in enumerate(result["lengths"]):
        for runner, run in result["runs"].items():
            row = run["rows"][index]
            ratio = (
                f"{anchor['rows'][index]['latency_s'] / row['latency_s']:.2f}" if anchor else "-"
            )
            ran = run["chosen"]["mode"] + (
                f" K={run['chosen']['k']}" if run["chosen"].get("k") else ""
            )
            lines.append(
                f"| {length} | {runner} | {ran} | {row['ttft_s']:.2f} | {row['decode_tok_s']:.2f} | "
                f"{row['latency_s']:.2f} | {ratio} |"
            )
    lines += [
        "",
        "Goal: the default (`auto`) >= 1.5x faster than llama.cpp end to end at a 512-token prompt and a "
        "128-token answer (the last column).",
    ]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runners, lengths = list(result["runs"]), result["lengths"]
    width = 0.8 / len(runners)
    fig, ax = plt.subplots(figsize=(2 + 2 * len(lengths), 4))
    for i, runner in enumerate(runners):
        rows = result["runs"][runner]["rows"]
        xs = [j + i * width for j in range(len(lengths))]
        ttft = [r["ttft_s"] for r in rows]
        ax.bar(xs, ttft, width, label=f"{runner}: TTFT", color=f"C{i}", alpha=0.5)
        ax.bar(
            xs,
            [r["latency_s"] - t for r, t in zip(rows, ttft)],
            width,
            bottom=ttft,
            label=f"{runner}: decode",
            color=f"C{i}",
        )
    ax.set_xticks(
        [j + width * (len(runners) - 1) / 2 for j in range(len(lengths))],
        [f"{n} tokens" for n in lengths],
    )
    ax.set_ylabel(f"request latency, s ({result['new_tokens']}-token answer)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    a = parse(argv)
    ids = prompt_ids(a.lengths, a.model)
    prompts = [ids[n] for n in a.lengths]
    runs = {}
    for runner in a.runners:
        rows, chosen = run_child(a, runner, prompts)
        runs[runner] = {"rows": rows, "chosen": chosen}
        print(
            f"{runner}: "
            + ", ".join(
                f"{n} tokens {r['latency_s']:.2f} s (TTFT {r['ttft_s']:.2f})"
                for n, r in zip(a.lengths, rows)
            ),
            file=sys.stderr,
            flush=True,
        )
    result = {
        **run_facts("bench_request.py", argv, a),
        "lengths": a.lengths,
        "new_tokens": a.new_tokens,
        "runs": runs,
    }
    text = markdown(result)
    print(text)
    base = write_dated_result(a.out, "request", text, result, a.tag)
    written = [base + ".md", base + ".json"]
    try:
        written.append(plot(result, base + "-latency.png"))
    except ImportError as error:
        print(f"no plot ({error}): pip install matplotlib", file=sys.stderr)
    print("wrote " + ", ".join(written), file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
