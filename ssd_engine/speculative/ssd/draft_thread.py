"""The SSD draft as a thread of the engine process (`ssd_draft_host="thread"`), coordinator side.

On one GPU a separate draft process gets its own CUDA context, and the GPU time-slices contexts: the
draft's kernels never run beside the target's. A thread of the engine process shares the target's
context and launches on its own CUDA stream, so its kernels can overlap the verification (both are
small-batch decode kernels that leave most SMs idle). The cost is Python: both sides' host work shares
one interpreter lock. A draft thread that holds it most of the time (host-bound: eager or launch-bound
steps) stalls the coordinator's launches by orders of magnitude, because each time it drops and retakes
the lock the waiting coordinator's switch-interval timer starts over; one that mostly waits on its
device (graphed steps) costs little (benchmarks/results/2026-11-25-gil-handoff.md). Which wins is measured by
`benchmarks/bench_synthetic.py --draft-host thread` against the process (scripts/gpu_check.sh);
the multi-GPU layout (draft on its own GPU) stays a process.

The round protocol is the process's, byte for byte (codec.py): `QueueLink` carries the same encoded
requests and replies through two queues, and the thread runs draft/loop.py's `serve`. A draft that
raises fails the coordinator's wait at once, as a dead process does, and the engine falls back.
On CPU the thread shares the engine's cores (tests; the process is the CPU layout).
"""
import queue
import threading

import torch

from ssd_engine.speculative.ssd.codec import ReplyLayout
from ssd_engine.speculative.ssd.link import DraftLinkError
from ssd_engine.speculative.ssd.process import DraftSpec


class QueueLink:
    """Both ends of the round channel inside one process: the coordinator's (send_request,
    recv_reply with the deadline) and the draft thread's (recv_request, send_reply)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.requests: queue.Queue = queue.Queue()
        self.replies: queue.Queue = queue.Queue()

    def send_request(self, frame: torch.Tensor) -> None:
        self.requests.put(frame)  # encode_request builds a new tensor each round: nothing reuses it

    def recv_reply(self, size: int) -> torch.Tensor:
        try:
            reply = self.replies.get(timeout=self.timeout_s)
        except queue.Empty:
            raise DraftLinkError(f"timed out after {self.timeout_s:g} s waiting for the draft thread") from None
        if isinstance(reply, BaseException):
            raise DraftLinkError(f"the draft thread failed: {type(reply).__name__}: {reply}") from reply
        if reply.numel() != size:
            raise DraftLinkError(f"the draft announced a reply of {reply.numel()} bytes, expected {size}")
        return reply

    def recv_request(self) -> torch.Tensor:
        return self.requests.get()

    def reply_buffer(self, layout: ReplyLayout) -> None:
        # the loop's own host buffer crosses as it is (send_reply). A reply held on the GPU would keep
        # whole rows there, but the coordinator would then read its head from the device: a second
        # sync a round, beside the accepted tokens' (codec.py)
        return None

    def send_reply(self, frame: torch.Tensor) -> None:
        # no copy (a full-vocabulary reply is K x vocab floats a sequence): the loop reuses its reply
        # buffer only for the next request's reply, and the coordinator has copied this one's rows
        # into its proposal before it sends that request
        self.replies.put(frame)


class DraftThread:
    """Runs the draft's loop in a daemon thread on its own CUDA stream; `poll()` and `returncode`
    as a subprocess.Popen has them, so the coordinator watches it as it watches a process."""

    def __init__(self, draft_spec: DraftSpec, timeout_s: float) -> None:
        self.link = QueueLink(timeout_s)
        self.returncode: int | None = None
        self.error: BaseException | None = None
        self._loaded = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(draft_spec,), name="ssd-draft", daemon=True)
        self._thread.start()
        self._loaded.wait()
        if self.error is not None:
            raise RuntimeError(f"SSD draft thread failed to start: {type(self.error).__name__}: {self.error}") \
                from self.error

    def _run(self, draft_spec: DraftSpec) -> None:
        from ssd_engine.speculative.ssd.draft.loop import build_server

        try:
            device = torch.device(draft_spec.runner.model.device)
            if device.type == "cuda":
                torch.cuda.set_device(device)  # per thread
                stream = torch.cuda.Stream(device)
                with torch.cuda.stream(stream):  # every launch and graph replay of the draft's goes here
                    self._serve(build_server(draft_spec), draft_spec)
            else:
                self._serve(build_server(draft_spec), draft_spec)
            self.returncode = 0
        except BaseException as error:  # reported to the coordinator, which falls back
            self.error, self.returncode = error, 1
            self.link.replies.put(error)
        finally:
            self._loaded.set()

    def _serve(self, server, draft_spec: DraftSpec) -> None:
        from ssd_engine.speculative.ssd.draft.loop import serve

        self._loaded.set()  # loaded: the coordinator may send rounds
        serve(self.link, server, draft_spec)

    def poll(self) -> int | None:
        return None if self._thread.is_alive() else self.returncode

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)
