"""Triton launches (and other work a GPU runs as one kernel) as the op counter sees them: one kernel each.
Under TRITON_INTERPRET launches are serialised: the interpreter keeps the grid in module globals."""

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
    """Work a GPU runs as one kernel (a Triton launch, an NCCL collective): listeners hear one."""
    with ExitStack() as stack:
        for listener in list(_listeners):
            stack.enter_context(listener.kernel(name, tensors))
        yield
