"""What `pip install` puts on sys.path: only the `ssd_engine` package. The Triton kernels live in
`ssd_engine.kernels`; a top-level `kernels` would shadow, or be shadowed by, PyPI's `kernels`
(which transformers imports when present)."""
import ast
import importlib
import os
import tomllib

from setuptools import find_packages

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CODE_DIRS = ("ssd_engine", "benchmarks", "scripts", "tests")


def installed_packages() -> list[str]:
    with open(os.path.join(REPO_ROOT, "pyproject.toml"), "rb") as f:
        find = tomllib.load(f)["tool"]["setuptools"]["packages"]["find"]
    return find_packages(REPO_ROOT, include=find.get("include", ("*",)), exclude=find.get("exclude", ()))


def test_kernels_import_under_the_project_namespace():
    module = importlib.import_module("ssd_engine.kernels.paged_attention")
    assert hasattr(module, "paged_attention") and hasattr(module, "tree_attention")
    assert importlib.import_module("ssd_engine.kernels.compile_check").VARIANTS


def test_only_ssd_engine_is_installed():
    packages = installed_packages()
    assert "ssd_engine.kernels" in packages
    assert all(p == "ssd_engine" or p.startswith("ssd_engine.") for p in packages), packages
    assert not os.path.exists(os.path.join(REPO_ROOT, "kernels", "__init__.py"))


def test_no_code_imports_a_top_level_kernels():
    offenders = []
    for top in CODE_DIRS:
        for folder, _, files in os.walk(os.path.join(REPO_ROOT, top)):
            for name in files:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8") as f:
                    tree = ast.parse(f.read(), path)
                for node in ast.walk(tree):
                    names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                        [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
                    offenders += [f"{path}: {n}" for n in names if n == "kernels" or n.startswith("kernels.")]
    assert not offenders, offenders
