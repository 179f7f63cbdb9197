"""Every code block of the README and the docs runs, as a reader would run it, so an example cannot rot.

A block is fenced with its language: `python` and `bash` blocks are code and run here; `text`
blocks are diagrams and formulas. The built-in default pair is replaced by a tiny stand-in pair
(its cache folders, `SSD_ENGINE_CACHE`), so the blocks run in seconds and without the pair's
packages. What cannot run on this machine is said by the block itself and checked as far as it
can be: `pip install` steps are what CI's own install does (they are dropped, the rest of the
line runs); the README's test command is the one CI runs (checked to be what `.ci/run` extracts);
a command for CUDA, several nodes or a Ray cluster, on a machine without them, has its flags parsed by
the CLI's own parser. A block's fixed server port is swapped for a free one; a Python block's real shape folder
(configs/shapes/, random weights) for a two-layer copy of it.
"""

import json
import os
import re
import shlex
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from process_helpers import free_port
from repo_files import REPO, tracked_files

DOCS = ["README.md", "benchmarks/README.md"] + [
    str(p.relative_to(REPO)) for p in tracked_files(under="docs") if p.suffix == ".md"
]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
LANGUAGES = {"python", "bash", "text"}
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def doc_blocks() -> list[tuple[str, int, str, str]]:
    """(file, line, language, body) of every fenced block."""
    found = []
    for doc in DOCS:
        text = (REPO / doc).read_text()
        for match in FENCE.finditer(text):
            found.append(
                (doc, text.count("\n", 0, match.start()) + 1, match.group(1), match.group(2))
            )
    return found


CODE = [b for b in doc_blocks() if b[2] in ("python", "bash")]


def test_every_block_says_its_language():
    unlabelled = [f"{doc}:{line}" for doc, line, lang, _ in doc_blocks() if lang not in LANGUAGES]
    assert not unlabelled, f"fence these as one of {sorted(LANGUAGES)}: {unlabelled}"


@pytest.fixture(scope="module")
def stand_in_cache(tmp_path_factory) -> Path:
    """A cache whose built-in pair is two tiny Qwen2 checkpoints sharing a byte-level tokenizer."""
    import tiny_checkpoints

    from ssd_engine.models import default_models

    cache = tmp_path_factory.mktemp("cache")
    for seed, spec in ((0, default_models.DEFAULT_TARGET), (1, default_models.DEFAULT_DRAFT)):
        folder = cache / spec.name
        tiny_checkpoints.build_checkpoint(
            str(folder), "qwen2", seed=seed, max_position_embeddings=4096
        )
        config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(
            json.dumps({**config, "chat_template": CHAT_TEMPLATE})
        )
        (folder / default_models.MARKER).write_text("{}\n")
    return cache


def _env(cache: Path) -> dict:
    return {**os.environ, "SSD_ENGINE_CACHE": str(cache), "SSD_ENGINE_PROGRESS": "0"}


def _commands(body: str) -> list[str]:
    """A bash block's commands: continuation lines joined, `&&` chains split, comments dropped."""
    lines = body.replace("\\\n", " ").splitlines()
    return [
        part.split("  #")[0].strip() for line in lines for part in line.split("&&") if part.strip()
    ]


def _needs_hardware(command: str) -> str | None:
    if "--device cuda" in command and not torch.cuda.is_available():
        return "CUDA"
    if re.search(r"--nnodes [2-9]", command):
        return "several nodes"
    if command.startswith("ray start") or "--ray-address" in command:
        return "a Ray cluster of several machines"
    return None


def _parse_only(command: str) -> None:
    """Our CLIs' flags, through the CLI's own parser (another tool's command, e.g. `ray start`, is its own)."""
    from ssd_engine import generate, serve

    argv = shlex.split(command)
    if "-m" not in argv:
        assert argv[0] == "ray", command
        return
    module_args = argv[argv.index("-m") + 2 :]
    parsers = {"ssd_engine.generate": generate.build_parser, "ssd_engine.serve": serve.build_parser}
    parsers[argv[argv.index("-m") + 1]]().parse_args(module_args)


def _results_elsewhere(command: str, out: Path) -> str:
    """A benchmark writes into the checkout's benchmarks/results/ unless told: here, a temporary folder."""
    if re.search(r"benchmarks/\S+\.py", command) and "--out" not in command:
        return f"{command} --out {shlex.quote(str(out))}"
    return command


def _run(command: str, cache: Path, timeout: int = 300) -> str:
    done = subprocess.run(
        command,
        shell=True,
        cwd=REPO,
        env=_env(cache),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, f"{command}\n{done.stderr[-3000:]}"
    return done.stdout


def _run_with_server(commands: list[str], cache: Path) -> None:
    """`python -m ssd_engine.serve --port P` started, every later command run against it."""
    port = free_port()
    serve, *clients = [re.sub(r"\b8000\b", str(port), c) for c in commands]
    server = subprocess.Popen(
        serve,
        shell=True,
        cwd=REPO,
        env=_env(cache),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, server.stderr.read()[-3000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline, "the server never answered /health"
                time.sleep(0.5)
        for client in clients:
            assert (
                "data: [DONE]" in _run(client, cache)
                if '"stream": true' in client
                else _run(client, cache)
            )
    finally:
        os.killpg(server.pid, 2)  # Ctrl-C, as a reader stops it
        server.wait(timeout=60)


def _is_ci_test_command(commands: list[str]) -> bool:
    return commands[-1].startswith("python -m pytest")


def _shallow_shapes(body: str, folder: Path) -> str:
    """A block that loads a real shape folder (configs/shapes/, random weights) gets a copy with the
    same widths and two decoder layers: the same code paths and block types, a fraction of the time."""
    for name in sorted(set(re.findall(r"configs/shapes/[\w.-]+", body))):
        config = json.loads((REPO / name / "config.json").read_text())
        copy = folder / Path(name).name
        copy.mkdir(parents=True, exist_ok=True)
        shallow = {**config, "num_hidden_layers": 2}
        if "layer_types" in config:  # one per layer (transformers checks the count)
            shallow["layer_types"] = config["layer_types"][:2]
        (copy / "config.json").write_text(json.dumps(shallow))
        body = body.replace(name, str(copy))
    return body


@pytest.mark.parametrize("doc, line, lang, body", CODE, ids=[f"{d}:{n}" for d, n, _, _ in CODE])
def test_the_block_runs(doc, line, lang, body, stand_in_cache, tmp_path):
    if lang == "python":
        _run(
            f"{shlex.quote(sys.executable)} -c {shlex.quote(_shallow_shapes(body, tmp_path))}",
            stand_in_cache,
        )
        return
    commands = [c for c in _commands(body) if not c.startswith("pip install")]
    if _is_ci_test_command(commands):  # the suite itself: CI runs exactly this line
        extracted = subprocess.run(
            [
                "awk",
                "/<!-- test-command -->/{found=1; next} found && /^```/{if (inside) exit; "
                "inside=1; next} inside",
                "README.md",
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        assert doc == "README.md" and extracted.stdout.strip() == body.strip()
        return
    hardware = [c for c in commands if _needs_hardware(c)]
    for command in hardware:
        _parse_only(command)
    runnable = [
        _results_elsewhere(
            c.replace("python ", f"{shlex.quote(sys.executable)} ", 1)
            if c.startswith("python ")
            else c,
            tmp_path,
        )
        for c in commands
        if c not in hardware
    ]
    if runnable and "ssd_engine.serve" in runnable[0]:
        _run_with_server(runnable, stand_in_cache)
        return
    for command in runnable:
        _run(command, stand_in_cache)
