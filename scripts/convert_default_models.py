#!/usr/bin/env python
"""Prepare the default model folders ahead of time, so the first engine start does not pay
for joining + dequantizing (minutes on a small CPU box).

    python scripts/convert_default_models.py                # target and draft
    python scripts/convert_default_models.py --smollm2      # plus the SmolLM2 test fixture
    python scripts/convert_default_models.py --only draft   # just one of them
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

# Runnable from a plain checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ssd_engine.models import default_models as dm  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--only",
        choices=["target", "draft"],
        action="append",
        help="convert only this default model (repeatable); default: both",
    )
    ap.add_argument("--smollm2", action="store_true", help="also convert the SmolLM2-135M fixture")
    ap.add_argument("--smollm2-only", action="store_true", help="convert only the SmolLM2 fixture")
    ap.add_argument("--cache-dir", help=f"override ${dm.CACHE_ENV} (default ~/.cache/ssd_engine)")
    ap.add_argument(
        "--keep-gguf", action="store_true", help="keep the joined .gguf files in the cache"
    )
    args = ap.parse_args(argv)

    if args.cache_dir:
        os.environ[dm.CACHE_ENV] = args.cache_dir
    if args.keep_gguf:
        os.environ[dm.KEEP_GGUF_ENV] = "1"

    jobs = []
    if not args.smollm2_only:
        for which in args.only or ["target", "draft"]:
            jobs.append((which, lambda w=which: dm.resolve_default_model(w)))
    if args.smollm2 or args.smollm2_only:
        jobs.append(("smollm2", dm.resolve_smollm2))

    failed = False
    for label, fn in jobs:
        start = time.perf_counter()
        try:
            folder = fn()
        except dm.DefaultModelError as err:
            print(f"{label}: FAILED\n{err}", file=sys.stderr)
            failed = True
            continue
        print(f"{label}: {folder}  ({time.perf_counter() - start:.1f}s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
