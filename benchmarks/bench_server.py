"""One streamed request through the OpenAI server against the same request in-process, side by side.

    python benchmarks/bench_server.py                        # built-in pair, AR and the default mode
    python benchmarks/bench_server.py --mode ar --new-tokens 128 --repeats 3
    python benchmarks/bench_server.py --model SMOLLM2.gguf --mode ar --new-tokens 32   # a small smoke

For each mode: `in-process` is `LLM.generate` in a child process (what `python -m ssd_engine.generate`
runs; its RequestMetrics), `server` is `python -m ssd_engine.serve` in a child process with one client
here reading the SSE stream as it arrives (raw HTTP, no SDK: the client's own parsing is a few
microseconds a chunk). Both are pinned to the same cores (--cores); the client runs on them too, as a
user's would on one machine. Decode tok/s is the tokens after the first over the time after the
first, both sides (RequestMetrics' definition; the client counts tokens from vLLM's
continuous_usage_stats). Greedy, EOS ignored, the same prompt. Best of --repeats after a warm-up
request each. Writes benchmarks/results/DATE-server[-TAG].md and .json, with the CPU named.
"""

import argparse
import http.client
import json
import os
import re
import subprocess
import sys
import time

from suite.dated_report import (
    REPO,
    add_output_flags,
    child_result,
    core_list,
    header,
    pinned,
    run_facts,
    write_dated_result,
)
from suite.server_process import interrupt

PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python benchmarks/bench_server.py", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--model", default=None, help="target (default: the built-in pair's)")
    p.add_argument(
        "--draft", default=None, help="draft for sd / ssd / auto (default: the built-in pair's)"
    )
    p.add_argument(
        "--mode", default="ar,auto", help="speculative modes, comma-separated (auto: the default)"
    )
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument(
        "--repeats", type=int, default=2, help="timed requests per side (the best counts)"
    )
    p.add_argument("--prompt", default=PROMPT)
    add_output_flags(p, "cores for the engine process and the client (default: all visible)")
    a = p.parse_args(argv)
    a.mode = [m.strip() for m in a.mode.split(",") if m.strip()]
    a.cores = core_list(a.cores)
    if a.new_tokens < 2 or a.repeats < 1:
        p.error("--new-tokens >= 2 and --repeats >= 1 are needed")
    return a


def engine_flags(a, mode: str) -> list[str]:
    flags = ["--speculative-mode", mode]
    if a.model:
        flags += ["--model", a.model]
    if a.draft and mode != "ar":
        flags += ["--draft-model", a.draft]
    return flags


IN_PROCESS = """
import json, sys
from ssd_engine import LLM, SamplingParams
from ssd_engine.cli_args import ArgumentParser, add_engine_args, engine_options
parser = ArgumentParser()
add_engine_args(parser)
args = parser.parse_args(sys.argv[3:])
params = SamplingParams(temperature=0.0, max_tokens=int(sys.argv[2]), ignore_eos=True)
rates = []
with LLM(**engine_options(args)) as llm:
    for _ in range(1 + int(sys.argv[1])):
        metrics = llm.generate([PROMPT], params, use_tqdm=False)[0].metrics
        rates.append({"decode_tok_s": metrics.decode_tokens_per_s, "ttft_s": metrics.ttft_s})
print("RESULT " + json.dumps(rates[1:]))
"""


def run_in_process(a, mode: str) -> list[dict]:
    code = f"PROMPT = {a.prompt!r}\n" + IN_PROCESS
    argv = [sys.executable, "-c", code, str(a.repeats), str(a.new_tokens), *engine_flags(a, mode)]
    rates, done = child_result(pinned(a.cores) + argv)
    if rates is None:
        raise RuntimeError(f"in-process run failed: {done.stderr[-2000:]}")
    return rates


def stream_once(port: int, a) -> dict:
    """One streamed completion: time to the first token and the decode rate the client sees."""
    body = json.dumps(
        {
            "model": "m",
            "prompt": a.prompt,
            "max_tokens": a.new_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
    )
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    begin = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    first_at, first_tokens, tokens, end = None, 0, 0, begin
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        usage = json.loads(line[6:]).get("usage") or {}
        count = usage.get("completion_tokens", tokens)
        if count > tokens:
            tokens, end = count, time.perf_counter()
            if first_at is None:
                first_at, first_tokens = end, tokens
    conn.close()
    if tokens != a.new_tokens or first_at is None or end <= first_at:
        raise RuntimeError(f"the server streamed {tokens} tokens, asked {a.new_tokens}")
    return {"decode_tok_s": (tokens - first_tokens) / (end - first_at), "ttft_s": first_at - begin}


def run_server(a, mode: str) -> list[dict]:
    serve = [sys.executable, "-m", "ssd_engine.serve", "--port", "0", "--served-model-name", "m"]
    argv = pinned(a.cores) + serve + engine_flags(a, mode)
    env = {k: v for k, v in os.environ.items() if k != "SSD_ENGINE_API_KEY"}
    proc = subprocess.Popen(
        argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, cwd=REPO, env=env
    )
    try:
        port, seen = None, []
        while port is None:
            line = proc.stderr.readline()
            if not line:
                raise RuntimeError("the server ended before listening: " + "".join(seen[-20:]))
            seen.append(line)
            if match := re.search(r"running on http://127\.0\.0\.1:(\d+)", line):
                port = int(match.group(1))
        os.sched_setaffinity(0, a.cores)  # the client on the engine's cores, as one machine's user
        return [stream_once(port, a) for _ in range(1 + a.repeats)][1:]
    finally:
        interrupt(proc)


def best(rates: list[dict]) -> dict:
    return max(rates, key=lambda r: r["decode_tok_s"])


def markdown(result: dict) -> str:
    lines = header(
        f"Server against in-process, one streamed request, {result['date']}",
        result["machine"],
        result["command"],
        f"Cores: {result['cores']} (engine process and client)",
        f"Model: {result['model']}; greedy, {result['new_tokens']} new tokens (EOS ignored), "
        f"best of {result['repeats']} after a warm-up",
    ) + [
        "| mode | in-process decode tok/s | server decode tok/s (client) | server / in-process | "
        "in-process TTFT s | server TTFT s |",
        "|---|---|---|---|---|---|",
    ]
    for mode, row in result["modes"].items():
        ours, served = row["in_process"], row["server"]
        lines.append(
            f"| {mode} | {ours['decode_tok_s']:.2f} | {served['decode_tok_s']:.2f} | "
            f"{served['decode_tok_s'] / ours['decode_tok_s']:.2f} | {ours['ttft_s']:.2f} | {served['ttft_s']:.2f} |"
        )
    lines += ["", "Goal: server / in-process >= 0.95."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    a = parse(argv)
    modes = {}
    for mode in a.mode:
        in_process, server = best(run_in_process(a, mode)), best(run_server(a, mode))
        modes[mode] = {"in_process": in_process, "server": server}
        print(
            f"{mode}: in-process {in_process['decode_tok_s']:.2f} tok/s, server {server['decode_tok_s']:.2f} tok/s",
            file=sys.stderr,
            flush=True,
        )
    result = {
        **run_facts("bench_server.py", argv, a),
        "new_tokens": a.new_tokens,
        "repeats": a.repeats,
        "modes": modes,
    }
    text = markdown(result)
    print(text)
    base = write_dated_result(a.out, "server", text, result, a.tag)
    print(f"wrote {base}.md, {base}.json", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
