"""The server processes the serving benchmarks start: a free local port to give one, and stopping
one as its user would (Ctrl-C, then a kill if it does not end)."""

import os
import signal
import socket
import subprocess


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def interrupt(proc: subprocess.Popen, timeout_s: float = 60.0, group: bool = False) -> None:
    """SIGINT to the server (to its whole process group with `group`: Ray's workers too), SIGKILL
    if it has not ended after `timeout_s`; reaped either way."""
    send = (lambda sig: os.killpg(proc.pid, sig)) if group else proc.send_signal
    send(signal.SIGINT)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        send(signal.SIGKILL)
        proc.wait()
