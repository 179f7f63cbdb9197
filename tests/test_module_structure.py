"""The package's shape: its packages are layers that import only downward, and no import loops
between its modules (lazy imports inside functions count too: a loop hidden in a function is still
a loop).

The import graph is read from the source with `ast` (every `import x` / `from x import y` naming
an ssd_engine module), and its strongly connected components must all be single modules.
"""

import ast
import os
import subprocess
import sys

import pytest
from repo_files import tracked_files

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# where each package's source lives: ssd_engine/, and the kernels installed as ssd_engine.kernels
SOURCES = {"ssd_engine": "ssd_engine", "ssd_engine.kernels": "kernels"}
# bottom first: a package may import its own modules and those of the layers below it, nothing else.
# The modules at the package's top (the public API and the command lines) form the top layer.
LAYERS = [
    {"utils"},  # leaf helpers: the machine, memory, uploads, kernel-launch hooks
    {"core"},  # options, config, sampling parameters, outputs, sequences, batches, protocols
    {"distributed"},  # process groups, partitions, core placement, child processes
    {"kernels"},  # Triton kernels
    {"layers"},  # linear, attention, norms, rotary, weight formats
    {"models"},  # decoders, checkpoint loading, the built-in pair, tokenizers
    {"sampling", "saguaro"},  # exact sampling and verification; the Saguaro math
    {"runtime"},  # model runner, KV blocks, CUDA graphs
    {"tensor_parallel"},  # the runtime across ranks
    {"speculative"},  # SD and SSD speculators
    {"planning"},  # auto mode: measured costs, predictions, the frozen plan
    {"engine"},  # the step loop, scheduler, outputs, text streaming
    {"server"},  # the OpenAI-compatible server
    {"<top>"},  # the public API and the command lines
]


def _modules() -> dict[str, str]:
    found = {}
    for package, folder in SOURCES.items():
        for path in tracked_files(under=folder):
            if path.suffix == ".py":
                module = (
                    package
                    + "."
                    + str(path.relative_to(REPO))[len(folder) + 1 : -3].replace(os.sep, ".")
                )
                found[module.removesuffix(".__init__")] = str(path)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for module, path in modules.items():
        deps = set()
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            deps |= {n for n in names if n in modules and n != module}
        graph[module] = deps
    graph["ssd_engine"] = set()  # the public facade imports lazily what it re-exports
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_cycle_finder_finds_a_loop():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_loops_between_modules():
    assert cycles(import_graph()) == []


def package_of(module: str) -> str:
    """ssd_engine.runtime.model_runner -> runtime; ssd_engine.llm (a top-level module) -> <top>."""
    parts = module.split(".")
    if len(parts) == 1:
        return "<top>"
    is_package = len(parts) > 2 or (
        len(parts) == 2 and os.path.isdir(os.path.join(REPO, "ssd_engine", parts[1]))
    )
    return parts[1] if is_package or parts[1] == "kernels" else "<top>"


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    rank = {package: i for i, layer in enumerate(LAYERS) for package in layer}
    wrong = []
    for module, deps in graph.items():
        here = package_of(module)
        for dep in sorted(deps):
            there = package_of(dep)
            if there != here and rank[there] >= rank[here]:
                wrong.append(f"{module} ({here}) imports {dep} ({there})")
    return wrong


def test_every_package_has_a_layer():
    packages = {package_of(m) for m in _modules() if m != "ssd_engine"}
    assert packages == {p for layer in LAYERS for p in layer}


def test_packages_import_only_downward():
    assert upward_imports(import_graph()) == []


@pytest.mark.parametrize(
    "graph, expected",
    [
        (
            {"ssd_engine.core.config": {"ssd_engine.engine.llm_engine"}},
            ["ssd_engine.core.config (core) imports ssd_engine.engine.llm_engine (engine)"],
        ),
        (
            {"ssd_engine.sampling.verifier": {"ssd_engine.saguaro.fanout"}},
            ["ssd_engine.sampling.verifier (sampling) imports ssd_engine.saguaro.fanout (saguaro)"],
        ),
        (
            {
                "ssd_engine.engine.llm_engine": {
                    "ssd_engine.core.config",
                    "ssd_engine.engine.scheduler",
                }
            },
            [],
        ),
    ],
)
def test_the_layer_check_finds_an_upward_import(graph, expected):
    assert upward_imports(graph) == expected


def test_every_module_is_small():
    """Small modules with one job each: none over 300 lines."""
    long = {
        module: n for module, path in _modules().items() if (n := sum(1 for _ in open(path))) > 300
    }
    assert long == {}


def test_the_engine_reads_its_options_only_through_the_plan():
    """LLMEngine hands its options to plan() and reads only the resolved config of the plan after
    that: no second home for K or any other option, and no option looked up by its public name."""
    path = os.path.join(REPO, "ssd_engine", "engine", "llm_engine.py")
    with open(path) as f:
        tree = ast.parse(f.read())
    uses = [node for node in ast.walk(tree) if isinstance(node, ast.Name) and node.id == "options"]
    calls = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "plan"
    ]
    assert len(uses) == 1 and len(calls) == 1 and calls[0].args[0] is uses[0]
    engine_files = [p for p in tracked_files(under="ssd_engine/engine") if p.suffix == ".py"]
    readers = [
        str(p)
        for p in engine_files
        if any(f in p.read_text() for f in (".option_value(", ".with_options(", ".from_kwargs("))
    ]
    assert readers == []


def test_child_processes_start_without_transformers():
    """A tensor-parallel worker and the SSD draft build from their parent's config values
    (RunnerSpec.checkpoint_config): importing transformers would add about a second to each start."""
    entry_modules = ("ssd_engine.tensor_parallel.worker", "ssd_engine.speculative.ssd.draft.loop")
    code = (
        f"import sys; import {', '.join(entry_modules)}; "
        "print(sorted(m for m in ('transformers', 'tokenizers') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO
    )
    assert result.stdout.strip() == "[]"
