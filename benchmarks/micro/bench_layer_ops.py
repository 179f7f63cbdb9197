"""The default pair end to end with a layer's elementwise work as torch's ops (`fused_kernels="off"`)
and as the fused C++ ops (`auto`, kernels/cpu_layer_ops.py), side by side. (Not a test.)

    python benchmarks/micro/bench_layer_ops.py --rounds 5 --tag DATE-or-name

Per case, both engines are loaded at once (after a throwaway one) and decode in turn, --rounds times (alternating, so a
neighbour's load on a shared machine hits both alike): --new-tokens greedy tokens after a fixed
150-token prompt, decode tok/s timed after the first token. Medians count. Writes
results/DATE-layer-ops[-TAG].md.
"""

import argparse
import datetime
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/
sys.path.insert(0, HERE)
PROMPT = [3 + i % 250 for i in range(150)]  # ids every vocabulary has; 150 tokens
CASES = {
    "ar": dict(speculative_mode="ar"),
    "sd-k1": dict(speculative_mode="sd", num_speculative_tokens=1),
    "sd-k4-gguf-int8": dict(
        speculative_mode="sd", num_speculative_tokens=4, target_dtype="gguf-int8"
    ),
}


def decode_rate(llm, new_tokens: int) -> float:
    from ssd_engine import SamplingParams

    engine = llm.engine
    engine.add_request(
        PROMPT, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    )
    engine.step()  # the prefill and the first token
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return (new_tokens - 1) / (time.perf_counter() - start)


def run_case(options: dict, threads: int, rounds: int, new_tokens: int) -> dict[str, float]:
    from ssd_engine import LLM

    common = dict(num_threads=threads, cpu_cores=",".join(map(str, range(threads))), **options)
    engines = {fused: LLM(None, fused_kernels=fused, **common) for fused in ("off", "auto")}
    try:
        rates = {fused: [] for fused in engines}
        for fused, llm in engines.items():
            decode_rate(llm, 8)  # warm
        for _ in range(rounds):
            for fused, llm in engines.items():
                rates[fused].append(decode_rate(llm, new_tokens))
        return {fused: statistics.median(r) for fused, r in rates.items()}
    finally:
        for llm in engines.values():
            llm.close()


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(
        prog="python benchmarks/micro/bench_layer_ops.py", description=__doc__.splitlines()[0]
    )
    p.add_argument("--cases", default=",".join(CASES), help=f"of {', '.join(CASES)}")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--tag", default=None)
    a = p.parse_args(argv)
    from suite.machine import machine_line

    lines = [
        f"# A layer's elementwise ops: torch's against the fused C++ ops ({datetime.date.today()})",
        "",
        f"`python benchmarks/micro/bench_layer_ops.py {' '.join(argv if argv is not None else sys.argv[1:])}`",
        "",
        f"{machine_line('cpu')}; {a.threads} thread(s) on cores 0..{a.threads - 1}; the default pair, greedy, "
        f"batch 1, {a.new_tokens} tokens after a {len(PROMPT)}-token prompt; both engines loaded, decoding in "
        f"turn, median of {a.rounds} rounds.",
        "",
        "| case | off tok/s | auto (C++ ops) tok/s | auto / off |",
        "|---|---|---|---|",
    ]
    from ssd_engine import LLM

    # the first engine a process builds decodes a few percent slower than an identical one built after
    # it (AR on the default pair: 20.35 against 21.86 tok/s; 21.11 against 21.61 behind a throwaway
    # build): one is built and closed first, so no compared engine is that one
    LLM(
        None,
        num_threads=a.threads,
        cpu_cores=",".join(map(str, range(a.threads))),
        speculative_mode="ar",
    ).close()
    for case in a.cases.split(","):
        rates = run_case(CASES[case], a.threads, a.rounds, a.new_tokens)
        lines.append(
            f"| {case} | {rates['off']:.2f} | {rates['auto']:.2f} | {rates['auto'] / rates['off']:.3f}x |"
        )
        print(lines[-1], flush=True)
    report = "\n".join(lines) + "\n"
    name = f"{datetime.date.today()}-layer-ops{'-' + a.tag if a.tag else ''}.md"
    with open(os.path.join(HERE, "results", name), "w") as f:
        f.write(report)
    print(report)
    return report


if __name__ == "__main__":
    main()
