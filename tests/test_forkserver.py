"""The fork server (ssd_engine/distributed/forkserver*.py) gives a child what a fresh interpreter
started by the engine would have: the engine's current environment, import path, directory, cores,
stdout/stderr and passed fds at the same numbers; its exit code comes back like a Popen's, and a
killed child reports its signal. Dying with the engine is tests/test_process_lifetime.py's."""

import json
import os
import signal
import textwrap

import pytest

from ssd_engine.distributed import forkserver, lifeline

PROBE = textwrap.dedent("""
    import json, os, sys, time
    if __name__ == "__main__":
        from ssd_engine.distributed.lifeline import child_args
        args = child_args("probe")
        seen = dict(env=os.environ.get("PROBE_VALUE"), cwd=os.getcwd(), affinity=sorted(os.sched_getaffinity(0)),
                    parent=os.getppid(), torch_before=args["torch_before"] and "torch" in sys.modules)
        os.write(args["fd"], json.dumps(seen).encode())
        print("probe says hello", flush=True)
        time.sleep(args["sleep_s"])
        sys.exit(args["code"])
""")

pytestmark = pytest.mark.skipif(not forkserver.usable(), reason="the fork server is Linux-only")


@pytest.fixture
def probe(tmp_path, monkeypatch):
    """A child module on a PYTHONPATH set after this process's fork server may have started."""
    (tmp_path / "forkserver_probe.py").write_text(PROBE)
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    )
    monkeypatch.setenv("PROBE_VALUE", "set-after-the-server-started")
    monkeypatch.chdir(tmp_path)
    return "forkserver_probe"


def _start(module: str, **args):
    read_end, write_end = os.pipe()
    try:
        child = lifeline.start(
            module,
            {"fd": write_end, "code": 0, "sleep_s": 0, "torch_before": True, **args},
            pass_fds=(write_end,),
        )
    finally:
        os.close(write_end)
    return child, read_end


def _seen(read_end: int) -> dict:
    """What the probe wrote about itself (closes the pipe)."""
    with os.fdopen(read_end) as seen_file:
        return json.loads(seen_file.read())


def test_a_forked_child_gets_the_engines_environment_path_directory_and_fds(probe, tmp_path, capfd):
    child, read_end = _start(probe, code=3)
    assert child.wait(timeout=60) == 3 and child.poll() == 3
    seen = _seen(read_end)
    assert seen["env"] == "set-after-the-server-started"
    assert seen["cwd"] == str(tmp_path) and seen["affinity"] == sorted(os.sched_getaffinity(0))
    assert (
        seen["parent"] != os.getpid() and seen["torch_before"]
    )  # forked by the server, torch already there
    assert (
        "probe says hello" in capfd.readouterr().out
    )  # this process's stdout, as the test has it now


def test_a_killed_child_reports_its_signal_and_the_server_starts_the_next(probe):
    child, read_end = _start(probe, sleep_s=60)
    os.read(read_end, 4096)  # it is running
    os.close(read_end)
    child.kill()
    assert child.wait(timeout=30) == -signal.SIGKILL
    second, read_end = _start(probe)
    assert second.wait(timeout=60) == 0
    os.close(read_end)


def test_without_the_server_a_child_is_a_fresh_interpreter_of_this_process(probe, monkeypatch):
    monkeypatch.setenv(forkserver.ENV, "0")
    child, read_end = _start(probe, torch_before=False)
    assert child.wait(timeout=60) == 0
    assert _seen(read_end)["parent"] == os.getpid()


def test_a_fork_server_that_cannot_start_a_child_hands_it_to_a_fresh_interpreter(
    probe, monkeypatch, capfd
):
    def refuse(self, module, args, pass_fds=()):
        raise ChildProcessError("the fork server has exited")

    monkeypatch.setattr(forkserver.ForkServer, "start", refuse)
    child, read_end = _start(probe, torch_before=False)
    assert child.wait(timeout=60) == 0
    assert _seen(read_end)["parent"] == os.getpid()
    assert "starting a fresh interpreter" in capfd.readouterr().err
