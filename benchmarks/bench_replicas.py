"""Aggregate throughput of engine replicas (`serve --data-parallel-size N`) against one engine.

    python benchmarks/bench_replicas.py                       # built-in pair, AR, 8 and 16 clients
    python benchmarks/bench_replicas.py --model SMOLLM2.gguf --clients 8 --new-tokens 32   # a small smoke

Each layout is a `python -m ssd_engine.serve` started for it, measured, and stopped: one replica on
core 0; N replicas on cores 0..N-1, one core each (the issue's "each replica its own device");
one replica on all N cores; and N plain one-engine servers without Ray, one per core, the clients
split between them (what the cores give N engines with no Ray Serve in their path: the replicas'
gap to it is Ray's, its gap to N x one is the hardware's). At each client count, every client sends requests one after another
(greedy, EOS ignored, `--new-tokens` each, prompts varied so no prefix cache answers) for
`--seconds`; aggregate output tok/s is the tokens completed over the wall time, after one warm-up
request per client. Then the memory bandwidth the replicas share: a one-thread copy on core 0 alone,
and on cores 0..N-1 at once. Writes benchmarks/results/DATE-replicas[-TAG].md and .json, with the CPU named.
"""

import argparse
import concurrent.futures
import os
import subprocess
import sys
import time

from suite.dated_report import REPO, add_output_flags, header, write_dated_result
from suite.server_process import free_port, interrupt

PROMPT = 'def fibonacci_{i}(n):\n    """Return the n-th Fibonacci number, request {i}."""\n'


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python benchmarks/bench_replicas.py", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--model", default=None, help="target (default: the built-in pair's)")
    p.add_argument("--mode", default="ar", help="the engines' speculative mode")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--clients", default="8,16", help="concurrent clients, comma-separated")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--seconds", type=float, default=40.0, help="measured time per client count")
    add_output_flags(p)
    return p.parse_args(argv)


def _start(args, port: int, cores: str, replicas: int) -> subprocess.Popen:
    argv = [
        sys.executable,
        "-m",
        "ssd_engine.serve",
        "--port",
        str(port),
        "--served-model-name",
        "m",
        "--mode",
        args.mode,
        "--cpu-cores",
        cores,
        "--max-pending",
        "1024",
    ]
    argv += ["--model", args.model] if args.model else []
    argv += ["--data-parallel-size", str(replicas)] if replicas > 1 else []
    return subprocess.Popen(
        argv,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "SSD_ENGINE_PROGRESS": "0"},
    )


def _wait_ready(client, proc: subprocess.Popen, timeout_s: float = 600) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {proc.stderr.read()[-2000:]}")
        try:
            client.models.list()
            return time.monotonic() - started
        except Exception:
            time.sleep(1)
    raise RuntimeError("the server did not start")


