"""The coordinator <-> draft channel: two ranks (0 = coordinator, 1 = draft). Both ends pick the
transport from their devices: gloo on CPU or one shared GPU (with a `ReplyWindow`, gloo carries only
a reply's size); between two GPUs NCCL carries payloads and gloo stays the control channel ("split";
`payload_backend="gloo-split"` runs it on gloo for tests). Every coordinator wait has a deadline and
raises DraftLinkError. NCCL waits take none and hang on a dead peer, so the coordinator posts a NCCL
receive only after the draft's gloo "doorbell" (the reply's size), then polls it against the
deadline; on any failure the NCCL group is aborted, so no kernel waits on a gone peer."""

import datetime
import time
from typing import Protocol

import torch
import torch.distributed as dist

from ssd_engine.speculative.ssd.codec import ReplyLayout, request_size
from ssd_engine.speculative.ssd.reply_window import ReplyWindow

REQUEST_CAPACITY = 64 * 1024  # bytes: a round's news fits unless it brings long new prompts
IDLE = datetime.timedelta(days=7)
POLL_S = 2e-4  # longest nap while polling a payload op: bounds the latency polling adds
REQUEST, REST, REPLY, DOORBELL, HELLO = range(5)  # tags


class DraftLinkError(RuntimeError):
    pass


class CoordinatorEnd(Protocol):
    """What the coordinator calls: DraftLink, or draft_thread.QueueLink for a draft thread."""

    def send_request(self, frame: torch.Tensor) -> None: ...
    def recv_reply(self, size: int) -> torch.Tensor: ...


class DraftEnd(Protocol):
    def recv_request(self) -> torch.Tensor: ...
    def reply_buffer(self, layout: ReplyLayout) -> torch.Tensor | None: ...  # to encode in place
    def send_reply(self, frame: torch.Tensor) -> None: ...


def _device_name(device) -> str:
    """'cpu' or 'cuda:<index>'; the draft inherits the coordinator's environment, so indices agree."""
    device = torch.device("cpu" if device is None else device)
    if device.type != "cuda":
        return "cpu"
    return f"cuda:{torch.cuda.current_device() if device.index is None else device.index}"


def _gloo(store, rank: int):
    options = dist.ProcessGroupGloo._Options()
    options._timeout = IDLE  # the draft waits for the next round as long as the coordinator idles
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(store, rank, 2, options)


