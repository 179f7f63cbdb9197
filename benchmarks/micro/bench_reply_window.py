"""Micro-benchmark (not a test): one SSD round trip over the draft link, the reply carrying whole q rows,
through gloo alone and through the shared reply window (speculative/ssd/reply_window.py).

    python benchmarks/micro/bench_reply_window.py                       # batch 1 and 8, K = 4, vocab 151936
    python benchmarks/micro/bench_reply_window.py --batch 1,4,16 --rounds 50

Two processes, the coordinator pinned to core 0 and the draft to core 1 (the engine's CPU layout;
on one GPU both sides' payloads also cross host memory). Per round the coordinator sends a small
request; the draft writes the reply (K x vocab floats a sequence, as its encode does) into its own
buffer or into the window, and sends it. Timed: the coordinator's send -> reply in hand, the
stretch the verification waits for. Milliseconds, median over the rounds.
"""

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ssd_engine.speculative.ssd.codec import ReplyLayout
from ssd_engine.speculative.ssd.link import DraftLink
from ssd_engine.speculative.ssd.reply_window import ReplyWindow


def _side(
    rank: int, path: str, fd: int, capacity: int, layouts: list[ReplyLayout], rounds: int, results
) -> None:
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    torch.set_num_threads(1)
    store = dist.FileStore(path, 2)
    links = {
        "gloo": DraftLink(store, rank, 60.0),
        "window": DraftLink(
            dist.PrefixStore("window", store), rank, 60.0, reply_window=ReplyWindow(fd, capacity)
        ),
    }
    request = torch.zeros(64, dtype=torch.uint8)
    request.view(torch.int64)[0] = 64  # request_size: its own length
    for layout in layouts:
        size = layout.size
        rows = torch.rand(size // 4)
        own = torch.empty(size, dtype=torch.uint8)
        for name, link in links.items():
            times = []
            for _ in range(rounds):
                if rank == 0:
                    started = time.perf_counter()
                    link.send_request(request)
                    link.recv_reply(size)
                    times.append(time.perf_counter() - started)
                else:
                    link.recv_request()
                    shared = link.reply_buffer(layout)
                    out = own if shared is None else shared
                    out.view(torch.float32).copy_(rows)  # the encode's copy of the q rows
                    link.send_reply(out)
            if rank == 0:
                results[(name, size)] = statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", default="1,8")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    layouts = [ReplyLayout(args.k, (args.vocab,) * b, args.vocab) for b in batches]
    sizes = [layout.size for layout in layouts]
    capacity = max(sizes)
    fd = ReplyWindow.create_fd(capacity)
    path = tempfile.mktemp(prefix="bench-reply-window-")
    results = mp.Manager().dict()
    try:
        # forked: the children inherit the window's fd, as the draft process does through pass_fds
        mp.start_processes(
            _side,
            args=(path, fd, capacity, layouts, args.rounds, results),
            nprocs=2,
            start_method="fork",
        )
    finally:
        os.close(fd)
        if os.path.exists(path):
            os.remove(path)
    print(
        f"K = {args.k}, vocab {args.vocab}, whole q rows; coordinator on core 0, draft on core 1; "
        f"median of {args.rounds} rounds\n"
    )
    print("| batch | reply MB | gloo ms | window ms |\n|---|---|---|---|")
    for batch, size in zip(batches, sizes):
        print(
            f"| {batch} | {size / 1e6:.1f} | {results[('gloo', size)]:.2f} | {results[('window', size)]:.2f} |"
        )


if __name__ == "__main__":
    main()
