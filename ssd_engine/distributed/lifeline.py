"""Child processes (SSD draft, tensor-parallel workers) die with the engine process that started
them, even on SIGKILL, in any phase: a child's entry point asks for PR_SET_PDEATHSIG on Linux (else
a thread polls). The kernel signals when the forking *thread* exits, so `start` forks from one that
lives as long as the process. Imports nothing heavy: children run it before importing torch."""

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future

from ssd_engine.distributed import forkserver
from ssd_engine.distributed.forkserver import ForkedChild

# what `start` returns: both poll, wait, terminate, kill
ChildProcess = subprocess.Popen | ForkedChild

PR_SET_PDEATHSIG = 1
WATCH_INTERVAL_S = 0.5

_spawn_requests: "queue.SimpleQueue | None" = None
_spawn_lock = threading.Lock()


def start(module: str, args: dict, pass_fds: tuple[int, ...] = ()) -> ChildProcess:
    """Parent side: run `python -m module PARENT_PID ARGS_JSON` as a process that dies with this
    one, its stdin closed and `pass_fds` open at the same numbers. Forked from this process's fork
    server where there is one (forkserver.py: torch already imported), else a fresh interpreter.
    The module's entry point must call `child_args` first."""
    if forkserver.usable():
        try:
            return forkserver.shared(start_interpreter).start(module, args, pass_fds)
        except (OSError, ChildProcessError) as error:  # e.g. a request larger than the socket takes
            print(
                f"the fork server could not start {module} ({error}); starting a fresh interpreter",
                file=sys.stderr,
                flush=True,
            )
    return start_interpreter(module, args, pass_fds)


def start_interpreter(module: str, args: dict, pass_fds: tuple[int, ...] = ()) -> subprocess.Popen:
    """`start` in a fresh interpreter, this process its parent."""
    argv = [sys.executable, "-m", module, str(os.getpid()), json.dumps(args)]
    popen_kwargs = dict(stdin=subprocess.DEVNULL, pass_fds=pass_fds)
    if threading.current_thread() is threading.main_thread():
        return subprocess.Popen(argv, **popen_kwargs)
    done: Future = Future()
    _spawner().put((argv, popen_kwargs, done))
    return done.result()


def child_args(label: str) -> dict:
    """Child side, first thing in the entry point: tie this process to its parent, return its arguments."""
    parent = int(sys.argv[1])
    die_with_parent(parent, label)
    return json.loads(sys.argv[2])


def exit_done() -> None:
    """Child side, last thing once its work ended cleanly: exit without the interpreter's slow
    teardown, which the parent's close() waits for; nothing is left to finalize (no temporary
    files or atexit work: the links are sockets and file descriptors the kernel closes)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def die_with_parent(parent: int, label: str) -> None:
    if not _kernel_kills_orphans():
        threading.Thread(
            target=_watch, args=(parent, label), daemon=True, name="parent-watch"
        ).start()
    if os.getppid() != parent:  # the parent died before the kernel knew to tell us
        _orphaned(parent, label)


def _kernel_kills_orphans() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch(parent: int, label: str) -> None:
    while os.getppid() == parent:
        time.sleep(WATCH_INTERVAL_S)
    _orphaned(parent, label)


def _orphaned(parent: int, label: str) -> None:
    print(
        f"{label} {os.getpid()}: its engine process {parent} is gone, exiting",
        file=sys.stderr,
        flush=True,
    )
    os._exit(1)


def _spawner() -> "queue.SimpleQueue":
    """The queue of the one spawner thread; it blocks forever between requests and never returns,
    so the children it forks never see their parent thread exit before the process does."""
    global _spawn_requests
    with _spawn_lock:
        if _spawn_requests is None:
            _spawn_requests = queue.SimpleQueue()
            threading.Thread(
                target=_serve_spawns, args=(_spawn_requests,), daemon=True, name="child-spawner"
            ).start()
        return _spawn_requests


def _serve_spawns(requests: "queue.SimpleQueue") -> None:
    while True:
        argv, popen_kwargs, done = requests.get()
        try:
            done.set_result(subprocess.Popen(argv, **popen_kwargs))
        except BaseException as error:  # handed to the caller's thread, which raises it
            done.set_exception(error)
