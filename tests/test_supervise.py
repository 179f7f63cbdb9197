"""distributed/supervise.py on its own: waiting for children fails fast on an exit and at the
deadline on a hang (killing and reaping them), and stop() escalates only as far as it must."""

import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from ssd_engine.distributed import supervise


def _child(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL)


def test_wait_ready_returns_once_every_child_announced_itself():
    store = dist.HashStore()
    children = [
        supervise.Child(f"child {i}", _child("import time; time.sleep(30)"), f"up/{i}")
        for i in range(2)
    ]
    try:
        for i in range(2):
            supervise.announce_ready(store, f"up/{i}")
        supervise.wait_ready(store, children, timeout_s=5)
        assert all(c.process.poll() is None for c in children)
    finally:
        for c in children:
            supervise.stop(c.process)


def test_a_child_exiting_while_starting_fails_at_once_and_the_others_are_reaped():
    hung = supervise.Child("hung child", _child("import time; time.sleep(30)"), "up/hung")
    dead = supervise.Child("dead child", _child("raise SystemExit(3)"), "up/dead")
    store = dist.HashStore()
    supervise.announce_ready(store, "up/hung")  # the first is up, the second never comes
    started = time.monotonic()
    with pytest.raises(
        ValueError, match=r"dead child \(pid \d+\) exited with code 3 while starting"
    ):
        supervise.wait_ready(store, [hung, dead], ValueError, timeout_s=20)
    assert time.monotonic() - started < 10
    assert hung.process.returncode is not None  # killed and reaped


def test_a_hung_child_fails_at_the_deadline_and_is_reaped():
    hung = supervise.Child("hung child", _child("import time; time.sleep(30)"), "up/hung")
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="hung child did not start within 1 s"):
        supervise.wait_ready(dist.HashStore(), [hung], timeout_s=1)
    assert 1 <= time.monotonic() - started < 5 and hung.process.returncode is not None


def test_stop_escalates_only_as_far_as_it_must():
    exits = _child("import time; time.sleep(0.2)")
    supervise.stop(exits, exit_s=10, term_s=3)
    assert exits.returncode == 0  # exited by itself: never signalled
    ignores_term = _child(
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(30)"
    )
    time.sleep(0.5)  # let it install its handler
    started = time.monotonic()
    supervise.stop(ignores_term, exit_s=0.1, term_s=0.5)
    assert (
        ignores_term.returncode == -9 and time.monotonic() - started < 5
    )  # SIGTERM ignored, then SIGKILL
    killed = _child("import time; time.sleep(30)")
    supervise.stop(killed)
    assert killed.returncode == -9
