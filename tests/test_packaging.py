"""What `pip install` puts on sys.path: only the `ssd_engine` package. The Triton kernels live in the
top-level kernels/ folder and install as `ssd_engine.kernels`; a top-level `kernels` would shadow, or
be shadowed by, PyPI's `kernels` (which transformers imports when present)."""

import ast
import importlib
import os
import shutil
import subprocess
import sys
import zipfile

import tomllib
from repo_files import tracked_files

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CODE_DIRS = ("ssd_engine", "kernels", "benchmarks", "scripts", "tests")


def setuptools_table() -> dict:
    with open(os.path.join(REPO_ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]


def package_folders() -> set[str]:
    """Every folder of ssd_engine/ that is a package, as a dotted name."""
    return {
        os.path.relpath(p.parent, REPO_ROOT).replace(os.sep, ".")
        for p in tracked_files(under="ssd_engine")
        if p.name == "__init__.py"
    }


def test_kernels_import_under_the_project_namespace():
    module = importlib.import_module("ssd_engine.kernels.paged_attention")
    assert hasattr(module, "paged_attention") and hasattr(module, "tree_attention")
    assert importlib.import_module("ssd_engine.kernels.compile_check").VARIANTS


def test_the_package_list_is_every_package_folder_and_the_kernels():
    table = setuptools_table()
    assert set(table["packages"]) == package_folders() | {"ssd_engine.kernels"}
    assert table["package-dir"] == {"ssd_engine.kernels": "kernels"}


def test_the_wheel_holds_only_ssd_engine_with_the_kernels_inside(tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(REPO_ROOT, name), source / name)
    for folder in ("ssd_engine", "kernels"):
        shutil.copytree(
            os.path.join(REPO_ROOT, folder),
            source / folder,
            ignore=shutil.ignore_patterns("__pycache__"),
        )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "wheel"),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = (tmp_path / "wheel").iterdir()
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"ssd_engine"}, tops
    for kernel in ("__init__", "paged_attention", "fused_layer_ops", "compile_check"):
        assert f"ssd_engine/kernels/{kernel}.py" in names
    assert "ssd_engine/saguaro/calibration_prompts.txt" in names


def test_no_code_imports_a_top_level_kernels():
    offenders = []
    for path in (p for top in CODE_DIRS for p in tracked_files(under=top) if p.suffix == ".py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else (
                    [node.module or ""]
                    if isinstance(node, ast.ImportFrom) and node.level == 0
                    else []
                )
            )
            offenders += [
                f"{path}: {n}" for n in names if n == "kernels" or n.startswith("kernels.")
            ]
    assert not offenders, offenders
