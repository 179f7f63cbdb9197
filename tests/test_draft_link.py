"""The SSD draft channel on its own: what the draft receives is exactly what the coordinator sent
(overflow included, with requests queued before the draft reads), what the coordinator receives is
exactly the reply, and a dead or stalled draft raises DraftLinkError instead of hanging. Both the
plain gloo link and "gloo-split" (the NCCL protocol: doorbell on gloo, payload on a second group)
run on CPU; NCCL itself only with two GPUs. "window" is the plain gloo link with a shared reply window
(reply_window.py): replies that fit it are written there and only their size crosses."""

import datetime
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from ssd_engine.saguaro.source import Source
from ssd_engine.speculative.ssd.codec import ReplyLayout, decode_reply, encode_reply, encode_request
from ssd_engine.speculative.ssd.link import (
    DOORBELL,
    REPLY,
    REQUEST_CAPACITY,
    DraftLink,
    DraftLinkError,
)
from ssd_engine.speculative.ssd.protocol import (
    DraftParams,
    DraftTimings,
    Entry,
    Reply,
    Request,
    Speculation,
    Wanted,
)
from ssd_engine.speculative.ssd.reply_window import ReplyWindow

BACKENDS = [None, "gloo-split", "window"]
WINDOW = 2048  # bytes: the tests' replies of 4000 bytes overflow it and cross over gloo

# the draft side in its own process: argv = port, mode, device[, window fd]; "die" takes one request and
# exits without replying ("die-window": on a link with a reply window), "echo" answers one request
# with its last 100 bytes
CHILD = """
import datetime, sys, time
import torch, torch.distributed as dist
from ssd_engine.speculative.ssd.link import DraftLink
from ssd_engine.speculative.ssd.reply_window import ReplyWindow
port, mode, device = int(sys.argv[1]), sys.argv[2], sys.argv[3]
if device.startswith("cuda"):
    torch.cuda.set_device(torch.device(device))
store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=60))
window = ReplyWindow(int(sys.argv[4]), 2048) if mode == "die-window" else None
link = DraftLink(store, 1, 20.0, payload_device=torch.device(device),
                 payload_backend="gloo-split" if mode == "die" else None, reply_window=window)
words = link.recv_request()
if mode.startswith("die"):
    time.sleep(0.5)  # the coordinator is waiting for its reply by now
    sys.exit(0)
link.send_reply(words[-100:].clone())
sys.exit(0 if link.transport == "nccl" else 3)
"""

# a GPU runs these tests (scripts/gpu_check.sh): each also fails in CI where a host tensor meets the device
CHECK_PLACEMENT = True


def _store() -> dist.TCPStore:
    return dist.TCPStore(
        "127.0.0.1", 0, 2, True, wait_for_workers=False, timeout=datetime.timedelta(seconds=30)
    )


def _windows() -> list[ReplyWindow]:
    """Two mappings of one memfd, as the coordinator and its draft process hold it."""
    fd = ReplyWindow.create_fd(WINDOW)
    try:
        return [ReplyWindow(fd, WINDOW), ReplyWindow(fd, WINDOW)]
    finally:
        os.close(fd)


