"""`serve --data-parallel-size N`: engine replicas behind one OpenAI endpoint on Ray Serve
(ssd_engine/server/replicas.py). Two tiny replicas on localhost, one core each, answer concurrent
streamed and plain requests with one engine's greedy texts, also when one of them is killed while
requests run on it (server/relay.py retries them on the other); /metrics holds both replicas' samples,
labelled, and counts the restart; Ctrl-C stops them and the Ray cluster
the server started, leaving no process behind. With `--ray-address` on a two-node cluster (two
`ray start` on this host, one CPU each), each node runs one replica. Without ray, N > 1 is one line
naming the extra."""

import collections
import concurrent.futures
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import pytest
from process_helpers import alive, command_line, descendants_of, free_port, gone_within, kill_left

from ssd_engine import LLM, SamplingParams
from ssd_engine.server.replicas import replica_core_sets, serve_replicas

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = [f"hello {i}" for i in range(6)]
LONG_PROMPTS, LONG_TOKENS = (
    [f"tell me {i}" for i in range(8)],
    300,
)  # about a second on two tiny replicas


def test_replicas_split_the_cores_and_need_one_each():
    assert replica_core_sets(2, "0,1,2,3") == [[0, 1], [2, 3]]
    assert replica_core_sets(2, "0;1,2,3") == [[0], [1, 2, 3]]  # one set per replica: as given
    with pytest.raises(ValueError, match="needs a core per replica"):
        replica_core_sets(3, "0,1")


def test_without_ray_more_than_one_replica_names_the_extra(monkeypatch):
    monkeypatch.setitem(
        sys.modules, "ray", None
    )  # importing ray fails, as where it is not installed
    with pytest.raises(
        ValueError, match=r"runs on Ray Serve, which is not installed: pip install -e \"\.\[ray\]\""
    ):
        serve_replicas(2, LLM, str, {}, "tiny", "127.0.0.1", 0, None, False, 8, None)


