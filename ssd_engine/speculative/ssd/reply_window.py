"""Shared memory for the SSD reply, when the draft process's payloads would cross through host
memory anyway (CPU, or a draft sharing the coordinator's GPU).

Why: gloo carries payloads over TCP on loopback. A reply with whole q rows (T > 0 without top_k:
K x vocab floats a sequence, 2.4 MB at batch 1 and 19 MB at batch 8 for the default pair) crosses
this window 3-5x faster than through gloo (benchmarks/micro/bench_reply_window.py measures both). The draft encodes the reply in place, the
coordinator decodes it in place, and gloo carries only its size.

Where the memory lives: one anonymous memfd the coordinator creates and the draft process inherits
(`pass_fds`): no name anywhere, freed by the kernel when the last holder exits. Blocks are
allocated as a reply first touches them, so sizing it for the largest possible reply costs nothing
until one is sent. Ordering: the draft writes the reply, then sends its size; the coordinator
reads it after receiving that size, and both are system calls, which order memory on every
architecture. The draft rewrites the window only for the next request's reply, and the coordinator
has copied this reply's rows into its proposal before it sends that request.
"""
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
        fd = os.memfd_create("ssd-engine-reply", 0)  # anonymous: the name is only a debugging label
        os.ftruncate(fd, capacity)
        return fd

    def fits(self, size: int) -> bool:
        return size <= self.capacity

    def holds(self, frame: torch.Tensor) -> bool:
        """`frame` is already the window's start (the draft encoded into it)."""
        return frame.data_ptr() == self.buffer.data_ptr()