def _pair(timeout_s: float = 5.0, backend: str | None = None, devices=(None, None)):
    """Both ranks in this process, one thread each (gloo lets one process hold both ends)."""
    store = _store()
    stores = [
        store,
        dist.TCPStore("127.0.0.1", store.port, 2, False, timeout=datetime.timedelta(seconds=30)),
    ]
    links = {}
    windows = _windows() if backend == "window" else [None, None]
    backend = None if backend == "window" else backend

    def make(rank):
        links[rank] = DraftLink(
            stores[rank],
            rank,
            timeout_s,
            payload_device=devices[rank],
            payload_backend=backend,
            reply_window=windows[rank],
        )

    threads = [threading.Thread(target=make, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert set(links) == {0, 1}, "the link did not connect"
    return links[0], links[1], stores


TOKENS_PER_BUFFER = (
    REQUEST_CAPACITY // 8
)  # a request's tokens are int64: about this many fill the buffer


def _request(n_tokens: int, wanted: list[int]) -> torch.Tensor:
    return encode_request(
        Request(
            entries=[Entry(1, -1, list(range(n_tokens)), DraftParams())],
            wanted=[Wanted(i, 0) for i in wanted],
        )
    )


def _layout(width: int | None) -> ReplyLayout | None:
    """A reply for one wanted sequence with a q slot of `width` floats: 72 + 4 x width bytes."""
    return None if width is None else ReplyLayout(1, (width,), 10**6)


def _bytes(n: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8)


@pytest.mark.parametrize("backend", BACKENDS)
def test_requests_and_replies_arrive_exactly(backend):
    coordinator, draft, _ = _pair(backend=backend)
    assert (
        coordinator.transport
        == draft.transport
        == ("gloo" if backend in (None, "window") else backend)
    )
    # (request, reply layout or None): two rounds queued before the draft reads, overflowing
    # requests, then rounds alternating the two send buffers with replies of varying sizes
    rounds = [
        (_request(5, []), None),
        (_request(TOKENS_PER_BUFFER + 37, []), None),
        (_request(3, [1]), _layout(0)),
        (_request(2 * TOKENS_PER_BUFFER, [1]), _layout(982)),
        (_request(10, [1]), _layout(1)),
        (_request(7, [1]), _layout(357)),
        (_request(TOKENS_PER_BUFFER - 24, [1]), _layout(5)),
    ]
    assert rounds[-1][0].numel() < REQUEST_CAPACITY < rounds[1][0].numel()
    assert [layout.size for _, layout in rounds[2:]] == [72, 4000, 76, 1500, 92]
    replies = [_bytes(layout.size if layout else 0) for _, layout in rounds]
    received, errors = [], []

    def serve():
        try:
            time.sleep(0.3)  # the coordinator's first sends go out before any receive is posted
            for i, ((_, layout), reply) in enumerate(zip(rounds, replies)):
                received.append(draft.recv_request().clone())
                if layout is None:
                    continue
                shared = draft.reply_buffer(
                    layout
                )  # the window, the split protocol's payload buffer, or none
                in_place = backend == "gloo-split" or (
                    backend == "window" and layout.size <= WINDOW
                )
                assert (shared is not None) == in_place and (
                    shared is None or shared.numel() == layout.size
                )
                if shared is not None and i % 2:  # encoded in place, as the draft's loop does
                    shared.copy_(reply)
                    reply = shared
                draft.send_reply(reply)
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    for (words, layout), reply in zip(rounds, replies):
        coordinator.send_request(words)
        if layout is not None:
            size = layout.size
            got = coordinator.recv_reply(size)
            assert got.device.type == "cpu" and torch.equal(got, reply)
            in_window = (
                coordinator.window is not None
                and got.data_ptr() == coordinator.window.buffer.data_ptr()
            )
            assert in_window == (
                backend == "window" and size <= WINDOW
            )  # read in place, not copied
    server.join(30)
    assert not server.is_alive() and not errors, errors
    assert len(received) == len(rounds)
    for (words, _), got in zip(rounds, received):
        assert got.dtype == torch.uint8 and torch.equal(got, words)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_reply_encoded_where_the_link_says_decodes_exactly(backend):
    """The draft loop's path: encode into `reply_buffer` (the window, the split protocol's payload
    buffer: on GPUs the rows never leave them) or a buffer of its own, send, decode on arrival."""
    vocab, k = 300, 2
    gen = torch.Generator().manual_seed(1)
    rows = torch.rand(k, vocab, generator=gen)
    rows /= rows.sum(-1, keepdim=True)
    support = torch.zeros(k, vocab)
    support[:, [3, 9]] = torch.tensor([[0.25, 0.75], [0.5, 0.5]])
    reply = Reply(
        DraftTimings(0.5, 0.25, 0.125, 0.0625, 7),
        [
            Speculation(Source.JIT, [5, 6], support, bonus_rank=1),
            Speculation(Source.HIT, [1, 2], rows),
        ],
    )
    # whole rows overflow the tests' window (over gloo); without them (verified one-hot) the reply fits it
    for widths in [(2 * 2, vocab), (2 * 2, 0)]:
        coordinator, draft, _ = _pair(backend=backend)
        layout = ReplyLayout(k, widths, vocab)
        assert (layout.size > WINDOW) == (widths[1] == vocab)
        reply.speculations[1].q = rows if widths[1] == vocab else None

        def serve():
            draft.recv_request()
            draft.send_reply(encode_reply(reply, layout, out=draft.reply_buffer(layout)))

        server = threading.Thread(target=serve, daemon=True)
        server.start()
        coordinator.send_request(_request(3, [1, 2]))
        back = decode_reply(coordinator.recv_reply(layout.size), layout)
        server.join(30)
        assert back.timings == reply.timings and [s.tokens for s in back.speculations] == [
            [5, 6],
            [1, 2],
        ]
        assert torch.equal(back.speculations[0].q.dense(vocab), support)
        if widths[1] == vocab:
            assert torch.equal(back.speculations[1].q, rows)
        else:
            assert back.speculations[1].q is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_stalled_draft_misses_its_deadline(backend):
    coordinator, draft, _ = _pair(timeout_s=1.0, backend=backend)
    coordinator.send_request(_request(4, [1]))
    assert draft.recv_request().numel() > 0  # alive, took the request, never answers
    started = time.monotonic()
    with pytest.raises(DraftLinkError, match="[Tt]imed out"):
        coordinator.recv_reply(6)
    assert 0.9 < time.monotonic() - started < 5


def test_a_draft_that_rings_but_never_sends_misses_its_deadline():
    """The payload wait after the doorbell has a deadline too (polled on NCCL, gloo's own here)."""
    coordinator, draft, _ = _pair(timeout_s=1.0, backend="gloo-split")
    coordinator.send_request(_request(4, [1]))
    draft.recv_request()
    ring = draft.group.send([torch.tensor([6])], 0, DOORBELL)  # the doorbell alone
    started = time.monotonic()
    with pytest.raises(DraftLinkError, match="[Tt]imed out"):
        coordinator.recv_reply(6)
    assert 0.9 < time.monotonic() - started < 5
    ring.wait()


class _Work:
    """Stands in for a NCCL op, which completes on the GPU without anyone waiting for it."""

    def __init__(self, after_s: float) -> None:
        self.at = time.monotonic() + after_s

    def is_completed(self) -> bool:
        return time.monotonic() >= self.at


def test_nccl_ops_are_polled_against_the_deadline():
    coordinator, draft, _ = _pair(timeout_s=1.0, backend="gloo-split")
    # each poll timed alone; the upper bounds only say it returned (a loaded host may wake it late)
    started = time.monotonic()
    coordinator._poll(_Work(0.2), patient=False)
    assert 0.2 <= time.monotonic() - started < 5  # done when the op is, inside the deadline
    started = time.monotonic()
    with pytest.raises(DraftLinkError, match="timed out"):
        coordinator._poll(_Work(float("inf")), patient=False)
    assert 1.0 <= time.monotonic() - started < 5  # the deadline ended it, not the op
    started = time.monotonic()
    draft._poll(_Work(1.5), patient=True)  # the draft has no deadline: it waits past the 1 s
    assert time.monotonic() - started >= 1.5


def test_a_wrong_reply_size_fails_instead_of_hanging():
    coordinator, draft, _ = _pair(backend="gloo-split")
    coordinator.send_request(_request(4, [1]))
    draft.recv_request()
    answer = threading.Thread(target=draft.send_reply, args=(_bytes(5),), daemon=True)
    answer.start()
    with pytest.raises(DraftLinkError, match="5 bytes, expected 6"):
        coordinator.recv_reply(6)
    coordinator.payload.recv([_bytes(5)], 1, REPLY).wait()  # take it, so the draft's thread ends
    answer.join(10)
    assert not answer.is_alive()


def _run_child(mode: str, device: str, coordinator_device, body) -> int:
    """Rank 1 in a child process; `body(link)` runs rank 0 here. Returns the child's exit code."""
    store = _store()
    fd = ReplyWindow.create_fd(WINDOW) if mode == "die-window" else None
    window = None if fd is None else ReplyWindow(fd, WINDOW)
    argv = [sys.executable, "-c", CHILD, str(store.port), mode, device] + (
        [] if fd is None else [str(fd)]
    )
    child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, pass_fds=() if fd is None else (fd,))
    if fd is not None:
        os.close(fd)
    try:
        link = DraftLink(
            store,
            0,
            20.0,
            payload_device=coordinator_device,
            payload_backend="gloo-split" if mode == "die" else None,
            reply_window=window,
        )
        body(link)
        return child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()


@pytest.mark.parametrize("mode", ["die", "die-window"])
def test_a_dead_draft_fails_at_once(mode):
    def body(link):
        assert link.transport == ("gloo-split" if mode == "die" else "gloo")
        assert (link.window is not None) == (mode == "die-window")
        link.send_request(_request(4, [1]))
        started = time.monotonic()
        with pytest.raises(DraftLinkError):
            link.recv_reply(6)  # timeout_s is 20: the closed connection must fail it well before
        assert time.monotonic() - started < 10

    assert _run_child(mode, "cpu", None, body) == 0


def test_cpu_and_a_shared_gpu_keep_gloo():
    coordinator, draft, _ = _pair()
    assert coordinator.transport == draft.transport == "gloo"
    # both on one GPU (NCCL cannot connect two ranks on one device): decided from the names alone
    coordinator, draft, _ = _pair(devices=(torch.device("cuda:0"), torch.device("cuda:0")))
    assert coordinator.transport == draft.transport == "gloo"
    assert coordinator.out_bufs[0].device.type == "cpu"


@pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason="NCCL between the coordinator and the draft needs 2 CUDA GPUs",
)
def test_distinct_gpus_use_nccl():
    words = _request(TOKENS_PER_BUFFER + 300, [1])

    def body(link):
        assert link.transport == "nccl" and link.out_bufs[0].device == torch.device("cuda:0")
        link.send_request(words)
        got = link.recv_reply(100)
        assert got.device == torch.device("cuda:0") and torch.equal(
            got.cpu(), words[-100:]
        )  # stays on the GPU

    torch.cuda.set_device(0)
    assert _run_child("echo", "cuda:1", torch.device("cuda:0"), body) == 0
