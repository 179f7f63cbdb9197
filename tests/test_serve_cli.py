"""`python -m ssd_engine.serve` on an install without the `serve` extra: --help still works, and
starting says in one line what to install (no traceback, exit status 2). The missing packages are
simulated in a child interpreter by `sys.modules[name] = None`, which makes importing them fail."""
import os
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HIDE = "import runpy, sys\nfor name in {names!r}: sys.modules[name] = None\n" \
       "runpy.run_module('ssd_engine.serve', run_name='__main__', alter_sys=True)"


def serve_without(names: tuple[str, ...], *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-c", HIDE.format(names=names), *args], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_help_works_without_the_server_packages():
    done = serve_without(("uvicorn", "fastapi", "prometheus_client"), "--help")
    assert done.returncode == 0, done.stderr
    assert "--port" in done.stdout and "--max-pending" in done.stdout


def test_starting_without_the_server_packages_is_one_line_naming_the_install():
    done = serve_without(("uvicorn", "fastapi"), "--port", "0")
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith("error: ") and "pip install" in lines[0] and "ssd_engine[serve]" in lines[0]
    assert "uvicorn" in lines[0] and "fastapi" in lines[0]
