"""Serving under load: our OpenAI server in each mode against llama.cpp's `llama-server` on the same
GGUF and cores, driven by guidellm (the vLLM project's load generator).

    pip install guidellm==0.8.1        # its own venv is fine: pass --guidellm VENV/bin/guidellm
    python benchmarks/serve_bench.py --llama-server PATH/llama-server      # ar, auto, llama.cpp
    python benchmarks/serve_bench.py --servers ar,auto --concurrency 1,4 --prompt-tokens 128 --output-tokens 32

Why guidellm: it runs offline (synthetic prompts of a set token count, built with the target's own
tokenizer folder, or `--prompts humaneval`: windows of HumanEval's prompts from a JSON-lines file), speaks OpenAI HTTP with streaming usage, has concurrency and Poisson profiles, and
writes every percentile to JSON; aiperf and inference-perf were not needed for anything it lacks.
Only the glue is ours: start each server pinned to --cores (ours: `python -m ssd_engine.serve --mode
M`, `auto+off` adding `--speculation-per-step off` (SD drafting every step); llama.cpp: `llama-server` with one slot per
client, `--no-repack` on AMX hosts, whose repacked path dies there), run guidellm on the same cores
(a user's client on one machine) for each prompt length: a concurrency sweep (c streams, max(2c, MIN_REQUESTS)
requests a level) and a Poisson sweep (--rates requests/s, --poisson-requests each); each level draws fresh
prompts (its own seed), so no server meets a prompt twice. Greedy (temperature 0), EOS ignored.
Per level: output tok/s, TTFT, TPOT, inter-token latency and request latency p50 / p99. Writes
DATE-serve[-TAG].md, .json and .png under --out, the CPU named.
"""

import argparse
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

from suite.dated_report import (
    REPO,
    add_output_flags,
    core_list,
    header,
    pinned,
    run_facts,
    write_dated_result,
)
from suite.server_process import free_port, interrupt

NAME = "m"  # the model name every server answers to
METRICS = {
    "ttft_ms": "time_to_first_token_ms",
    "tpot_ms": "time_per_output_token_ms",
    "itl_ms": "inter_token_latency_ms",
    "latency_s": "request_latency",
}


def _csv(text: str, cast=str) -> list:
    return [cast(x) for x in text.split(",") if x.strip()]


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python benchmarks/serve_bench.py", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--servers",
        default="ar,auto,llamacpp",
        help="ar, sd, ssd, auto, MODE+POLICY (ours, in that mode; +off: SD drafts every step) and llamacpp, comma-separated",
    )
    p.add_argument(
        "--model", default=None, help="target folder or GGUF (default: the built-in pair's)"
    )
    p.add_argument(
        "--draft",
        default=None,
        help="draft for our speculative modes (default: the built-in pair's)",
    )
    p.add_argument(
        "--llama-server", default=shutil.which("llama-server"), help="the llama-server binary"
    )
    p.add_argument("--guidellm", default=shutil.which("guidellm"), help="the guidellm command")
    p.add_argument("--concurrency", default="1,4,8,16", help="concurrent streams per level")
    p.add_argument(
        "--rates", default="", help="Poisson request rates per second (none: no Poisson sweep)"
    )
    p.add_argument("--poisson-requests", type=int, default=8, help="requests per Poisson level")
    p.add_argument(
        "--prompt-tokens", default="128,450", help="prompt lengths in tokens, one sweep each"
    )
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument(
        "--prompts",
        default="synthetic",
        choices=["synthetic", "humaneval"],
        help="guidellm's synthetic text, or windows of HumanEval's prompts (code: what the built-in "
        "coder pair drafts well) of --prompt-tokens tokens, fresh ones each level",
    )
    add_output_flags(p, "cores of each server and the client (default: all visible)")
    a = p.parse_args(argv)
    a.servers, a.concurrency, a.rates = (
        _csv(a.servers),
        _csv(a.concurrency, int),
        _csv(a.rates, float),
    )
    a.prompt_tokens = _csv(a.prompt_tokens, int)
    # in the order given (taskset's list); none given: every core this process may use
    a.cores = _csv(a.cores, int) if a.cores else core_list(None)
    if "llamacpp" in a.servers and not a.llama_server:
        p.error(
            "llamacpp needs --llama-server PATH (built from llama-cpp-python's source, --target llama-server)"
        )
    if not a.guidellm:
        p.error("guidellm is not installed: pip install guidellm==0.8.1 (or pass --guidellm PATH)")
    return a


MIN_REQUESTS = 6  # a low-concurrency level of 2c requests is dominated by one request's noise


