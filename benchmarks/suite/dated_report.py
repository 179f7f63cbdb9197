"""What the benchmark scripts beside bench.py share: their --out / --tag / --cores flags, a child
process's RESULT line, a report's header, and the files they write (OUT/DATE-NAME[-TAG].md, .json)."""

import datetime
import json
import os
import subprocess

BENCHMARKS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(BENCHMARKS)
RESULTS_DIR = os.path.join(BENCHMARKS, "results")
RESULT = "RESULT "  # a child process prints its JSON on the line this starts


def add_output_flags(p, cores_help: str | None = None) -> None:
    """--out and --tag (the result files' folder and DATE-NAME-TAG.*); --cores with its help, if given."""
    p.add_argument("--out", default=RESULTS_DIR)
    p.add_argument("--tag", default="")
    if cores_help:
        p.add_argument("--cores", default=None, help=cores_help)


def core_list(text: str | None) -> list[int]:
    """--cores: comma-separated core ids, sorted; none given: every core this process may use."""
    if not text:
        return sorted(os.sched_getaffinity(0))
    return sorted(int(c) for c in text.split(",") if c.strip())


def pinned(cores: list[int]) -> list[str]:
    """The command prefix that runs a child on `cores`."""
    return ["taskset", "-c", ",".join(map(str, cores))]


def child_result(argv: list[str]) -> tuple[object, subprocess.CompletedProcess]:
    """Runs `argv` from the repository root: the JSON on its RESULT line (None without one), and
    the finished process for its error output."""
    done = subprocess.run(argv, capture_output=True, text=True, cwd=REPO)
    line = next((out for out in done.stdout.splitlines() if out.startswith(RESULT)), None)
    return (None if line is None else json.loads(line[len(RESULT) :])), done


def run_facts(script: str, argv: list[str], a) -> dict:
    """A result's first keys: date, machine, --cores, --model and the command that reproduces it."""
    from suite.machine import machine_line  # imports torch

    return {
        "date": datetime.date.today().isoformat(),
        "machine": machine_line("cpu"),
        "cores": a.cores,
        "model": a.model or "the built-in pair",
        "command": " ".join([f"python benchmarks/{script}", *argv]),
    }


def header(title: str, machine: str, command: str, *facts: str) -> list[str]:
    """A report's first lines: its title, the machine, `facts` (one bullet each), the command."""
    facts_lines = [f"- {fact}" for fact in facts]
    return [f"# {title}", "", f"- Machine: {machine}", *facts_lines, f"- Command: `{command}`", ""]


def write_dated_report(out_dir: str, name: str, text: str) -> str:
    """Write `text` to out_dir/DATE-name.md (the folder made if needed); its path."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{datetime.date.today().isoformat()}-{name}.md")
    with open(path, "w") as f:
        f.write(text)
    return path


def write_dated_result(out_dir: str, name: str, text: str, result: dict, tag: str = "") -> str:
    """Write `text` to out_dir/DATE-name[-tag].md and `result` to .json; their path, no suffix."""
    base = write_dated_report(out_dir, name + (f"-{tag}" if tag else ""), text)[: -len(".md")]
    with open(base + ".json", "w") as f:
        json.dump(result, f, indent=1)
    return base
