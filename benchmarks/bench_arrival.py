"""A long prompt arriving while requests decode: what the running requests' next tokens wait, and
the arriving prompt's time to first token, for each prefill budget.

    python benchmarks/bench_arrival.py                  # AR on the built-in pair, budgets 64,256,512,2048
    python benchmarks/bench_arrival.py --mode auto --decoding 8 --prompt-tokens 2048
    python benchmarks/bench_arrival.py --budgets 512 --max-decode-stall 2   # the step paced by time

Per budget (`max_num_batched_tokens`, the tokens a step computes), one engine in its own process:
`--decoding` requests decode 48-token HumanEval prompts; ten plain steps give the unloaded step; then
a `--prompt-tokens` prompt arrives and every step until its first token is timed (max and p99 of
those, as multiples of the unloaded step: the running requests' inter-token latency), with the
arrival's TTFT. Greedy, EOS ignored. Writes DATE-arrival[-TAG].md and .json under --out.
"""

import argparse
import multiprocessing
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor

from suite.dated_report import add_output_flags, header, write_dated_result


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python benchmarks/bench_arrival.py", description=__doc__.splitlines()[0]
    )
    p.add_argument("--mode", default="ar", help="speculative_mode of every engine")
    p.add_argument("--budgets", default="64,256,512,2048", help="max_num_batched_tokens values")
    p.add_argument(
        "--decoding", type=int, default=4, help="requests decoding when the prompt arrives"
    )
    p.add_argument("--prompt-tokens", type=int, default=780, help="the arriving prompt's length")
    p.add_argument(
        "--max-decode-stall",
        type=float,
        default=None,
        help="also run each budget with this max_decode_stall (prompt tokens paced by step time)",
    )
    add_output_flags(p)
    a = p.parse_args(argv)
    a.budgets = [int(b) for b in a.budgets.split(",")]
    return a


def run_one(a, budget: int, stall: float | None) -> dict:
    """One engine: the unloaded step, then every step while the prompt arrives."""
    from prompt_sets import load_prompt_set

    from ssd_engine import LLM, SamplingParams

    with LLM(speculative_mode=a.mode, max_num_batched_tokens=budget, max_decode_stall=stall) as llm:
        engine = llm.engine
        ids = engine.tokenizer.encode("\n".join(load_prompt_set("humaneval", 164)))
        params = SamplingParams(temperature=0, max_tokens=2048, ignore_eos=True)
        engine.add_request(ids[:32], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        while engine.has_unfinished():  # warm-up
            engine.step()
        running = [
            engine.add_request(ids[i * 48 : (i + 1) * 48], params) for i in range(a.decoding)
        ]
        while any(len(seq.output_token_ids) < 2 for seq in running):
            engine.step()
        plain = [_timed(engine.step) for _ in range(10)]
        arriving = engine.add_request(
            ids[-a.prompt_tokens :], SamplingParams(temperature=0, max_tokens=1)
        )
        started, during = time.perf_counter(), []
        while not arriving.output_token_ids:
            during.append(_timed(engine.step))
        ttft = time.perf_counter() - started
        for seq in running:
            engine.abort(seq)
    during.sort()
    unloaded = statistics.median(plain)
    return {
        "budget": budget,
        "max_decode_stall": stall,
        "unloaded_s": unloaded,
        "steps": len(during),
        "max_s": during[-1],
        "p99_s": during[min(len(during) - 1, int(0.99 * len(during)))],
        "ttft_s": ttft,
    }


def _timed(step) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def markdown(a, rows: list[dict], machine: str) -> str:
    lines = header(
        f"A {a.prompt_tokens}-token prompt arriving while {a.decoding} requests decode ({a.mode})",
        machine,
        f"python benchmarks/bench_arrival.py {' '.join(sys.argv[1:])}",
        "Model: the built-in pair; greedy; one engine per budget, each in its own process",
    ) + [
        "| max_num_batched_tokens | max_decode_stall | unloaded step ms | steps until its first token "
        "| longest step (x unloaded) | p99 step (x unloaded) | arrival TTFT s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        u = r["unloaded_s"]
        lines.append(
            f"| {r['budget']} | {r.get('max_decode_stall') or '-'} | {u * 1e3:.0f} | {r['steps']} | {r['max_s'] * 1e3:.0f} ({r['max_s'] / u:.1f}x) "
            f"| {r['p99_s'] * 1e3:.0f} ({r['p99_s'] / u:.1f}x) | {r['ttft_s']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    a = parse(sys.argv[1:] if argv is None else argv)
    from suite.machine import machine_line

    rows = []
    runs = [(budget, None) for budget in a.budgets]
    if a.max_decode_stall:
        runs += [(budget, a.max_decode_stall) for budget in a.budgets]
    # each engine in a fresh process: only one in memory, none runs second
    for budget, stall in runs:
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            rows.append(pool.submit(run_one, a, budget, stall).result())
        print(rows[-1], flush=True)
    text = markdown(a, rows, machine_line())
    base = write_dated_result(a.out, "arrival", text, {"rows": rows}, a.tag)
    print(text + f"\nwrote {base}.md, {base}.json")


if __name__ == "__main__":
    main()