class DraftLink:
    def __init__(
        self,
        store,
        rank: int,
        timeout_s: float,
        payload_device=None,
        payload_backend: str | None = None,
        reply_window: ReplyWindow | None = None,
    ):
        self.peer = 1 - rank
        self.timeout = datetime.timedelta(seconds=timeout_s)
        mine = _device_name(payload_device)
        store.set(f"ssd-draft/device/{rank}", mine)
        # control (and payload unless split)
        self.group = _gloo(dist.PrefixStore("ssd-draft", store), rank)
        theirs = store.get(f"ssd-draft/device/{self.peer}").decode()
        # "cpu" as a string (tests/instrumentation/placement.py reads it) unless on distinct GPUs
        self.device: torch.device | str = "cpu"
        if mine.startswith("cuda") and theirs.startswith("cuda") and mine != theirs:
            self.transport, self.device = "nccl", torch.device(mine)
            options = dist.ProcessGroupNCCL.Options()
            # as gloo's: the watchdog must not abort the idle draft's receive
            options._timeout = IDLE
            self.payload = dist.ProcessGroupNCCL(
                dist.PrefixStore("ssd-draft-nccl", store), rank, 2, options
            )
        elif payload_backend == "gloo-split":
            self.transport = "gloo-split"
            self.payload = _gloo(dist.PrefixStore("ssd-draft-payload", store), rank)
        else:
            self.transport, self.payload = "gloo", self.group
        self.split = self.payload is not self.group
        self.window = reply_window if self.transport == "gloo" else None
        # the doorbell: the size of the reply that follows
        self.bell = torch.zeros(1, dtype=torch.int64)
        self.request_buf = torch.zeros(REQUEST_CAPACITY, dtype=torch.uint8, device=self.device)
        self.reply_buf = torch.zeros(0, dtype=torch.uint8, device=self.device)
        # the draft posts receives only after building: sends go out async from two buffers
        self.out_bufs = [
            torch.zeros(REQUEST_CAPACITY, dtype=torch.uint8, device=self.device) for _ in range(2)
        ]
        self.in_flight: list[tuple[list, torch.Tensor | None]] = [([], None), ([], None)]
        self.turn = 0
        if self.split:  # connect now (NCCL builds its communicator on the first op), not mid-round
            hello = torch.zeros(1, dtype=torch.int64, device=self.device)
            op = self.payload.send if rank == 0 else self.payload.recv
            self._wait_payload(op([hello], self.peer, HELLO), patient=rank == 1)

    def send_request(self, frame: torch.Tensor) -> None:
        """Queue one encoded request (uint8) without waiting for the draft to take it."""
        self.turn ^= 1
        for work in self.in_flight[self.turn][0]:
            self._wait_payload(work)
        buf = self.out_bufs[self.turn]
        n = min(frame.numel(), REQUEST_CAPACITY)
        buf[:n] = frame[:n]
        works, rest = [self.payload.send([buf], self.peer, REQUEST)], None
        if frame.numel() > REQUEST_CAPACITY:
            # held until its send completes
            rest = frame[REQUEST_CAPACITY:].to(self.device).contiguous()
            works.append(self.payload.send([rest], self.peer, REST))
        self.in_flight[self.turn] = (works, rest)

    def recv_reply(self, size: int) -> torch.Tensor:
        """The reply of `size` bytes where it arrived (window or payload buffer), valid until the
        next request."""
        if self.window is not None and self.window.fits(size):
            self._wait(self.group.recv([self.bell], self.peer, REPLY))
            if int(self.bell) != size:
                self._fail(
                    f"the draft announced a reply of {int(self.bell)} bytes, expected {size}"
                )
            return self.window.buffer[:size]
        if self.split:  # the doorbell first: once it rang, the draft's send is posted
            self._wait(self.group.recv([self.bell], self.peer, DOORBELL))
            if int(self.bell) != size:
                self._fail(
                    f"the draft announced a reply of {int(self.bell)} bytes, expected {size}"
                )
        view = self._reply_view(size)
        self._wait_payload(self.payload.recv([view], self.peer, REPLY))
        return view

    def recv_request(self) -> torch.Tensor:
        """The next encoded request as a host uint8 tensor (valid until the next call)."""
        self._wait_payload(self.payload.recv([self.request_buf], self.peer, REQUEST), patient=True)
        frame = self.request_buf.cpu()
        total = request_size(frame)
        if total <= REQUEST_CAPACITY:
            return frame[:total]
        rest = torch.empty(total - REQUEST_CAPACITY, dtype=torch.uint8, device=self.device)
        self._wait_payload(self.payload.recv([rest], self.peer, REST), patient=True)
        return torch.cat([frame, rest.cpu()])

    def reply_buffer(self, layout: ReplyLayout) -> torch.Tensor | None:
        if self.window is not None and self.window.fits(layout.size):
            return self.window.buffer[: layout.size]
        return self._reply_view(layout.size) if self.split else None

    def _reply_view(self, size: int) -> torch.Tensor:
        if self.reply_buf.numel() < size:
            self.reply_buf = torch.zeros(size, dtype=torch.uint8, device=self.device)
        return self.reply_buf[:size]

    def send_reply(self, frame: torch.Tensor) -> None:
        if self.window is not None and self.window.fits(frame.numel()):
            if not self.window.holds(frame):
                self.window.buffer[: frame.numel()] = frame
            self.bell[0] = frame.numel()
            return self._wait(self.group.send([self.bell], self.peer, REPLY), patient=True)
        out = frame.contiguous().to(self.device)
        if not self.split:
            return self._wait(self.group.send([out], self.peer, REPLY), patient=True)
        self.bell[0] = out.numel()
        ring = self.group.send([self.bell], self.peer, DOORBELL)
        sent = self.payload.send([out], self.peer, REPLY)
        self._wait(ring, patient=True)
        self._wait_payload(sent, patient=True)

    def _wait(self, work, patient: bool = False) -> None:
        """The coordinator's waits have the deadline; the draft's (patient) ones wait out idle rounds."""
        try:
            work.wait(IDLE if patient else self.timeout)
        except RuntimeError as error:
            self._fail(str(error).splitlines()[0], error)

    def _wait_payload(self, work, patient: bool = False) -> None:
        if self.transport == "nccl":
            self._poll(work, patient)
        self._wait(work, patient)  # raises the op's error; orders the current stream after it

    def _poll(self, work, patient: bool) -> None:
        """Wait for a NCCL op by polling: its wait takes no deadline, and a blocking CUDA wait would
        spin a core for as long as the draft idles."""
        deadline = None if patient else time.monotonic() + self.timeout.total_seconds()
        pause = 0.0
        while not work.is_completed():
            if deadline is not None and time.monotonic() > deadline:
                self._fail(
                    f"timed out after {self.timeout.total_seconds():g} s waiting for the draft (nccl)"
                )
            time.sleep(pause)
            pause = min(2 * pause + 1e-5, POLL_S)

    def _fail(self, message: str, cause: BaseException | None = None):
        if self.transport == "nccl":
            self.payload.abort()
        raise DraftLinkError(message) from cause
