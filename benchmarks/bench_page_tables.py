"""Host cost of a step's page tables, packed (engine/core.py `PageTable`) vs as Python lists.

    python benchmarks/bench_page_tables.py

Two costs grow with batch x context between a round's read and its next launch: flattening every
row's table into the step's upload (`host_upload.padded_rows` + `upload`), and, under tensor
parallelism, rank 0 comparing each table with the copy its workers hold (`PageTableMirror.delta`).
Each is timed for tables of both kinds side by side, in one run, after a step that appended one page
to every table; the list figures use the code as it was before tables were packed (the per-entry
compare loop). Block size 16. Writes benchmarks/results/DATE-page-tables.md.
"""
import argparse
import datetime
import os
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

SHAPES = [(1, 2000), (16, 2000), (64, 4000)]  # (rows, tokens per row)
BLOCK = 16


class ListMirror:
    """PageTableMirror.delta as it was for Python lists: a compare per entry."""

    def __init__(self) -> None:
        self.tables: dict[int, list[int]] = {}

    def delta(self, seq_id: int, table: list[int]):
        old = self.tables.get(seq_id, [])
        keep = 0
        while keep < min(len(old), len(table)) and old[keep] == table[keep]:
            keep += 1
        self.tables[seq_id] = list(table)
        return keep, table[keep:]


def best_us(run, repeats: int) -> float:
    """Best of `repeats` calls, in microseconds (the VM's noise only adds)."""
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best * 1e6


def measure(rows: int, tokens: int, repeats: int) -> dict:
    import torch
    from ssd_engine.distributed.worker import PageTableMirror
    from ssd_engine.engine.core import page_table
    from ssd_engine.engine.host_upload import padded_rows, upload
    rng = random.Random(0)
    pages = tokens // BLOCK
    lists = [rng.sample(range(1 << 20), pages) for _ in range(rows)]
    packed = [page_table(t) for t in lists]
    width = pages + 1

    def flatten(tables):
        return lambda: upload([padded_rows(tables, width)], "cpu", torch.int32)

    def deltas(mirror, tables):
        for i, t in enumerate(tables):
            mirror.delta(i, t)
        def step():  # a decode step: every table gained a page since the last delta
            for i, t in enumerate(tables):
                t.append(rng.randrange(1 << 20))
                mirror.delta(i, t)
                t.pop()
                mirror.tables[i] = mirror.tables[i][:-1]
        return step

    return {"rows": rows, "tokens": tokens, "pages": rows * pages,
            "flatten_lists_us": best_us(flatten(lists), repeats), "flatten_packed_us": best_us(flatten(packed), repeats),
            "delta_lists_us": best_us(deltas(ListMirror(), lists), repeats),
            "delta_packed_us": best_us(deltas(PageTableMirror(), packed), repeats)}


def render(results: list[dict], machine: str, command: str) -> str:
    lines = [f"# Page tables on the host, packed vs Python lists, {datetime.date.today()}", "",
             f"- Machine: {machine}", f"- Command: `{command}`",
             f"- Block size {BLOCK}; best of the repeats; one page appended to every table before each delta", "",
             "| rows | tokens per row | pages in all | flatten + upload, lists (us) | packed (us) "
             "| TP delta, lists (us) | packed (us) |", "|---" * 7 + "|"]
    lines += [f"| {r['rows']} | {r['tokens']} | {r['pages']} | {r['flatten_lists_us']:.0f} | "
              f"**{r['flatten_packed_us']:.0f}** | {r['delta_lists_us']:.0f} | **{r['delta_packed_us']:.0f}** |"
              for r in results]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    argv = sys.argv[1:] if argv is None else argv
    opts = parser.parse_args(argv)
    from suite.machine import machine_line
    results = [measure(rows, tokens, opts.repeats) for rows, tokens in SHAPES]
    text = render(results, machine_line("cpu"), " ".join(["python benchmarks/bench_page_tables.py", *argv]))
    print(text)
    os.makedirs(opts.out, exist_ok=True)
    with open(os.path.join(opts.out, f"{datetime.date.today()}-page-tables.md"), "w") as f:
        f.write(text)
    return results


if __name__ == "__main__":
    main()
