"""One engine loop shared by every connection: the engine steps on its own thread, each request's
text increments go back to its asyncio task, and a task that goes away aborts its request. Only the
loop thread touches the engine, and `build` builds it there too: libgomp keeps a worker pool per
thread, and more workers than cores cut every pool's spin-wait short, slowing all."""

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from ssd_engine.core.outputs import RequestOutput
from ssd_engine.core.sampling_params import SamplingParams
from ssd_engine.core.structures import Sequence, SequenceStatus
from ssd_engine.engine.incremental_text import IncrementalText
from ssd_engine.engine.streaming import TextIncrements

log = logging.getLogger(__name__)


class Overloaded(RuntimeError):
    """More requests in flight than the configured limit."""


@dataclass
class Delta:
    text: str
    output: RequestOutput | None = None  # set on the last delta of a request
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # generated so far (the usage of a stream's chunk)
    # of the tokens since the last delta (params.logprobs set)
    logprobs: list[dict[int, float]] | None = None


@dataclass
class _Request:
    seq: Sequence
    loop: asyncio.AbstractEventLoop
    deltas: asyncio.Queue
    # None: not streamed, one Delta at the end and no decoding while it runs
    text: IncrementalText | None
    increments: TextIncrements = field(init=False)
    sent_logprobs: int = 0  # output tokens whose log-probabilities a delta carried

    def new_logprobs(self) -> list[dict[int, float]] | None:
        if self.seq.logprobs is None:
            return None
        new, self.sent_logprobs = self.seq.logprobs[self.sent_logprobs :], len(self.seq.logprobs)
        return new

    def __post_init__(self) -> None:
        self.increments = TextIncrements(self.seq)

    def push(self, item) -> None:
        self.loop.call_soon_threadsafe(self.deltas.put_nowait, item)


class AsyncEngine:
    def __init__(self, llm, max_pending: int = 256) -> None:
        """Step an engine built on another thread (build() is the faster shape: see the module's docstring)."""
        self._prepare(max_pending)
        self.llm, self.engine = llm, llm.engine
        self._thread = threading.Thread(target=self._loop, name="ssd-engine-loop", daemon=True)
        self._thread.start()

    @classmethod
    def build(cls, make_llm: Callable[[], object], max_pending: int = 256) -> "AsyncEngine":
        """Call make_llm() on the loop thread, which then steps the engine it returns; raises what
        make_llm raised (the loop thread then ends)."""
        self = cls.__new__(cls)
        self._prepare(max_pending)
        built: queue.SimpleQueue = queue.SimpleQueue()

        def build_then_loop() -> None:
            try:
                self.llm = make_llm()
            except BaseException as error:  # handed to the caller, who reports it
                built.put(error)
                return
            self.engine = self.llm.engine
            built.put(None)
            self._loop()

        self._thread = threading.Thread(target=build_then_loop, name="ssd-engine-loop", daemon=True)
        self._thread.start()
        error = built.get()
        if error is not None:
            self._thread.join()
            raise error
        return self

    def _prepare(self, max_pending: int) -> None:
        self.max_pending = max_pending
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._live: dict[int, _Request] = {}
        self._in_flight = 0
        self._lock = threading.Lock()
        self._stopping = False
        self.aborted = 0  # requests whose reader went away before they finished

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        stream: bool = True,
        seq: Sequence | None = None,
    ) -> AsyncIterator[Delta]:
        """Text increments of one request; the last one carries the RequestOutput (stream=False: that
        one only, with the whole text). Raises ValueError for a request that can never run and
        Overloaded when the queue is full. `seq`: one of make_samples' sequences (n > 1), already checked."""
        seq = seq or self.engine.make_sequence(prompt, params)
        with self._lock:
            if self._in_flight >= self.max_pending:
                raise Overloaded(
                    f"{self._in_flight} requests in flight (limit {self.max_pending}); retry later"
                )
            self._in_flight += 1
        text = IncrementalText(self.engine.tokenizer) if stream else None
        request = _Request(seq, asyncio.get_running_loop(), asyncio.Queue(), text)
        self._send("add", request)
        finished = False
        try:
            while True:
                item = await request.deltas.get()
                if isinstance(item, BaseException):
                    raise item
                # before yielding: the reader may close us at the yield
                finished = item.output is not None
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.aborted += 1
                self._send("abort", request)
            with self._lock:
                self._in_flight -= 1

    @property
    def in_flight(self) -> int:
        """Requests being generated (streamed or not) whose reader is still there."""
        return self._in_flight

    def max_tokens_room(self, prompt: str | list[int]) -> int:
        """The most tokens a request with this prompt can generate: what a request that sets no max_tokens gets
        (vLLM's rule), the rest of max_model_len, or less if the whole KV cache holds less. Raises
        ValueError for an empty prompt; a prompt with no room left gets 1, which validation then refuses."""
        engine = self.engine
        n = len(engine.tokenize(prompt))
        by_cache = engine.kv_capacity_tokens() - n
        return max(1, min(engine.max_model_len - n, by_cache))

    async def snapshot(self) -> dict:
        """The engine's speculation metrics, read on the loop thread between steps."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._send("snapshot", (loop, future))
        return await future

    def close(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=30)

    def _send(self, kind: str, request) -> None:
        self._inbox.put((kind, request))
        self._wake.set()

    def _loop(self) -> None:
        while not self._stopping:
            self._drain_inbox()
            if not self.engine.has_unfinished():
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                self.engine.step()
                self._publish()
            # the engine failed: every live request gets the error, no reader hangs
            except Exception as error:
                log.exception("engine step failed")
                for request in self._live.values():
                    self.engine.abort(request.seq)
                    request.push(RuntimeError(f"engine failure: {error}"))
                self._live.clear()

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, request = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "snapshot":
                loop, future = request
                summary = self.llm.speculation_metrics()
                loop.call_soon_threadsafe(lambda f=future, v=summary: f.done() or f.set_result(v))
            elif kind == "add":
                self._live[request.seq.seq_id] = request
                self.engine.add(request.seq)
            # abort: the reader went away
            elif self._live.pop(request.seq.seq_id, None) is not None:
                self.engine.abort(request.seq)

    def _publish(self) -> None:
        for seq_id, request in list(self._live.items()):
            seq = request.seq
            if seq.status == SequenceStatus.FINISHED:
                output = self.engine.to_output(seq)
                request.push(
                    Delta(
                        request.increments.rest(output.text),
                        output,
                        seq.num_prompt_tokens,
                        seq.num_output_tokens,
                        request.new_logprobs(),
                    )
                )
                del self._live[seq_id]
            elif request.text is not None:
                delta = request.increments.delta(request.text.of(seq.output_token_ids))
                if delta:
                    request.push(
                        Delta(
                            delta,
                            None,
                            seq.num_prompt_tokens,
                            seq.num_output_tokens,
                            request.new_logprobs(),
                        )
                    )
