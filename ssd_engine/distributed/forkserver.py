"""Engine side of the fork server (forkserver_main.py): children forked from a process that has
already imported torch, behind a `subprocess.Popen`-like handle. One server per engine process,
started through lifeline.start (so it dies with this process) and reused; Linux only.
`SSD_ENGINE_FORKSERVER=0` starts fresh interpreters instead."""

from __future__ import annotations

import atexit
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading

# the largest message either side sends (a child's request with its environment)
MAX_PACKET = 1 << 20
ENV = "SSD_ENGINE_FORKSERVER"


def usable() -> bool:
    return (
        sys.platform.startswith("linux")
        and hasattr(socket, "send_fds")
        and os.environ.get(ENV, "1") != "0"
    )


class ForkedChild:
    """A child of the fork server, driven like a `subprocess.Popen`: pid, returncode, poll, wait,
    terminate, kill. Its exit code comes from the server, which reaps it."""

    def __init__(self, pid: int, exited: threading.Condition):
        self.pid = pid
        self.returncode: int | None = None
        self._exited = exited

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self._exited:
            if not self._exited.wait_for(lambda: self.returncode is not None, timeout):
                raise subprocess.TimeoutExpired(f"forked child {self.pid}", timeout)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:  # not yet reaped, so the pid is still this child's
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    def __init__(self, start_server) -> None:
        """`start_server(module, args, pass_fds) -> Popen`: lifeline.start, which ties the server to this process."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.process = start_server(
                "ssd_engine.distributed.forkserver_main",
                {"fd": theirs.fileno()},
                pass_fds=(theirs.fileno(),),
            )
        finally:
            theirs.close()
        self._sock = ours
        self._replies: queue.SimpleQueue = queue.SimpleQueue()
        self._request_lock = threading.Lock()
        self._exited = threading.Condition()
        self._children: dict[int, ForkedChild] = {}
        self._early_exits: dict[int, int] = {}  # reaped before its start reply was read
        self.alive = True
        threading.Thread(target=self._read, daemon=True, name="forkserver-reader").start()

    def start(self, module: str, args: dict, pass_fds: tuple[int, ...] = ()) -> ForkedChild:
        """Fork `python -m module` as the server's child, with this process's stdout, stderr,
        environment, directory and cores, and `pass_fds` at the same numbers."""
        request = dict(
            module=module,
            args=args,
            env=dict(os.environ),
            cwd=os.getcwd(),
            affinity=sorted(os.sched_getaffinity(0)),
            pass_fds=list(pass_fds),
        )
        with self._request_lock:
            if not self.alive:
                raise ChildProcessError("the fork server has exited")
            socket.send_fds(self._sock, [json.dumps(request).encode()], [1, 2, *pass_fds])
            reply = self._replies.get()
        if "started" not in reply:
            raise ChildProcessError(
                f"the fork server could not start {module}: {reply.get('failed', 'it exited')}"
            )
        pid = reply["started"]
        with self._exited:
            child = self._children[pid] = ForkedChild(pid, self._exited)
            if pid in self._early_exits:
                child.returncode = self._early_exits.pop(pid)
        return child

    def _read(self) -> None:
        while True:
            try:
                packet = self._sock.recv(MAX_PACKET)
            except OSError:
                packet = b""
            if not packet:
                return self._server_gone()
            message = json.loads(packet)
            if "exited" in message:
                with self._exited:
                    child = self._children.pop(message["exited"], None)
                    if child is None:
                        self._early_exits[message["exited"]] = message["code"]
                    else:
                        child.returncode = message["code"]
                    self._exited.notify_all()
            else:
                self._replies.put(message)

    def _server_gone(self) -> None:
        """The server exited (this process closed it, or it was killed): its children were sent
        SIGKILL by the kernel as it went (lifeline.py), and nobody is left to report them."""
        self.alive = False
        self._replies.put({})
        with self._exited:
            for child in self._children.values():
                child.returncode = -signal.SIGKILL
            self._children.clear()
            self._exited.notify_all()

    def close(self) -> None:
        """Stop the server (its idle children die with it)."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


_server: ForkServer | None = None
_server_pid: int | None = None  # the process that started it: a fork of this process starts its own
_lock = threading.Lock()


def shared(start_server) -> ForkServer:
    """This process's fork server, started on first use (or again if it has exited)."""
    global _server, _server_pid
    with _lock:
        if _server is None or _server_pid != os.getpid() or not _server.alive:
            _server, _server_pid = ForkServer(start_server), os.getpid()
            atexit.register(_server.close)
        return _server