def levels(a) -> list[tuple[str, str, int]]:
    """(label, guidellm profile, requests) of every level of one sweep."""
    return [
        (f"concurrent@{c}", f"kind=concurrent,streams={c}", max(2 * c, MIN_REQUESTS))
        for c in a.concurrency
    ] + [(f"poisson@{r:g}", f"kind=poisson,rate={r}", a.poisson_requests) for r in a.rates]


def server_argv(a, server: str, port: int) -> list[str]:
    pin = pinned(a.cores)
    if server == "llamacpp":
        from llamacpp_mode import gguf_for

        from ssd_engine.utils.machine import cpu_flags

        slots = max(a.concurrency + [a.poisson_requests if a.rates else 1])
        context = slots * (max(a.prompt_tokens) + a.output_tokens + 64)
        return (
            pin
            + [
                a.llama_server,
                "-m",
                gguf_for(a.model),
                "--port",
                str(port),
                "--host",
                "127.0.0.1",
                "-t",
                str(len(a.cores)),
                "-np",
                str(slots),
                "-c",
                str(context),
                "--alias",
                NAME,
            ]
            + (["--no-repack"] if "amx_tile" in cpu_flags() else [])
        )  # AMX: its repacked path dies there
    mode, _, policy = server.partition("+")
    argv = pin + [
        sys.executable,
        "-m",
        "ssd_engine.serve",
        "--port",
        str(port),
        "--served-model-name",
        NAME,
        "--speculative-mode",
        mode,
        "--max-num-seqs",
        str(max(a.concurrency + [16])),
    ]
    argv += ["--model", a.model] if a.model else []
    argv += ["--draft-model", a.draft] if a.draft and mode != "ar" else []
    return argv + (["--speculation-per-step", policy] if policy else [])


def start(a, server: str) -> tuple[subprocess.Popen, int]:
    """The server running and answering /health (a model loads first: minutes at most)."""
    port = free_port()
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(
        server_argv(a, server, port),
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=REPO,
        env={k: v for k, v in os.environ.items() if k != "SSD_ENGINE_API_KEY"},
    )
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"{server} ended before serving: {log.read()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                if response.status == 200:
                    return proc, port
        except OSError:
            pass
        time.sleep(1)
    interrupt(proc)
    raise RuntimeError(f"{server} did not answer /health in 600 s")


def measure(
    a, port: int, tokenizer: str, prompt_tokens: int, profile: str, requests: int, seed: int
) -> dict:
    """One guidellm level against the server on `port`: its summary row."""
    with tempfile.TemporaryDirectory() as folder:
        report = os.path.join(folder, "report.json")
        argv = pinned(a.cores) + [
            a.guidellm,
            "run",
            # JSON: guidellm's key=value form would split a body at its commas; guidellm itself sets
            # max_tokens and ignore_eos from each request's output tokens
            "--backend",
            json.dumps(
                {
                    "kind": "openai_http",
                    "target": f"http://127.0.0.1:{port}",
                    "model": NAME,
                    "request_format": "/v1/completions",
                    "extras": {"body": {"temperature": 0}},
                }
            ),
            "--profile",
            profile,
            "--constraint",
            f"kind=max_requests,count={requests}",
            "--data",
            data_source(a, folder, tokenizer, prompt_tokens, requests, seed),
            "--tokenizer",
            f"kind=huggingface_auto,model={tokenizer}",
            "--seed",
            f"kind=static,value={seed}",
            "--output",
            f"kind=json,path={report}",
            "--disable-console",
        ]
        subprocess.run(
            argv,
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
        )
        with open(report) as f:
            return summarize(json.load(f)["benchmarks"][0])


@functools.cache
def _humaneval(tokenizer: str):
    """The target's tokenizer and HumanEval's prompts joined, as its token ids: read once a run."""
    from prompt_sets import load_prompt_set
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    return tok, tok("".join(load_prompt_set("humaneval", 164)))["input_ids"]


