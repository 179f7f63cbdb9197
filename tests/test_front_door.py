"""Callers use the engine's front door: outside ssd_engine/engine/, code reads only the names of
`FRONT_DOOR` on an LLMEngine (found by name: an attribute read on `engine`, `self.engine`,
`llm.engine`, `self._engine`), never its parts (scheduler, block manager, runner, speculator...).
"""

import ast

from repo_files import REPO, tracked_files

FRONT_DOOR = {
    # requests
    "make_sequence",
    "make_samples",
    "add",
    "add_request",
    "abort",
    "tokenize",
    "validate",
    # the loop and its results
    "step",
    "has_unfinished",
    "to_output",
    "stats",
    # what the engine is and how it runs
    "tokenizer",
    "model_path",
    "max_model_len",
    "kv_capacity_tokens",
    "k",
    "plan",
    "execution",
    # metrics and shutdown
    "speculation_metrics",
    "reset_speculation_metrics",
    "ssd_metrics",
    "close",
}
ENGINE_NAMES = {"engine", "_engine"}
EXCEPTIONS: set[str] = set()


def _engine_reads(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        value = node.value
        named = (
            value.id
            if isinstance(value, ast.Name)
            else value.attr
            if isinstance(value, ast.Attribute)
            else None
        )
        if named in ENGINE_NAMES and node.attr not in FRONT_DOOR:
            found.append((node.lineno, node.attr))
    return found


def test_nothing_outside_the_engine_reaches_into_its_parts():
    reaches = []
    for path in tracked_files(under="ssd_engine"):
        relative = str(path.relative_to(REPO))
        if (
            path.suffix != ".py"
            or relative.startswith("ssd_engine/engine/")
            or relative in EXCEPTIONS
        ):
            continue
        reaches += [
            f"{relative}:{line}: engine.{name}"
            for line, name in _engine_reads(ast.parse(path.read_text()))
        ]
    assert not reaches, (
        "use the engine's front door (tests/test_front_door.py FRONT_DOOR):\n" + "\n".join(reaches)
    )


def test_the_scan_finds_a_reach():
    assert _engine_reads(ast.parse("self.engine.scheduler.add(seq)\nllm.engine.add(seq)")) == [
        (1, "scheduler")
    ]
