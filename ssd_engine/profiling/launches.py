"""Triton launches as the op counter sees them: one kernel each.

A Triton kernel is one launch on a GPU whatever its host side does (under TRITON_INTERPRET=1 on
CPU, numpy copies in and out). Each launcher in `kernels/` runs inside `kernel_launch(name)`, so an
active `OpCounter` (op_count.py) counts it as one compute op and ignores the aten ops inside.
"""
from contextlib import contextmanager
from typing import Protocol


class LaunchListener(Protocol):
    def kernel(self, name: str):
        """A context manager: one kernel named `name` runs inside."""


_listeners: list[LaunchListener] = []


def listen(listener: LaunchListener) -> None:
    _listeners.append(listener)


def stop_listening(listener: LaunchListener) -> None:
    _listeners.remove(listener)


@contextmanager
def kernel_launch(name: str):
    if not _listeners:
        yield
        return
    with _listeners[-1].kernel(name):
        yield