def data_source(
    a, folder: str, tokenizer: str, prompt_tokens: int, requests: int, seed: int
) -> str:
    """guidellm's --data for one level: synthetic text, or a JSON-lines file of `requests` HumanEval
    windows of `prompt_tokens` tokens: level L of a sweep (seed % 1000) takes windows L * 33 on, so
    levels share no prompt where the prompt set holds enough windows (each starts a quarter of a prompt
    after the last, so no two share a first block), and every server meets the same ones."""
    if a.prompts == "synthetic":
        return f"kind=synthetic_text,prompt_tokens={prompt_tokens},output_tokens={a.output_tokens}"
    tok, ids = _humaneval(tokenizer)
    stride = max(1, prompt_tokens // 4)
    starts = list(range(0, len(ids) - prompt_tokens, stride))
    first = (seed % 1000) * 33
    path = os.path.join(folder, "prompts.jsonl")
    with open(path, "w") as f:
        for i in range(requests):
            start = starts[(first + i) % len(starts)]
            f.write(
                json.dumps(
                    {
                        "prompt": tok.decode(ids[start : start + prompt_tokens]),
                        "output_tokens_count": a.output_tokens,
                    }
                )
                + "\n"
            )
    return f"kind=json_file,path={path}"


def summarize(benchmark: dict) -> dict:
    """guidellm's benchmark record -> output tok/s, requests, and p50 / p99 of each latency."""
    metrics = benchmark["metrics"]
    totals = metrics["request_totals"]
    row = {
        "output_tok_s": metrics["output_tokens_per_second"]["successful"]["mean"],
        "requests_s": metrics["requests_per_second"]["successful"]["mean"],
        "successful": totals["successful"],
        "errored": totals["errored"],
        "prompt_tokens": metrics["prompt_token_count"]["successful"]["mean"],
        "output_tokens": metrics["output_token_count"]["successful"]["mean"],
    }
    for short, key in METRICS.items():
        percentiles = metrics[key]["successful"]["percentiles"]
        row[short] = {"p50": percentiles["p50"], "p99": percentiles["p99"]}
    return row


def markdown(result: dict) -> str:
    servers = result["servers"]
    lines = header(
        f"Serving under load: {', '.join(servers)} ({result['date']})",
        result["machine"],
        result["command"],
        f"Cores: {result['cores']} (every server and the client)",
        f"Model: {result['model']}; greedy, {result['output_tokens']} output tokens, EOS ignored; "
        f"guidellm 0.8.1, {result.get('prompts', 'synthetic')} prompts",
    )
    for length, by_level in result["cells"].items():
        lines += [
            f"## {length}-token prompts",
            "",
            "| level | "
            + " | ".join(f"{s} tok/s" for s in servers)
            + " | "
            + " | ".join(f"{s} TTFT p50/p99 s" for s in servers)
            + " | "
            + " | ".join(f"{s} ITL p50/p99 ms" for s in servers)
            + " |",
            "|---" * (1 + 3 * len(servers)) + "|",
        ]
        for level, row in by_level.items():
            cells = [row.get(s) for s in servers]
            lines.append(
                f"| {level} | "
                + " | ".join(f"{c['output_tok_s']:.2f}" if c else "-" for c in cells)
                + " | "
                + " | ".join(
                    f"{c['ttft_ms']['p50'] / 1e3:.1f} / {c['ttft_ms']['p99'] / 1e3:.1f}"
                    if c
                    else "-"
                    for c in cells
                )
                + " | "
                + " | ".join(
                    f"{c['itl_ms']['p50']:.0f} / {c['itl_ms']['p99']:.0f}" if c else "-"
                    for c in cells
                )
                + " |"
            )
        lines.append("")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = list(result["cells"])
    fig, axes = plt.subplots(1, len(lengths), figsize=(5 * len(lengths), 4), squeeze=False)
    for ax, length in zip(axes[0], lengths):
        concurrent = {
            lv: row for lv, row in result["cells"][length].items() if lv.startswith("concurrent@")
        }
        xs = [int(lv.split("@")[1]) for lv in concurrent]
        for server in result["servers"]:
            ax.plot(
                xs,
                [
                    row.get(server, {}).get("output_tok_s", float("nan"))
                    for row in concurrent.values()
                ],
                marker="o",
                label=server,
            )
        ax.set(title=f"{length}-token prompts", xlabel="concurrent clients", ylabel="output tok/s")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    a = parse(argv)
    from ssd_engine.models.model_paths import resolve_model_arg

    tokenizer = resolve_model_arg(a.model)  # the target's folder: its tokenizer builds the prompts
    cells: dict = {str(length): {} for length in a.prompt_tokens}
    for server in a.servers:
        proc, port = start(a, server)
        try:
            for length in a.prompt_tokens:
                for seed, (label, profile, requests) in enumerate(levels(a), start=1000 * length):
                    row = measure(a, port, tokenizer, length, profile, requests, seed)
                    cells[str(length)].setdefault(label, {})[server] = row
                    print(
                        f"{server} {length} tokens {label}: {row['output_tok_s']:.2f} tok/s, TTFT p50 "
                        f"{row['ttft_ms']['p50'] / 1e3:.1f} s, errors {row['errored']}",
                        file=sys.stderr,
                        flush=True,
                    )
        finally:
            interrupt(proc)
    result = {
        **run_facts("serve_bench.py", argv, a),
        "servers": a.servers,
        "output_tokens": a.output_tokens,
        "prompts": a.prompts,
        "cells": cells,
    }
    text = markdown(result)
    base = write_dated_result(a.out, "serve", text, result, a.tag)
    plot(result, base + ".png")
    print(text)
    print(f"wrote {base}.md, .json, .png", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
