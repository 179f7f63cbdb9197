"""Start, await and stop the engine's child processes (tensor-parallel workers, the SSD draft): each
starts through lifeline.py, finds this process through a TCPStore hosted here and sets its
readiness key there; a child that exits or hangs while starting fails the wait, reaping all."""

import datetime
import os
import subprocess
import time
from dataclasses import dataclass
from typing import Protocol

import torch.distributed as dist

from ssd_engine.distributed import lifeline

STARTUP_TIMEOUT_S = 300.0
POLL_S = 0.02


class ReadinessStore(Protocol):
    def check(self, keys: list[str]) -> bool: ...


@dataclass
class Child:
    name: str  # how errors name it: "SSD draft process", "tensor-parallel worker rank 1"
    process: lifeline.ChildProcess
    ready_key: str  # set in the store by the child once it is up


def host_store(world_size: int) -> dist.TCPStore:
    """Parent side: the store the children join (pass them its `.port`)."""
    return dist.TCPStore(
        "127.0.0.1",
        0,
        world_size,
        True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S),
    )


def start(
    name: str, module: str, args: dict, ready_key: str, pass_fds: tuple[int, ...] = ()
) -> Child:
    """Parent side: run `python -m module` (see lifeline.start)."""
    return Child(name, lifeline.start(module, args, pass_fds), ready_key)


def wait_ready(
    store: ReadinessStore,
    children: list[Child],
    error: type[Exception] = RuntimeError,
    timeout_s: float = STARTUP_TIMEOUT_S,
) -> None:
    """Parent side: return once every child has set its key; else kill them all and raise `error`."""
    deadline = time.monotonic() + timeout_s
    try:
        for child in children:
            while not store.check([child.ready_key]):
                if child.process.poll() is not None:
                    raise error(
                        f"{child.name} (pid {child.process.pid}) exited with code "
                        f"{child.process.returncode} while starting (its traceback is above)"
                    )
                if time.monotonic() > deadline:
                    raise error(f"{child.name} did not start within {timeout_s:.0f} s")
                time.sleep(POLL_S)
    except BaseException:
        for child in children:
            stop(child.process)
        raise


def stop(process: lifeline.ChildProcess, exit_s: float = 0.0, term_s: float | None = None) -> None:
    """Parent side: end and reap `process`. It gets `exit_s` to exit by itself (it was asked to),
    then, when `term_s` is given, SIGTERM and `term_s` more, then SIGKILL."""
    steps = [(None, exit_s)]
    if term_s is not None:
        steps.append((process.terminate, term_s))
    steps.append((process.kill, None))
    for send, wait_s in steps:
        if send is not None:
            send()
        try:
            process.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def join_store(port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    """Child side: connect to the parent's store."""
    return dist.TCPStore(
        "127.0.0.1", port, world_size, False, timeout=datetime.timedelta(seconds=timeout_s)
    )


def announce_ready(store: dist.TCPStore, ready_key: str) -> None:
    """Child side: the parent's wait_ready returns once every child did this."""
    store.set(ready_key, str(os.getpid()))
