"""Triton launches (and other work a GPU runs as one kernel) as the op counter sees them: one kernel each.

A Triton kernel is one launch on a GPU whatever its host side does (under TRITON_INTERPRET=1 on
CPU, numpy copies in and out). Each launcher in `kernels/` runs inside `kernel_launch(name, *tensors)`,
so an active `OpCounter` (op_count.py) counts it as one compute op and ignores the aten ops inside, and
a `PlacementChecker` (placement.py) sees which tensors the kernel was handed.

Under the interpreter one launch runs at a time: it keeps the launch's grid in module globals, so
two threads launching at once (the SSD draft as a thread beside the target) corrupt each other.
"""
import os
import threading
from contextlib import ExitStack, contextmanager
from typing import Protocol

import torch


class LaunchListener(Protocol):
    def kernel(self, name: str, tensors: tuple[torch.Tensor, ...]):
        """A context manager: one kernel named `name`, handed `tensors`, runs inside."""


_listeners: list[LaunchListener] = []
_interpreter = threading.Lock()


class HearsLaunches:
    """Mixed into a torch mode: it hears the kernel launches while it is entered."""

    def __enter__(self):
        listen(self)
        return super().__enter__()

    def __exit__(self, *exc):
        stop_listening(self)
        return super().__exit__(*exc)


def listen(listener: LaunchListener) -> None:
    _listeners.append(listener)


def stop_listening(listener: LaunchListener) -> None:
    _listeners.remove(listener)


@contextmanager
def kernel_launch(name: str, *tensors: torch.Tensor):
    """A Triton launch: one kernel, and one launch at a time under the interpreter."""
    with ExitStack() as stack:
        if os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes"):
            stack.enter_context(_interpreter)
        stack.enter_context(one_kernel(name, *tensors))
        yield


@contextmanager
def one_kernel(name: str, *tensors: torch.Tensor):
    """Work a GPU runs as one kernel, whatever runs on the host here (a Triton launch, a collective
    that is one NCCL kernel there): the listeners hear one kernel handed `tensors`."""
    with ExitStack() as stack:
        for listener in list(_listeners):
            stack.enter_context(listener.kernel(name, tensors))
        yield
