"""Streaming one request's text while the engine steps, releasing text only once it is final."""

from collections.abc import Iterator

from ssd_engine.core.outputs import RequestOutput
from ssd_engine.core.structures import Sequence, SequenceStatus
from ssd_engine.engine.incremental_text import IncrementalText


class TextIncrements:
    """The part of one request's text that is final so far, handed out once."""

    def __init__(self, seq: Sequence) -> None:
        self.sent = 0
        self.hold = max((len(stop) for stop in seq.params.stop), default=1) - 1

    def delta(self, text: str) -> str:
        """New final text of an unfinished request now decoding to `text`; held back: the last
        (longest stop - 1) characters, which could start a stop string, and a partial character."""
        end = len(text) - self.hold
        # at most 3 trailing replacement characters may still change (UTF-8 resynchronises)
        for _ in range(3):
            if end > self.sent and text[end - 1] == "\ufffd":
                end -= 1
        if end <= self.sent:
            return ""
        delta, self.sent = text[self.sent : end], end
        return delta

    def rest(self, final_text: str) -> str:
        """Everything not yet handed out, once the request has finished with `final_text`."""
        rest, self.sent = final_text[self.sent :], len(final_text)
        return rest


class TextStream:
    """Iterate for text increments; they join to exactly `output.text`, which is set (with the
    whole RequestOutput) once the request finishes. Closing the iterator early cancels the request."""

    def __init__(self, engine, seq: Sequence) -> None:
        self.engine, self.seq = engine, seq
        self.output: RequestOutput | None = None
        self.increments = TextIncrements(seq)
        self.text = IncrementalText(engine.output_processor.tokenizer)

    def __iter__(self) -> Iterator[str]:
        try:
            while self.seq.status != SequenceStatus.FINISHED:
                self.engine.step()  # advances every queued request, this one included
                if self.seq.status != SequenceStatus.FINISHED:
                    delta = self.increments.delta(self.text.of(self.seq.output_token_ids))
                    if delta:
                        yield delta
        finally:
            if self.seq.status != SequenceStatus.FINISHED:  # the reader went away
                self.engine.abort(self.seq)
        self.output = self.engine.to_output(self.seq)
        rest = self.increments.rest(self.output.text)
        if rest:
            yield rest
