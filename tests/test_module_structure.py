"""The package's shape: no import loops between ssd_engine's modules (lazy imports inside
functions count too: a loop hidden in a function is still a loop).

The import graph is read from the source with `ast` (every `import x` / `from x import y` naming
an ssd_engine module), and its strongly connected components must all be single modules.
"""
import ast
import os

import ssd_engine

PACKAGE_DIR = os.path.dirname(ssd_engine.__file__)


def _modules() -> dict[str, str]:
    found = {}
    for folder, _, files in os.walk(PACKAGE_DIR):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                module = "ssd_engine." + os.path.relpath(path, PACKAGE_DIR)[:-3].replace(os.sep, ".")
                found[module.removesuffix(".__init__")] = path
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


def test_every_module_is_small():
    """Small modules with one job each: none over 300 lines."""
    long = {module: n for module, path in _modules().items() if (n := sum(1 for _ in open(path))) > 300}
    assert long == {}