def _load(servers: list, clients: int, args) -> dict:
    """`clients` clients back to back for args.seconds: completed output tokens over the wall time.
    Client c talks to servers[c % len(servers)] (one server: every client to it)."""

    def one(c: int, i: int) -> int:
        reply = servers[c % len(servers)].completions.create(
            model="m",
            prompt=PROMPT.format(i=i),
            max_tokens=args.new_tokens,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        return reply.usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        list(pool.map(one, range(clients), range(10_000, 10_000 + clients)))  # warm-up
        deadline, started = time.monotonic() + args.seconds, time.monotonic()

        def client_loop(c: int) -> tuple[int, int]:
            tokens = requests = 0
            while time.monotonic() < deadline:
                tokens += one(c, c * 1000 + requests)
                requests += 1
            return tokens, requests

        done = list(pool.map(client_loop, range(clients)))
        wall = time.monotonic() - started
    tokens, requests = sum(t for t, _ in done), sum(r for _, r in done)
    return {
        "clients": clients,
        "tok_s": tokens / wall,
        "requests": requests,
        "wall_s": wall,
        "mean_latency_s": wall * clients / max(requests, 1),
    }


COPY_CHILD = """
import sys, time, torch
torch.set_num_threads(1)
source = torch.empty(64 * 2**20 // 4); target = torch.empty_like(source)
target.copy_(source)
while time.time() < float(sys.argv[1]):
    time.sleep(0.001)
copies, started = 0, time.perf_counter()
while time.perf_counter() - started < 3.0:
    target.copy_(source); copies += 1
print(copies * 2 * source.nbytes / (time.perf_counter() - started) / 1e9)
"""


def copy_bandwidth(cores: list[int]) -> list[float]:
    """GB/s (read + written) of a one-thread tensor copy on each of `cores` at once, one process a
    core, all starting together: the memory bandwidth that N one-core replicas share."""
    start_at = str(time.time() + 15)  # every child has imported torch by then
    children = [
        subprocess.Popen(
            ["taskset", "-c", str(core), sys.executable, "-c", COPY_CHILD, start_at],
            stdout=subprocess.PIPE,
            text=True,
        )
        for core in cores
    ]
    return [float(child.communicate()[0]) for child in children]


def run_layout(args, name: str, cores: str, replicas: int, servers: int = 1) -> dict:
    """One server of `replicas` replicas on `cores`; or, with servers > 1, that many one-engine
    servers without Ray, one per core set of `cores` (";"-separated), the clients split between them:
    what the hardware gives N engines with no Ray Serve in their path."""
    import openai

    core_sets = cores.split(";") if servers > 1 else [cores]
    ports = [free_port() for _ in core_sets]
    procs: list[subprocess.Popen] = []
    try:
        started = time.monotonic()
        procs += [_start(args, port, c, replicas) for port, c in zip(ports, core_sets)]
        clients = [
            openai.OpenAI(
                base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=600
            )
            for port in ports
        ]
        for client, proc in zip(clients, procs):
            _wait_ready(client, proc)
        start_s = time.monotonic() - started  # until the last server answers
        levels = [_load(clients, int(c), args) for c in args.clients.split(",")]
        return {
            "layout": name,
            "cores": cores,
            "replicas": replicas * len(procs),
            "start_s": start_s,
            "levels": levels,
        }
    finally:
        for proc in procs:
            interrupt(proc, timeout_s=120, group=True)


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv if argv is not None else sys.argv[1:])
    from suite.machine import machine_line

    n = args.replicas
    every = ",".join(map(str, range(n)))
    layouts = [
        ("1 replica x 1 core", "0", 1),
        (f"{n} replicas x 1 core", ";".join(map(str, range(n))), n),
        (f"1 replica x {n} cores", every, 1),
        (f"{n} plain servers x 1 core, no Ray", ";".join(map(str, range(n))), 1, n),
    ]
    runs = [run_layout(args, *layout) for layout in layouts]
    one = {lv["clients"]: lv["tok_s"] for lv in runs[0]["levels"]}
    lines = header(
        f"Replicas against one engine, {time.strftime('%Y-%m-%d')}",
        machine_line(),
        f"python benchmarks/bench_replicas.py {' '.join(argv or sys.argv[1:])}",
        f"Model: {args.model or 'the built-in pair'}, mode {args.mode}, greedy, {args.new_tokens} tokens a "
        f"request, EOS ignored, {args.seconds:.0f} s per client count",
    ) + [
        "| layout | start s | clients | aggregate tok/s | vs 1 replica x 1 core | requests | mean latency s |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        for lv in run["levels"]:
            lines.append(
                f"| {run['layout']} | {run['start_s']:.0f} | {lv['clients']} | {lv['tok_s']:.2f} | "
                f"{lv['tok_s'] / one[lv['clients']]:.2f}x | {lv['requests']} | {lv['mean_latency_s']:.2f} |"
            )
    alone, together = copy_bandwidth([0]), copy_bandwidth(list(range(n)))
    lines += [
        "",
        f"Memory bandwidth the replicas share (a one-thread 64 MB tensor copy per core, read + written): "
        f"core 0 alone {alone[0]:.1f} GB/s; cores 0-{n - 1} at once {' + '.join(f'{g:.1f}' for g in together)} = "
        f"{sum(together):.1f} GB/s, {sum(together) / alone[0]:.2f}x one core: the ceiling of N one-core "
        "replicas of a memory-bound decode.",
    ]
    text = "\n".join(lines) + "\n\nGoal: N replicas x 1 core >= 0.9 N x one replica x 1 core.\n"
    result = {
        "runs": runs,
        "machine": machine_line(),
        "copy_gbps": {"alone": alone, "together": together},
        "args": {k: v for k, v in vars(args).items() if k != "out"},
    }
    base = write_dated_result(args.out, "replicas", text, result, args.tag)
    print(text)
    print(f"wrote {base}.md", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
