"""The coordinator <-> draft channel: a two-rank gloo group (rank 0 = coordinator, 1 = draft).

Each round is one request tensor out (payload.py; a second one only when new prompts overflow the
preallocated buffer) and one reply tensor back. The payload is a few kilobytes of host data that
the scheduler reads anyway, so it travels over gloo (TCP on loopback) on CPU and CUDA alike; no
KV ever crosses. Every coordinator receive has a deadline: a dead draft fails it at once
(connection closed), a stalled one after `timeout_s`; either way the caller stops using the draft.
"""
import datetime

import torch
import torch.distributed as dist

from ssd_engine.spec.payload import HEADER, REQUEST_CAPACITY

IDLE = datetime.timedelta(days=7)


class DraftLinkError(RuntimeError):
    pass


class DraftLink:
    def __init__(self, store, rank: int, timeout_s: float) -> None:
        options = dist.ProcessGroupGloo._Options()
        options._timeout = IDLE  # the draft waits for the next round as long as the coordinator idles
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        self.group = dist.ProcessGroupGloo(dist.PrefixStore("ssd-draft", store), rank, 2, options)
        self.peer = 1 - rank
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.request_buf = torch.zeros(REQUEST_CAPACITY, dtype=torch.int64)  # the draft's receive buffer
        self.reply_buf = torch.zeros(0)
        # gloo sends complete only once the peer posts its receive, and the draft posts it only
        # after building its cache: sends go out asynchronously from two alternating buffers
        self.out_bufs = [torch.zeros(REQUEST_CAPACITY, dtype=torch.int64) for _ in range(2)]
        self.in_flight: list[tuple[list, torch.Tensor | None]] = [([], None), ([], None)]
        self.turn = 0

    # ---- coordinator --------------------------------------------------------------------
    def send_request(self, words: torch.Tensor) -> None:
        """Queue one request without waiting for the draft to take it (it may be building)."""
        self.turn ^= 1
        for work in self.in_flight[self.turn][0]:  # this buffer's previous request must have left
            self._wait(work)
        buf = self.out_bufs[self.turn]
        n = min(words.numel(), REQUEST_CAPACITY)
        buf[:n] = words[:n]
        works, rest = [self.group.send([buf], self.peer, 0)], None
        if words.numel() > REQUEST_CAPACITY:
            rest = words[REQUEST_CAPACITY:].contiguous()  # held until its send completes
            works.append(self.group.send([rest], self.peer, 1))
        self.in_flight[self.turn] = (works, rest)

    def recv_reply(self, size: int) -> torch.Tensor:
        if self.reply_buf.numel() < size:
            self.reply_buf = torch.zeros(size)
        view = self.reply_buf[:size]
        self._wait(self.group.recv([view], self.peer, 2))
        return view

    def _wait(self, work) -> None:
        try:
            work.wait(self.timeout)
        except RuntimeError as error:
            raise DraftLinkError(str(error).splitlines()[0]) from error

    # ---- draft --------------------------------------------------------------------------
    def recv_request(self) -> torch.Tensor:
        self.group.recv([self.request_buf], self.peer, 0).wait()
        total = int(self.request_buf[1])
        if total <= REQUEST_CAPACITY:
            return self.request_buf[:max(total, HEADER)]
        rest = torch.empty(total - REQUEST_CAPACITY, dtype=torch.int64)
        self.group.recv([rest], self.peer, 1).wait()
        return torch.cat([self.request_buf, rest])

    def send_reply(self, buf: torch.Tensor) -> None:
        self.group.send([buf.contiguous()], self.peer, 2).wait()
