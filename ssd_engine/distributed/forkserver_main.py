"""`python -m ssd_engine.distributed.forkserver_main PARENT_PID ARGS_JSON`: the engine process's fork server.
It imports torch once and forks each child the engine asks for; it dies with the engine
(lifeline.py), each child with it. Only modules whose import reads no engine setting load before a
fork: a child reads its environment (sent with the request) when it imports the engine."""

import json
import os
import select
import signal
import socket
import sys
import traceback

from ssd_engine.distributed.forkserver import MAX_PACKET

MAX_FDS = 16


def serve(sock: socket.socket) -> None:
    """One SOCK_SEQPACKET packet per child: JSON {module, args, env, cwd, affinity, pass_fds},
    with the engine's stdout, stderr and pass_fds as SCM_RIGHTS. Answers {"started": pid} or
    {"failed": why} in order, later {"exited": pid, "code": Popen-style returncode} per reaped
    child. Returns at EOF."""
    # Ctrl-C reaches the whole group: the engine stops us
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    while True:
        ready, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in ready:
            while os.read(wake_r, 4096) == 4096:
                pass
        _reap(sock)
        if sock in ready:
            packet, fds, _, _ = socket.recv_fds(sock, MAX_PACKET, MAX_FDS)
            if not packet:
                return
            _fork(sock, json.loads(packet), fds, (wake_r, wake_w))


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(sock, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def _fork(sock: socket.socket, request: dict, fds: list[int], own_fds: tuple[int, ...]) -> None:
    try:
        pid = os.fork()
    except OSError as error:
        _send(sock, {"failed": f"fork: {error}"})
        pid = None
    if pid == 0:
        _become_child(request, fds, [sock.detach(), *own_fds])
    for fd in fds:
        os.close(fd)
    if pid is not None:
        _send(sock, {"started": pid})


def _send(sock: socket.socket, message: dict) -> None:
    try:
        sock.send(json.dumps(message).encode())
    except OSError:  # the engine is gone: the next receive reads EOF
        pass


def _become_child(request: dict, fds: list[int], server_fds: list[int]) -> None:
    """In the forked child: the engine's stdio, fds, environment, directory and cores, then the
    module run as `__main__` as `python -m module SERVER_PID ARGS_JSON` would run it. Never returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # what a fresh interpreter has
        for fd in server_fds:
            os.close(fd)
        _place_fds(fds, [1, 2, *request["pass_fds"]])
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        _set_import_path(request["cwd"], request["env"].get("PYTHONPATH", ""))
        os.sched_setaffinity(0, request["affinity"])
        sys.argv = [request["module"], str(os.getppid()), json.dumps(request["args"])]
        import runpy

        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    # as the interpreter ends it: None is 0, an int itself, else printed and 1
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def _set_import_path(cwd: str, pythonpath: str) -> None:
    """sys.path as `python -m` started in `cwd` with this PYTHONPATH would begin it."""
    entries = [cwd, *filter(None, pythonpath.split(os.pathsep))]
    sys.path[:] = entries + [entry for entry in sys.path[1:] if entry not in entries]


def _place_fds(received: list[int], targets: list[int]) -> None:
    """Put received[i] at fd number targets[i]; no target overwrites a received fd not yet placed."""
    floor = max([*received, *targets]) + 1
    moved = [os.dup2(fd, floor + i) for i, fd in enumerate(received)]  # above every number in play
    for fd in received:
        os.close(fd)
    for fd, target in zip(moved, targets):
        os.dup2(fd, target)
        os.close(fd)


if __name__ == "__main__":
    from ssd_engine.distributed.lifeline import child_args

    args = child_args(
        "fork server"
    )  # before anything slow: from here on we die with the engine process

    import numpy  # noqa: F401  (what every child imports first, once)
    import torch  # noqa: F401

    serve(socket.socket(fileno=args["fd"]))
    os._exit(0)
