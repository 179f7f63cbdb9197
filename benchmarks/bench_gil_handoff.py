"""Micro-benchmark (not a test): what a second Python thread costs a launch-bound loop through the
interpreter lock, the risk of `ssd_draft_host="thread"` (speculative/ssd/draft_thread.py).

    python benchmarks/bench_gil_handoff.py                 # switch intervals 5 ms (CPython's default), 1, 0.1 ms
    python benchmarks/bench_gil_handoff.py --ops 200 --stretch-us 0,50,500,2000

The main thread stands for the coordinator: a "round" of `--ops` small torch ops (each releases the
lock around its kernel, as a CUDA launch does) and a little Python between them. A second thread
stands for the draft: forever one small torch op, then `stretch` microseconds of pure Python (its
bookkeeping: lists, dicts, the codec), then `wait` microseconds without the lock (a draft on a GPU
waiting for its step to finish). Whenever the coordinator's op returns while the draft runs
Python, the coordinator waits for the lock until the draft's next op or until the switch interval
forces a hand-over. Reported: the round's mean time alone and beside the draft, per switch interval.
Run it with two cores free (the draft thread spins one).
"""
import argparse
import statistics
import sys
import threading
import time

import torch


def _python_for(seconds: float) -> None:
    """Busy pure-Python work (holds the lock throughout, as bookkeeping does)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _draft(stop: threading.Event, stretch_s: float, wait_s: float) -> None:
    x = torch.zeros(1)
    while not stop.is_set():
        x.add_(1)
        _python_for(stretch_s)
        if wait_s:
            time.sleep(wait_s)


def _rounds(ops: int, repeats: int) -> float:
    """Mean ms of one round of `ops` small ops (a mean: the waits come in bursts, a median hides them)."""
    x, y = torch.zeros(1), torch.ones(1)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(ops):
            x.add_(y)
        times.append(time.perf_counter() - started)
    return statistics.fmean(times) * 1e3


def measure(ops: int, stretch_us: float, wait_us: float, interval_s: float, repeats: int) -> tuple[float, float]:
    """(round ms alone, round ms beside a draft thread with `stretch_us` of Python and `wait_us`
    without the lock per op)."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(interval_s)
    try:
        alone = _rounds(ops, repeats)
        stop = threading.Event()
        draft = threading.Thread(target=_draft, args=(stop, stretch_us * 1e-6, wait_us * 1e-6), name="gil-bench-draft",
                                 daemon=True)
        draft.start()
        time.sleep(0.05)
        beside = _rounds(ops, repeats)
        stop.set()
        draft.join()
        return alone, beside
    finally:
        sys.setswitchinterval(old)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=100, help="small ops in one coordinator round")
    parser.add_argument("--stretch-us", default="0,20,200,1000", help="the draft's Python between its ops, us")
    parser.add_argument("--wait-us", default="0,1000", help="the draft's time without the lock per op, us")
    parser.add_argument("--interval-ms", default="5,1,0.1", help="sys.setswitchinterval values, ms")
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"round of {args.ops} small torch ops; mean of {args.repeats} rounds; python {sys.version.split()[0]}, "
          f"torch {torch.__version__}\n")
    print("| draft's Python per op (us) | draft's wait per op (us) | switch interval (ms) | round alone (ms) "
          "| beside the draft (ms) | ratio |")
    print("|---|---|---|---|---|---|")
    for wait in (float(w) for w in args.wait_us.split(",")):
        for stretch in (float(s) for s in args.stretch_us.split(",")):
            for interval in (float(i) for i in args.interval_ms.split(",")):
                alone, beside = measure(args.ops, stretch, wait, interval * 1e-3, args.repeats)
                print(f"| {stretch:g} | {wait:g} | {interval:g} | {alone:.3f} | {beside:.3f} | {beside / alone:.1f}x |",
                      flush=True)


if __name__ == "__main__":
    main()