def test_a_replica_count_below_one_is_refused():
    done = subprocess.run(
        [sys.executable, "-m", "ssd_engine.serve", "--model", "x", "--data-parallel-size", "0"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        done.returncode == 2
        and done.stderr.strip() == "error: --data-parallel-size must be >= 1, got 0"
    )


def _replica_pid(proc: subprocess.Popen, said: list[str], deadline: float) -> int:
    """A replica's process id, from the line its engine prints through Ray's log ("(... pid=N) [replica r]")."""

    def found() -> re.Match | None:
        return next(
            filter(None, (re.search(r"pid=(\d+)\).*\[replica \d+\]", line) for line in said)), None
        )

    assert _read_until(proc, proc.stderr, found, said, deadline), "".join(said[-30:])
    return int(found().group(1))


def _client(openai, port: int):
    """An OpenAI client of the endpoint whose response types are built before threads share it: the
    client builds them on first use, and first uses racing in threads can fail in pydantic's deferred
    schema build ("BaseModel cannot be instantiated directly", seen once in six runs)."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
    client.completions.create(model="tiny", prompt="warm", max_tokens=1, temperature=0)
    return client


def _exit_code(proc: subprocess.Popen, timeout: float = 120) -> int | None:
    """The process's exit code, or None if it is still running after `timeout` seconds."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


def _scrape(port: int) -> collections.Counter:
    """(sample name, replica) -> value summed over the sample's other labels, from the endpoint's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        text = response.read().decode()
    found = collections.Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, sample.labels.get("replica"))] += sample.value
    return found


def test_two_replicas_serve_one_engines_texts_and_stop_cleanly(tiny_qwen2):
    if not os.environ.get("CI"):  # CI installs the test extra, ray with it: its absence fails there
        pytest.importorskip("ray.serve", reason="the ray extra: pip install -e '.[ray]'")
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("two replicas need a core each")
    openai = pytest.importorskip("openai")
    greedy = SamplingParams(temperature=0, max_tokens=8)
    long = SamplingParams(temperature=0, max_tokens=LONG_TOKENS, ignore_eos=True)
    with LLM(tiny_qwen2, num_threads=1) as llm:  # as each replica runs: one core, one thread
        expected = [o.text for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
        expected_long = [o.text for o in llm.generate(LONG_PROMPTS, long, use_tqdm=False)]
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ssd_engine.serve",
            "--model",
            tiny_qwen2,
            "--port",
            str(port),
            "--served-model-name",
            "tiny",
            "--data-parallel-size",
            "2",
            "--cpu-cores",
            "0;1",
        ],
        cwd=REPO_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "SSD_ENGINE_PROGRESS": "0", "RAY_USAGE_STATS_ENABLED": "0"},
    )
    started: set[int] = set()
    try:
        # read by a thread throughout: Ray forwards the replicas' logs to the server's stderr, and a
        # full pipe would block the server mid-shutdown
        deadline = time.monotonic() + 240
        said = _started_server_says(proc, deadline)
        started = descendants_of(proc.pid)
        client = _client(openai, port)

        def plain(prompt: str) -> str:
            return (
                client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
                .choices[0]
                .text
            )

        def streamed(prompt: str) -> str:
            chunks = client.completions.create(
                model="tiny", prompt=prompt, max_tokens=8, temperature=0, stream=True
            )
            return "".join(chunk.choices[0].text for chunk in chunks)

        # a stream's first use in this thread too, before threads share the client (_client)
        assert plain(PROMPTS[0]) == expected[0] and streamed(PROMPTS[0]) == expected[0]
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            assert list(pool.map(plain, PROMPTS)) == expected
            assert list(pool.map(streamed, PROMPTS)) == expected
        assert {m.id for m in client.models.list().data} == {"tiny"}

        # a replica killed while requests run on it: the ones it had not begun to answer are retried
        # on the other (where the kill lands before any reached it, they simply run there)
        victim = _replica_pid(proc, said, deadline)

        def long_plain(prompt: str) -> str:
            return (
                client.completions.create(
                    model="tiny",
                    prompt=prompt,
                    max_tokens=LONG_TOKENS,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )
                .choices[0]
                .text
            )

        with concurrent.futures.ThreadPoolExecutor(len(LONG_PROMPTS)) as pool:
            answers = [pool.submit(long_plain, prompt) for prompt in LONG_PROMPTS]
            time.sleep(0.5)
            os.kill(victim, signal.SIGKILL)
            assert [answer.result() for answer in answers] == expected_long

        # /metrics, whichever replica answers it: both replicas' samples, each labelled, both up again
        # once Ray Serve has restarted the killed one, which counts one restart
        def total(name: str, scraped: collections.Counter) -> float:
            return sum(scraped[(name, replica)] for replica in ("0", "1"))

        while (
            total("ssd_replica_restarts_total", scraped := _scrape(port)) < 1
            or total("ssd_replica_up", scraped) < 2
        ):
            assert time.monotonic() < deadline + 60, scraped
            time.sleep(0.5)
        assert (
            total("ssd_requests_total", scraped) >= 1 and scraped[("ssd_requests_total", None)] == 0
        )
        started |= descendants_of(proc.pid)
        os.killpg(proc.pid, signal.SIGINT)
        assert _exit_code(proc) == 0, "".join(said[-30:])
        assert gone_within(started, 30), [p for p in started if alive(p)]
    finally:
        kill_left([proc], started)


# ---------------------------------------------------------------- a two-node cluster on one host

RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "SSD_ENGINE_PROGRESS": "0"}


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _ray_node(args: list[str], ready: str, deadline: float) -> subprocess.Popen:
    """`ray start ... --block` as a child in its own session; returns once it printed `ready`."""
    node = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ray.scripts.scripts",
            "start",
            "--block",
            "--num-cpus",
            "1",
            "--node-ip-address",
            "127.0.0.1",
            "--disable-usage-stats",
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, **RAY_ENV, "PYTHONUNBUFFERED": "1"},
        # a Ctrl-C reaches a terminal's `ray start` with SIGINT's default action, also where this
        # suite runs in the background (which leaves it ignored, and Ray sets no handler of its own)
        preexec_fn=_sigint_default,
    )  # its lines as it prints them
    said: list[str] = []
    if not _read_until(
        node, node.stdout, lambda: any(ready in line for line in said), said, deadline
    ):
        os.killpg(node.pid, signal.SIGKILL)
        node.wait()
        raise AssertionError("a Ray node did not start:\n" + "".join(said[-30:]))
    return node


def _read_until(proc: subprocess.Popen, stream, done, said: list[str], deadline: float) -> bool:
    """Collect `stream`'s lines into `said` (a reader thread, started once per list) until done()
    (True), the deadline or the process's exit (False)."""
    if not said:
        said.append("")
        threading.Thread(target=lambda: said.extend(stream), daemon=True).start()
    while not done():
        if time.monotonic() > deadline or proc.poll() is not None:
            return False
        time.sleep(0.1)
    return True


def _started_server_says(server: subprocess.Popen, deadline: float) -> list[str]:
    """Waits for the server's "2 replicas" line; -> its stderr lines, which a thread keeps reading."""
    said: list[str] = []
    assert _read_until(
        server,
        server.stderr,
        lambda: any(line.startswith("[serve] 2 replicas on Ray Serve") for line in said),
        said,
        deadline,
    ), "".join(said[-30:])
    return said


def _is_engine_replica(pid: int) -> bool:
    """A Ray worker process running an engine replica (Ray names it after the deployment)."""
    return command_line(pid).startswith(b"ray::ServeReplica:ssd_engine:engine")


def test_two_replicas_on_a_two_node_cluster_one_per_node(tiny_qwen2):
    """`--ray-address` joins a cluster of two nodes (each `ray start`, one CPU) and Ray Serve places
    one replica on each; both answer with one engine's texts."""
    if not os.environ.get("CI"):
        pytest.importorskip("ray.serve", reason="the ray extra: pip install -e '.[ray]'")
    openai = pytest.importorskip("openai")
    greedy = SamplingParams(temperature=0, max_tokens=8)
    with LLM(tiny_qwen2, num_threads=1) as llm:
        expected = [o.text for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    deadline = time.monotonic() + 240
    gcs, port = free_port(), free_port()
    address = f"127.0.0.1:{gcs}"
    processes: list[subprocess.Popen] = []
    started: set[int] = set()
    # Ray's session folder holds unix sockets, whose paths must stay under 108 bytes: a short folder
    ray_dir = tempfile.TemporaryDirectory(prefix="ray-", ignore_cleanup_errors=True)
    try:
        processes.append(
            _ray_node(
                [
                    "--head",
                    "--port",
                    str(gcs),
                    "--include-dashboard",
                    "false",
                    "--temp-dir",
                    ray_dir.name,
                ],
                "Ray runtime started",
                deadline,
            )
        )
        processes.append(_ray_node(["--address", address], "Ray runtime started", deadline))
        nodes = {"head": processes[0].pid, "second": processes[1].pid}
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ssd_engine.serve",
                "--model",
                tiny_qwen2,
                "--port",
                str(port),
                "--served-model-name",
                "tiny",
                "--data-parallel-size",
                "2",
                "--num-threads",
                "1",
                "--ray-address",
                address,
            ],
            cwd=REPO_ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            env={**os.environ, **RAY_ENV},
        )
        processes.append(server)
        said = _started_server_says(server, deadline)
        # each node's raylet starts its workers: a replica's process is below the `ray start` of its node
        replicas = {
            node: [pid for pid in descendants_of(node_pid) if _is_engine_replica(pid)]
            for node, node_pid in nodes.items()
        }
        assert [len(pids) for pids in replicas.values()] == [1, 1], replicas

        client = _client(openai, port)
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            texts = pool.map(
                lambda p: (
                    client.completions.create(model="tiny", prompt=p, max_tokens=8, temperature=0)
                    .choices[0]
                    .text
                ),
                PROMPTS,
            )
            assert list(texts) == expected
        started = set().union(*(descendants_of(p.pid) for p in processes))
        os.killpg(server.pid, signal.SIGINT)
        assert _exit_code(server) == 0, "".join(said[-30:])
        # the second node, then the head: Ctrl-C stops what each started
        for node in reversed(processes[:2]):
            os.killpg(node.pid, signal.SIGINT)
            node.wait(timeout=60)
        assert gone_within(started, 30), [p for p in started if alive(p)]
    finally:
        kill_left(processes, started)
        ray_dir.cleanup()
