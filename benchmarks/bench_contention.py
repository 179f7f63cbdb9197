"""Do the SSD target and draft slow each other down on this machine? (Not a test.)

    python benchmarks/bench_contention.py      # default pair: target on core 0, draft on core 1

SSD runs the target's verification and the draft's branch decoding at the same time on disjoint
cores. Both are memory-bound, and cores share the memory bus and the last-level cache, so
"disjoint cores" is not "separate devices". This times a verification forward (K + 1 tokens) of
the target alone and while the draft decodes branch-sized batches on the other core without a
pause, and the draft's forward alone and while the target verifies: the medians, side by side.
Writes results/DATE-contention.md.
"""
import argparse
import datetime
import multiprocessing as mp
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from suite.machine import machine_line  # noqa: E402


def _probe(model: str, core: int):
    os.sched_setaffinity(0, {core})
    from ssd_engine import LLM
    from suite.probe import ForwardProbe
    llm = LLM(model, speculative_mode="ar", num_threads=1, max_num_seqs=1, enable_prefix_caching=False)
    engine = llm.engine
    return llm, ForwardProbe(engine.runner, engine.block_manager, engine.config, 200)


def _busy(model: str, core: int, rows: int, ready, stop) -> None:
    """The other side: forwards of `rows` tokens back to back until told to stop."""
    llm, probe = _probe(model, core)
    probe(rows)
    ready.set()
    while not stop.is_set():
        probe(rows)
    llm.close()


def _median(model: str, core: int, rows: int, reps: int, other: tuple | None) -> float:
    """Median forward seconds on `core`, alone (other None) or while `other` = (model, core, rows) runs."""
    llm, probe = _probe(model, core)
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    proc = None
    if other is not None:
        proc = ctx.Process(target=_busy, args=(*other, ready, stop))
        proc.start()
        ready.wait()
    probe(rows)
    seconds = statistics.median(probe(rows) for _ in range(reps))
    stop.set()
    if proc is not None:
        proc.join()
    llm.close()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--draft", default=None)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--draft-rows", type=int, default=5, help="rows of a branch-decoding step (fan-out + trunk)")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--target-core", type=int, default=0)
    parser.add_argument("--draft-core", type=int, default=1)
    args = parser.parse_args()
    from ssd_engine.default_models import resolve_default_model
    model, draft = args.model or resolve_default_model("target"), args.draft or resolve_default_model("draft")
    target_side, draft_side = (model, args.target_core, args.k + 1), (draft, args.draft_core, args.draft_rows)
    rows = []
    for name, side, other in (("target verification", target_side, draft_side), ("draft branch step", draft_side, target_side)):
        alone = _median(*side, args.reps, None)
        shared = _median(*side, args.reps, other)
        rows.append(f"| {name} ({side[2]} tokens, core {side[1]}) | {alone * 1e3:.0f} | {shared * 1e3:.0f} "
                    f"| {shared / alone:.2f}x |")
        print(rows[-1], file=sys.stderr, flush=True)
    stamp = datetime.date.today().isoformat()
    text = "\n".join([f"# Target / draft contention, {stamp}", "", f"Machine: {machine_line()}",
                      f"Target: `{model}`; draft: `{draft}`; one thread each, fp32, 200-token prefix, median of {args.reps}.",
                      f"Command: `python benchmarks/bench_contention.py {' '.join(sys.argv[1:])}`", "",
                      "| forward | alone ms | while the other side runs ms | slowdown |", "|---|---|---|---|", *rows, ""])
    print(text)
    path = os.path.join(HERE, "results", f"{stamp}-contention.md")
    with open(path, "w") as f:
        f.write(text)
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
