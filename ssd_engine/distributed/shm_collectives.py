"""All-reduce and gather through shared memory for CPU ranks on one x86-64 machine (pinned ranks
make gloo's transport thread compete with compute). One anonymous memfd from rank 0, inherited by
its workers, freed with its last holder: a flags row (int64 per rank, a cache line each), then two
[world, capacity] float32 buffers (round parity). Weakly ordered CPUs stay on gloo."""

import mmap
import os
import platform
import threading
import time

import numpy as np
import torch

_FENCE = threading.Lock()


def supported() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64") and hasattr(os, "memfd_create")


class ShmCollectives:
    def __init__(
        self, fd: int, rank: int, world: int, capacity: int, timeout_s: float, peers_alive
    ) -> None:
        self.rank, self.world, self.capacity = rank, world, capacity
        self.timeout_s, self.peers_alive = timeout_s, peers_alive
        self._map = mmap.mmap(fd, self.nbytes(world, capacity))
        flag_bytes = 64 * world  # one cache line per rank's flag: no false sharing while spinning
        self._flags = np.frombuffer(self._map, dtype=np.int64, count=8 * world).reshape(world, 8)[
            :, 0
        ]
        self._data = [
            torch.frombuffer(
                self._map,
                dtype=torch.float32,
                count=world * capacity,
                offset=flag_bytes + parity * world * capacity * 4,
            ).view(world, capacity)
            for parity in (0, 1)
        ]
        self._round = 0

    @staticmethod
    def nbytes(world: int, capacity: int) -> int:
        return 64 * world + 2 * world * capacity * 4

    @classmethod
    def create_fd(cls, world: int, capacity: int) -> int:
        fd = os.memfd_create("ssd-engine-tp", 0)  # anonymous: the name is only a debugging label
        os.ftruncate(fd, cls.nbytes(world, capacity))
        return fd

    def fits(self, tensor: torch.Tensor) -> bool:
        return (
            tensor.device.type == "cpu"
            and tensor.dtype == torch.float32
            and tensor.numel() <= self.capacity
        )

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums the slots in rank order, so every rank holds the identical result."""
        slots = self._exchange(tensor)
        flat = tensor.view(-1)
        torch.add(slots[0], slots[1], out=flat)
        for r in range(2, self.world):
            flat.add_(slots[r])
        return tensor

    def gather_columns(self, local: torch.Tensor, width: int) -> list[torch.Tensor] | None:
        """Every rank's [R, width] (padded) slice, on rank 0; None elsewhere. The slices are views of
        the shared buffer, valid until this rank's next collective: copy (concatenate) them first."""
        slots = self._exchange(local)
        if self.rank != 0:
            return None
        return [slots[r].view(local.shape[0], width) for r in range(self.world)]

    def _exchange(self, tensor: torch.Tensor) -> torch.Tensor:
        """Publish this rank's tensor for the next round; return every rank's [world, numel] slots.
        Round n: copy into buffer[n % 2][r], fence, flags[r] = n, wait for every flag >= n. A rank
        rewrites buffer[n % 2] only in round n + 2, after every rank finished reading round n. x86
        keeps stores in order (TSO); the fence also orders a large memcpy's non-temporal stores."""
        self._round += 1
        n = tensor.numel()
        buffer = self._data[self._round % 2]
        buffer[self.rank, :n].copy_(tensor.reshape(-1))
        with _FENCE:
            pass
        self._flags[self.rank] = self._round
        self._wait_all(self._round)
        return buffer[:, :n]

    def _wait_all(self, round_: int) -> None:
        flags, spins, deadline = self._flags, 0, None
        while flags.min() < round_:
            spins += 1
            if spins % 256 == 0:
                os.sched_yield()  # another process may share this core (e.g. two engines)
            if spins % 4096 == 0:
                now = time.monotonic()
                deadline = deadline or now + self.timeout_s
                late = [r for r in range(self.world) if flags[r] < round_]
                if not self.peers_alive():
                    raise RuntimeError(f"shared-memory all-reduce: rank(s) {late} exited")
                if now > deadline:
                    raise RuntimeError(
                        f"shared-memory all-reduce: rank(s) {late} did not arrive within "
                        f"{self.timeout_s:.0f} s (distributed_timeout_s)"
                    )
