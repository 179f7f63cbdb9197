"""Shared memory for the SSD reply where payloads cross host memory anyway (CPU, or a shared GPU):
the draft encodes in place, the coordinator decodes in place, and gloo (TCP) carries only the size.
One anonymous memfd the draft inherits, freed when the last holder exits; pages are allocated on
first touch. Ordering: the draft writes, then sends the size by system call, which orders memory;
it rewrites the window only for the next request, sent after the coordinator copied this reply."""

import mmap
import os

import torch


def supported() -> bool:
    return hasattr(os, "memfd_create")


class ReplyWindow:
    def __init__(self, fd: int, capacity: int) -> None:
        self.capacity = capacity
        self._map = mmap.mmap(fd, capacity)
        self.buffer = torch.frombuffer(self._map, dtype=torch.uint8, count=capacity)

    @staticmethod
    def create_fd(capacity: int) -> int:
        fd = os.memfd_create("ssd-engine-reply", 0)
        os.ftruncate(fd, capacity)
        return fd

    def fits(self, size: int) -> bool:
        return size <= self.capacity

    def holds(self, frame: torch.Tensor) -> bool:
        """`frame` is already the window's start (the draft encoded into it)."""
        return frame.data_ptr() == self.buffer.data_ptr()
