#!/usr/bin/env python
"""Run a command and report the peak resident memory of its whole process tree.

    python scripts/peak_rss.py -- python -m ssd_engine.generate --prompt "def quicksort(arr):"
    python scripts/peak_rss.py --json out.json --interval 0.2 -- CMD ...

Every `--interval` seconds the tree (the command and all its descendants, the SSD draft process
and tensor-parallel workers included) is walked. Two figures come out, because the kernel's OOM
killer cares about the sum while a single bloated process is what a fix has to find:
- per process: the highest VmHWM seen (the kernel's own high-water mark, so a spike between two
  samples still counts), labelled by what the process runs;
- summed: the highest sum of current RSS over one sample (processes peak at different times, so
  this is at most the sum of the per-process peaks).
GB here is 2^30 bytes, as in the benchmark reports.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

import psutil

GB = 2**30


@dataclass
class ProcessPeak:
    pid: int
    label: str
    peak_gb: float = 0.0  # VmHWM: the kernel's high-water mark of RSS


@dataclass
class TreePeak:
    command: list[str]
    returncode: int | None = None
    wall_s: float = 0.0
    summed_peak_gb: float = 0.0
    summed_at_s: float = 0.0
    processes: dict[int, ProcessPeak] = field(default_factory=dict)
    trace: list[tuple[float, dict[int, float]]] = field(default_factory=list)  # (s, pid -> RSS GB)

    @property
    def largest_gb(self) -> float:
        return max((p.peak_gb for p in self.processes.values()), default=0.0)


def label_of(proc: psutil.Process) -> str:
    """A short name a reader recognises: the `-m` module, else the script, else the executable."""
    try:
        argv = proc.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "?"
    if "-m" in argv[:-1]:
        return argv[argv.index("-m") + 1]
    return next((a for a in argv[1:] if not a.startswith("-")), argv[0] if argv else "?")


def vm_hwm_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def sample(root: psutil.Process, result: TreePeak, started: float) -> None:
    try:
        tree = [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return
    total, now = 0, {}
    for proc in tree:
        try:
            rss = proc.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        total += rss
        now[proc.pid] = round(rss / GB, 3)
        peak = result.processes.get(proc.pid)
        if peak is None:
            peak = result.processes[proc.pid] = ProcessPeak(proc.pid, "?")
        label = label_of(proc)  # re-read: a child sampled between fork and exec shows our own argv
        if label != "?":
            peak.label = label
        hwm = vm_hwm_bytes(proc.pid) or rss
        peak.peak_gb = max(peak.peak_gb, hwm / GB, rss / GB)
    result.trace.append((round(time.monotonic() - started, 2), now))
    if total / GB > result.summed_peak_gb:
        result.summed_peak_gb, result.summed_at_s = total / GB, time.monotonic() - started


def measure(command: list[str], interval: float) -> TreePeak:
    result = TreePeak(command)
    started = time.monotonic()
    child = subprocess.Popen(command)
    root = psutil.Process(child.pid)
    while child.poll() is None:
        sample(root, result, started)
        time.sleep(interval)
    result.returncode = child.returncode
    result.wall_s = time.monotonic() - started
    return result


def report(result: TreePeak) -> str:
    lines = [
        f"peak RSS of `{' '.join(result.command)}` (exit {result.returncode}, {result.wall_s:.1f} s):"
    ]
    for p in sorted(result.processes.values(), key=lambda p: -p.peak_gb):
        if p.peak_gb >= 0.05:  # skip shells and other wrappers
            lines.append(f"  {p.label:<32} pid {p.pid:<7} {p.peak_gb:6.2f} GB")
    lines.append(
        f"  {'summed over the tree':<32} {'':11} {result.summed_peak_gb:6.2f} GB "
        f"(at {result.summed_at_s:.1f} s)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--interval", type=float, default=0.2, help="seconds between samples (default 0.2)"
    )
    ap.add_argument("--json", help="also write the result here, with every sample (the trace)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("give the command to measure after --")
    result = measure(command, args.interval)
    print(report(result), file=sys.stderr, flush=True)
    if args.json:
        data = asdict(result) | {"largest_gb": result.largest_gb}
        data["processes"] = list(data["processes"].values())
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)
    return result.returncode or 0


if __name__ == "__main__":
    sys.exit(main())
