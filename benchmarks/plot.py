"""Redraw a benchmark's plots from its raw JSON.

    python benchmarks/plot.py benchmarks/results/DATE-bench.json     # -> DATE-bench-*.png beside it

bench.py draws them itself at the end of a run.
"""

import json
import sys


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    from suite.plots import draw_all

    with open(sys.argv[1]) as f:
        raw = json.load(f)
    for path in draw_all(raw, sys.argv[1].rsplit(".", 1)[0]):
        print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
