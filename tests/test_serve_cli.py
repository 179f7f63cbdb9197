"""`python -m ssd_engine.serve` on an install without the `serve` extra: --help still works, and
starting says in one line what to install (no traceback, exit status 2). The missing packages are
simulated in a child interpreter by `sys.modules[name] = None`, which makes importing them fail.
A real server says at start how its engine runs (`[engine]`) and what unset sampling fields take
(`[sampling]`); a first Ctrl-C says it drains the requests in flight and lets them finish, a second
stops at once."""

import http.client
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HIDE = (
    "import runpy, sys\nfor name in {names!r}: sys.modules[name] = None\n"
    "runpy.run_module('ssd_engine.serve', run_name='__main__', alter_sys=True)"
)


def serve_without(names: tuple[str, ...], *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, "-c", HIDE.format(names=names), *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_help_works_without_the_server_packages():
    done = serve_without(("uvicorn", "fastapi", "prometheus_client"), "--help")
    assert done.returncode == 0, done.stderr
    assert "--port" in done.stdout and "--max-pending" in done.stdout


def test_starting_without_the_server_packages_is_one_line_naming_the_install():
    done = serve_without(("uvicorn", "fastapi"), "--port", "0")
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert (
        lines[0].startswith("error: ")
        and "pip install" in lines[0]
        and "ssd_engine[serve]" in lines[0]
    )
    assert "uvicorn" in lines[0] and "fastapi" in lines[0]


# ---- a real server: what it says at start, and Ctrl-C ------------------------------------------------------
class Served:
    """`python -m ssd_engine.serve` on 127.0.0.1, a kernel-picked port (`args`: more flags; `env`: more variables);
    its stderr and stdout (uvicorn's access log), merged, read line by line on a thread and kept in `said`."""

    def __init__(self, model: str, *args: str, env: dict | None = None) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ssd_engine.serve",
                "--model",
                model,
                "--port",
                "0",
                "--served-model-name",
                "tiny",
                *args,
            ],
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={
                **{k: v for k, v in os.environ.items() if k != "SSD_ENGINE_API_KEY"},
                "SSD_ENGINE_PROGRESS": "0",
                **(env or {}),
            },
        )
        self.lines: queue.SimpleQueue = queue.SimpleQueue()
        self.said: list[str] = []
        self.reader = threading.Thread(
            target=lambda: [
                (self.said.append(line), self.lines.put(line)) for line in self.proc.stdout
            ],
            daemon=True,
        )
        self.reader.start()
        self.before_start: list[str] = []
        try:
            line = self.wait_for("running on http://127.0.0.1:", self.before_start)
        except AssertionError:
            self.close()
            raise
        self.port = int(re.search(r"127\.0\.0\.1:(\d+)", line).group(1))

    def wait_for(self, needle: str, seen: list | None = None, timeout: float = 120) -> str:
        deadline, said = time.time() + timeout, []
        while time.time() < deadline:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.time()))
            except queue.Empty:
                break
            said.append(line)
            if seen is not None:
                seen.append(line)
            if needle in line:
                return line
        raise AssertionError(f"the server never said {needle!r}; it said {said}")

    def stream(self, max_tokens: int):
        """A greedy stream that ignores EOS, its first chunk already read (the request is in flight)."""
        body = json.dumps(
            {
                "model": "tiny",
                "prompt": "hello",
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
        ).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/completions",
            body,
            {"Content-Type": "application/json"},
        )
        response = urllib.request.urlopen(request, timeout=60)
        assert response.readline().startswith(b"data: ")
        return response

    def stop(self) -> str:
        """A Ctrl-C, then everything the server said from start to exit."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.close()
        self.reader.join(timeout=30)
        return "".join(self.said)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def test_start_prints_the_engine_line_and_the_sampling_defaults(tiny_qwen2):
    """As the generate CLI does: how the engine runs (mode chosen, formats, predictions), and what a request's
    unset sampling fields take; both before uvicorn says where it listens."""
    served = Served(tiny_qwen2)
    try:
        engine = [line for line in served.before_start if line.startswith("[engine] ")]
        assert len(engine) == 1 and "mode=" in engine[0] and "device=cpu" in engine[0], (
            served.before_start
        )
        sampling = [line for line in served.before_start if line.startswith("[sampling] ")]
        assert (
            len(sampling) == 1
            and "temperature=1.0" in sampling[0]
            and "temperature=0 is greedy" in sampling[0]
        )
        # no API key on loopback: as before, nothing said about access
        assert not [line for line in served.before_start if "API key" in line], served.before_start
    finally:
        served.close()


@pytest.fixture(scope="module")
def long_context(tiny_model_dir) -> str:
    """A tiny model with room for streams long enough to still run when the Ctrl-C lands, however fast the
    machine (4096 positions)."""
    return tiny_model_dir("qwen2", max_position_embeddings=4096)


def test_first_ctrl_c_says_it_drains_and_lets_the_stream_finish(long_context):
    served = Served(long_context)
    try:
        response = served.stream(max_tokens=1000)
        served.proc.send_signal(signal.SIGINT)
        line = served.wait_for("[serve] stopping")
        assert "draining 1 in-flight request first" in line and "Ctrl-C again" in line, line
        rest = response.read().decode()
        assert rest.rstrip().endswith("data: [DONE]") and '"finish_reason": "length"' in rest
        assert served.proc.wait(timeout=60) == 0
    finally:
        served.close()


def test_second_ctrl_c_stops_at_once(long_context):
    served = Served(long_context)
    try:
        response = served.stream(max_tokens=4000)
        served.proc.send_signal(signal.SIGINT)
        served.wait_for("[serve] stopping")
        served.proc.send_signal(signal.SIGINT)
        started = time.time()
        assert served.proc.wait(timeout=60) == 0
        assert time.time() - started < 30
        try:
            rest = response.read().decode()
        except (OSError, http.client.HTTPException):  # the connection was cut mid-response
            rest = ""
        assert "data: [DONE]" not in rest  # the stream was cut, not finished
    finally:
        served.close()
