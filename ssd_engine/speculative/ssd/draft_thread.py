"""The SSD draft as a thread of the engine process (`ssd_draft_host="thread"`), coordinator side.
A thread shares the target's CUDA context and launches on its own stream, so its kernels can overlap
the verification (a process's context would be time-sliced); the cost is one interpreter lock for
both sides' host work. The round protocol is the process's, byte for byte (codec.py), over two
queues. A draft that raises fails the coordinator's wait at once, as a dead process does."""

import queue
import threading

import torch

from ssd_engine.speculative.ssd.codec import ReplyLayout
from ssd_engine.speculative.ssd.link import DraftLinkError
from ssd_engine.speculative.ssd.process import DraftSpec


class QueueLink:
    """Both ends of the round channel inside one process; only recv_reply has the deadline."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.requests: queue.Queue = queue.Queue()
        self.replies: queue.Queue = queue.Queue()

    def send_request(self, frame: torch.Tensor) -> None:
        self.requests.put(frame)  # a new tensor each round: nothing reuses it

    def recv_reply(self, size: int) -> torch.Tensor:
        try:
            reply = self.replies.get(timeout=self.timeout_s)
        except queue.Empty:
            raise DraftLinkError(
                f"timed out after {self.timeout_s:g} s waiting for the draft thread"
            ) from None
        if isinstance(reply, BaseException):
            raise DraftLinkError(
                f"the draft thread failed: {type(reply).__name__}: {reply}"
            ) from reply
        if reply.numel() != size:
            raise DraftLinkError(
                f"the draft announced a reply of {reply.numel()} bytes, expected {size}"
            )
        return reply

    def recv_request(self) -> torch.Tensor:
        return self.requests.get()

    def reply_buffer(self, layout: ReplyLayout) -> None:
        # the loop's host buffer: a GPU reply would cost the coordinator a second sync a round
        return None

    def send_reply(self, frame: torch.Tensor) -> None:
        # no copy: the loop reuses its buffer only for the next request's reply, and the coordinator
        # has copied this one's rows into its proposal before it sends that request
        self.replies.put(frame)


class DraftThread:
    """Runs the draft's loop in a daemon thread on its own CUDA stream; `poll()` and `returncode`
    as subprocess.Popen's, so the coordinator watches it as a process."""

    def __init__(self, draft_spec: DraftSpec, timeout_s: float) -> None:
        self.link = QueueLink(timeout_s)
        self.returncode: int | None = None
        self.error: BaseException | None = None
        self._loaded = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(draft_spec,), name="ssd-draft", daemon=True
        )
        self._thread.start()
        self._loaded.wait()
        if self.error is not None:
            raise RuntimeError(
                f"SSD draft thread failed to start: {type(self.error).__name__}: {self.error}"
            ) from self.error

    def _run(self, draft_spec: DraftSpec) -> None:
        from ssd_engine.speculative.ssd.draft.loop import build_server

        try:
            device = torch.device(draft_spec.runner.model.device)
            if device.type == "cuda":
                torch.cuda.set_device(device)
                stream = torch.cuda.Stream(device)
                with torch.cuda.stream(stream):
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

        self._loaded.set()
        serve(self.link, server, draft_spec)

    def poll(self) -> int | None:
        return None if self._thread.is_alive() else self.returncode

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)
