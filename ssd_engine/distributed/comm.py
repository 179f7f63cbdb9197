"""Process groups of one tensor-parallel model and its collectives, built from the engine's own
store (never a default group): `data` (forward all-reduce, logits gather; NCCL or gloo, with a
deadline so a stuck rank raises) and `control` (gloo; rank 0's pickled commands, awaited between
requests, so its deadline is long). CPU ranks on one x86 machine add shm_collectives.py."""

import datetime
import pickle

import torch
import torch.distributed as dist

from ssd_engine.distributed.shm_collectives import ShmCollectives
from ssd_engine.utils.launches import one_kernel

IDLE_TIMEOUT = datetime.timedelta(days=7)
COMMAND_BYTES = 4096  # one broadcast carries a command this size; a longer one takes a second
SHM_CAPACITY = 4 * 2**20  # floats per rank and buffer: decode/verify activations and most logits


class TPGroup:
    """Rank, size and collectives of one tensor-parallel model; size 1 needs no processes."""

    def __init__(
        self,
        rank: int = 0,
        size: int = 1,
        data=None,
        control=None,
        shm: ShmCollectives | None = None,
    ) -> None:
        self.rank, self.size = rank, size
        self._data, self._control, self.shm = data, control, shm

    @classmethod
    def single(cls) -> "TPGroup":
        return cls()

    @classmethod
    def create(
        cls,
        store,
        rank: int,
        size: int,
        device: torch.device,
        timeout_s: float,
        loopback: bool,
        shm_fd: int | None = None,
        peers_alive=None,
    ) -> "TPGroup":
        shm = None
        if shm_fd is not None and device.type == "cpu":
            shm = ShmCollectives(
                shm_fd, rank, size, SHM_CAPACITY, timeout_s, peers_alive or (lambda: True)
            )
        timeout = datetime.timedelta(seconds=timeout_s)
        control = _gloo(dist.PrefixStore("control", store), rank, size, timeout, loopback)
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            data = dist.ProcessGroupNCCL(dist.PrefixStore("data", store), rank, size, options)
        else:
            data = _gloo(dist.PrefixStore("data", store), rank, size, timeout, loopback)
        control.set_timeout(IDLE_TIMEOUT)
        return cls(rank, size, data, control, shm)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            with one_kernel("all_reduce", tensor):  # one NCCL kernel on a GPU, in place
                if self.shm is not None and tensor.is_contiguous() and self.shm.fits(tensor):
                    return self.shm.all_reduce(tensor)
                self._data.allreduce([tensor]).wait()
        return tensor

    def gather_columns(self, local: torch.Tensor, sizes: list[int]) -> torch.Tensor | None:
        """Concatenate every rank's [R, sizes[rank]] slice along columns on rank 0 (None elsewhere).
        Collectives want equal shapes, so slices travel padded to the largest."""
        if self.size == 1:
            return local
        width = max(sizes)
        padded = (
            local
            if local.shape[1] == width
            else torch.nn.functional.pad(local, (0, width - local.shape[1]))
        )
        padded = padded.contiguous()
        if self.shm is not None and self.shm.fits(padded):
            parts = self.shm.gather_columns(padded, width)
        else:
            options = dist.GatherOptions()
            options.rootRank = 0
            outputs = (
                [[torch.empty_like(padded) for _ in range(self.size)]] if self.rank == 0 else []
            )
            self._data.gather(outputs, [padded], options).wait()
            parts = outputs[0] if self.rank == 0 else None
        if parts is None:
            return None
        return torch.cat([part[:, :size] for part, size in zip(parts, sizes)], dim=1)

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's `tensor` into every rank's (same shape and dtype) over the data group: on a GPU
        it stays on the device, queued like the all-reduces (no host read)."""
        if self.size > 1:
            self._data.broadcast([tensor], _root0()).wait()
        return tensor

    def send_command(self, method: str, *args) -> None:
        """Rank 0: broadcast one command to every worker (a length, then the pickled bytes)."""
        data = pickle.dumps((method, args))
        head = torch.zeros(COMMAND_BYTES, dtype=torch.uint8)
        head[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
        inline = data[: COMMAND_BYTES - 8]
        head[8 : 8 + len(inline)] = torch.frombuffer(bytearray(inline), dtype=torch.uint8)
        self._control.broadcast([head], _root0()).wait()
        if len(data) > len(inline):
            rest = torch.frombuffer(bytearray(data[len(inline) :]), dtype=torch.uint8)
            self._control.broadcast([rest], _root0()).wait()

    def recv_command(self) -> tuple[str, tuple]:
        head = torch.empty(COMMAND_BYTES, dtype=torch.uint8)
        self._control.broadcast([head], _root0()).wait()
        length = int(head[:8].view(torch.int64).item())
        data = head[8 : 8 + length].numpy().tobytes()
        if length > len(data):
            rest = torch.empty(length - len(data), dtype=torch.uint8)
            self._control.broadcast([rest], _root0()).wait()
            data += rest.numpy().tobytes()
        return pickle.loads(data)

    def barrier_status(self, failed: bool) -> int:
        """Every rank reports whether its step failed; returns how many did."""
        flag = torch.tensor([int(failed)], dtype=torch.int64)
        if self.size > 1:
            self._control.allreduce([flag]).wait()
        return int(flag.item())


def _root0():
    options = dist.BroadcastOptions()
    options.rootRank = 0
    return options


def _gloo(store, rank: int, size: int, timeout: datetime.timedelta, loopback: bool):
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    host = "127.0.0.1" if loopback else ""
    options._devices = [
        dist.ProcessGroupGloo.create_device(hostname=host)
        if host
        else dist.ProcessGroupGloo.create_default_device()
    ]
    return dist.ProcessGroupGloo(store, rank, size, options)
