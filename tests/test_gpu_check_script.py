"""scripts/gpu_check.sh, checked without a GPU.

A lent GPU is rare and its time short (30 minutes a session): a flag a benchmark no longer takes, a test file
renamed or a shape folder missing would spend it on an error. So the script runs here with `python` and
`nvidia-smi` replaced by recorders, every stage, and each command it would have run is checked as far as a
machine without a GPU can: the benchmarks' own parsers take their flags (bench_synthetic's too for every run
of its sweeps, as bench.py parses them), the folders they name exist, and the pytest runs name test files that
exist with options conftest defines. Every test file with a case that only a GPU runs must be in the tests
stage, so no GPU path tested under emulation here is left out there.
"""

import importlib
import json
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "gpu_check.sh")
BENCHMARKS = os.path.join(REPO, "benchmarks")
# files that mention CUDA only to choose their CPU set-up: the placement checker emulates a GPU on the host
CPU_ONLY = {"test_placement.py"}
PATH_FLAGS = {"--model", "--draft", "--target"}


def _recorder(bin_dir, name: str, body: str) -> None:
    path = os.path.join(bin_dir, name)
    with open(path, "w") as f:
        f.write(body)
    os.chmod(path, 0o755)


def _recorded_calls(tmp_path, *stages: str) -> list[list[str]]:
    """Runs gpu_check.sh with recorders for python and nvidia-smi; the argument lists python was called with."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.jsonl"
    bin_dir.mkdir(parents=True)
    _recorder(
        bin_dir,
        "python",
        f"#!{sys.executable}\nimport json, os, sys\n"
        "with open(os.environ['GPU_CHECK_LOG'], 'a') as f:\n"
        "    f.write(json.dumps(sys.argv[1:]) + '\\n')\n",
    )
    _recorder(bin_dir, "nvidia-smi", "#!/bin/sh\necho 'recorded GPU, 81559 MiB, 0'\n")
    env = dict(
        os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", GPU_CHECK_LOG=str(log)
    )
    run = subprocess.run(
        ["bash", SCRIPT, str(tmp_path / "out"), *stages],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    # installs first: the engine itself (its kernels/ folder is mapped into the package, so PYTHONPATH alone
    # misses ssd_engine.kernels), after any carried wheels
    installs = [argv for argv in calls if argv[:2] == ["-m", "pip"]]
    assert installs and installs[-1][-2:] == ["-e", "."] and calls[: len(installs)] == installs, (
        calls
    )
    return calls[len(installs) :]


def _bench_module(script: str):
    return importlib.import_module(
        os.path.splitext(os.path.relpath(script, "benchmarks"))[0].replace(os.sep, ".")
    )


def _named_paths(argv: list[str]) -> list[str]:
    return [value for flag, value in zip(argv, argv[1:]) if flag in PATH_FLAGS]


def _conftest_options() -> set[str]:
    with open(os.path.join(REPO, "tests", "conftest.py")) as f:
        return set(re.findall(r'addoption\(\s*"(--[\w-]+)"', f.read()))


@pytest.fixture(scope="module")
def calls(tmp_path_factory) -> list[list[str]]:
    return _recorded_calls(tmp_path_factory.mktemp("gpu_check"))


def test_every_stage_runs_its_commands(calls):
    scripts = [argv[0] for argv in calls if argv[0].startswith("benchmarks/")]
    assert sum(argv[:2] == ["-m", "pytest"] for argv in calls) == 2  # eager and compiled
    assert sorted(set(scripts)) == [
        "benchmarks/bench_synthetic.py",
        "benchmarks/gpu/bench_anchor.py",
        "benchmarks/gpu/bench_auto.py",
        "benchmarks/gpu/bench_bandwidth.py",
        "benchmarks/gpu/bench_cuda_kernels.py",
        "benchmarks/gpu/bench_host_overhead.py",
        "benchmarks/gpu/profile_steps.py",
    ]
    assert len(calls) == 2 + len(scripts)  # nothing else was run


def test_benchmark_flags_parse_and_name_existing_folders(calls):
    options = _bench_module("benchmarks/suite/options.py")
    checked = 0
    for argv in calls:
        if not argv[0].startswith("benchmarks/"):
            continue
        module = _bench_module(argv[0])
        parsed = module.parse(argv[1:])  # argparse exits (SystemExit) on a flag it does not take
        missing = [
            p
            for p in _named_paths(argv[1:])
            if not os.path.isfile(os.path.join(REPO, p, "config.json"))
        ]
        assert not missing, f"{argv[0]} names folders without a config.json: {missing}"
        if argv[0].endswith("bench_synthetic.py"):
            for run in module.sweep_runs(parsed):
                assert options.parse(run["argv"]).device == "cuda", run
                checked += 1
        checked += 1
    assert checked > 10


def test_the_sweep_runs_the_grid_it_names(calls):
    """The 7B run is one SD and one SSD cell after AR; the default-shape sweep is alpha x budget SSD cells."""
    synthetic = [argv for argv in calls if argv[0] == "benchmarks/bench_synthetic.py"]
    module = _bench_module("benchmarks/bench_synthetic.py")
    modes = [
        [run["mode"] for run in module.sweep_runs(module.parse(argv[1:]))] for argv in synthetic
    ]
    assert modes[0] == ["ar", "sd", "ssd"]
    assert modes[-1].count("sd") == 3 and modes[-1].count("ssd") == 9


def test_pytest_runs_name_existing_files_and_known_options(calls):
    known = _conftest_options() | {
        "-q",
        "-v",
        "-rs",
        "-rfEs",
        "--tb",
        "--durations",
        "--timeout",
    }  # conftest's, pytest's
    # and pytest-timeout's (in the GPU image)
    with_value = {
        "-n",
        "-p",
        "-k",
        "--timeout",
    }  # options of pytest, xdist and pytest-timeout that take the next argument
    known |= with_value
    for argv in (argv for argv in calls if argv[:2] == ["-m", "pytest"]):
        files = [
            a
            for a, before in zip(argv[2:], argv[1:])
            if not a.startswith("-") and before not in with_value
        ]
        assert files and all(os.path.isfile(os.path.join(REPO, f)) for f in files), argv
        assert {a.split("=")[0] for a in argv[2:] if a.startswith("-")} <= known, argv


def test_every_test_file_with_a_gpu_case_is_in_the_tests_stage(calls):
    eager = next(
        argv for argv in calls if argv[:2] == ["-m", "pytest"] and "--compile-model" not in argv
    )
    listed = {os.path.basename(a) for a in eager if a.endswith(".py")}
    with_gpu_cases = set()
    for name in os.listdir(os.path.join(REPO, "tests")):
        if name.startswith("test_") and name.endswith(".py"):
            with open(os.path.join(REPO, "tests", name)) as f:
                if re.search(r"torch\.cuda\.(is_available|device_count)\(\)", f.read()):
                    with_gpu_cases.add(name)
    assert "test_cuda_path.py" in with_gpu_cases  # the pattern finds what it must
    assert with_gpu_cases - CPU_ONLY <= listed, sorted(with_gpu_cases - CPU_ONLY - listed)


def test_a_stage_can_run_alone_and_an_unknown_one_is_refused(tmp_path):
    assert [argv[0] for argv in _recorded_calls(tmp_path / "a", "anchor")] == [
        "benchmarks/gpu/bench_anchor.py"
    ]
    with pytest.raises(AssertionError, match="unknown stage"):
        _recorded_calls(tmp_path / "b", "tets")
