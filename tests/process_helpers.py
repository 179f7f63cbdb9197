"""The process table, read by pid, for tests that start engines in child processes and must leave
nothing running when they fail."""

import os
import select
import signal
import socket
import subprocess
import time


def state(pid: int) -> str | None:
    """/proc state letter of `pid` (R, S, Z, ...), None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    return state(pid) not in (
        None,
        "Z",
        "X",
    )  # a zombie has exited; only its parent has not reaped it


def children_of(parent: int) -> set[int]:
    """Live processes whose parent is `parent`."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == parent and fields[0] not in ("Z", "X"):
                found.add(int(entry))
    return found


def descendants_of(parent: int) -> set[int]:
    """Live processes below `parent`: its children, theirs, and so on."""
    found, frontier = set(), {parent}
    while frontier:
        frontier = set().union(*(children_of(p) for p in frontier)) - found
        found |= frontier
    return found


def command_line(pid: int) -> bytes:
    """/proc command line of `pid` (NUL-separated), b"" once it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def is_fork_server(pid: int) -> bool:
    """The engine process's fork server (ssd_engine/distributed/forkserver_main.py): it is an engine
    process's direct child; the children it forks carry its command line too, one level down."""
    return b"ssd_engine.distributed.forkserver_main" in command_line(pid)


def kill_left(processes, pids) -> None:
    """After a test: SIGKILL the session of each of `processes` (started with start_new_session=True)
    still running, and reap it, then any of `pids` still alive."""
    for process in processes:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def engine_children(parent: int) -> set[int]:
    """The engine process's live child processes (SSD draft, tensor-parallel workers), whether
    forked by its fork server or started as its own children; the idle server is not one."""
    found = set()
    for child in children_of(parent):
        found |= children_of(child) if is_fork_server(child) else {child}
    return found


def wait_for_children(
    parent: int, count: int, timeout_s: float, every_process: bool = False
) -> set[int]:
    """Poll until `parent` has at least `count` live engine children (every_process: count its fork
    server too); returns them (fewer on timeout)."""

    def found_now() -> set[int]:
        children = engine_children(parent)
        return children | children_of(parent) if every_process else children

    deadline = time.monotonic() + timeout_s
    found = found_now()
    while len(found) < count and time.monotonic() < deadline and alive(parent):
        time.sleep(0.005)  # the first moments of a child's life are the ones under test
        found = found_now()
    return found


def gone_within(pids, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while any(alive(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def free_port() -> int:
    """A port the kernel just had free on 127.0.0.1, for a child that must be told its port up front."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_line(proc: subprocess.Popen, timeout_s: float) -> str:
    """One line of the child's stdout, or "" if none came in time (never blocks past the timeout)."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    return proc.stdout.readline() if ready else ""


def kill_session(proc: subprocess.Popen, extra_pids=()) -> str:
    """Kill a child started with start_new_session=True and everything it started: its process
    group by the leader's pid (grandchildren stay in it after re-parenting), then any `extra_pids`.
    Returns what was left unread on its stderr (if piped), for a failure message."""
    for kill in [lambda: os.killpg(proc.pid, signal.SIGKILL)] + [
        lambda p=p: os.kill(p, signal.SIGKILL) for p in extra_pids if alive(p)
    ]:
        try:
            kill()
        except (ProcessLookupError, PermissionError):
            pass
    try:
        _, err = proc.communicate(timeout=10)
    # ValueError: its pipes were already read and closed
    except (
        subprocess.TimeoutExpired,
        ValueError,
    ):
        proc.kill()
        proc.wait()
        err = None
    return err or ""
