"""Streaming one request's text while the engine steps (`LLM.generate_stream`, the CLI's
`--stream`). Text is released only once it is final: not while the decoded text ends in an
incomplete UTF-8 character (UTF-8 resynchronises, so only the
last 3 replacement characters can still change), and not the last (longest stop string - 1) characters, which could
still become the start of a stop string that the final text drops."""
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
        """New final text of an unfinished request whose decoded output is now `text`."""
        end = len(text) - self.hold
        # an incomplete character at the end (at most 3 of its 4 UTF-8 bytes, so at most 3
        # replacement characters) may still change; earlier replacement characters never will
        for _ in range(3):
            if end > self.sent and text[end - 1] == "\ufffd":
                end -= 1
        if end <= self.sent:
            return ""
        delta, self.sent = text[self.sent:end], end
        return delta

    def rest(self, final_text: str) -> str:
        """Everything not yet handed out, once the request has finished with `final_text`."""
        rest, self.sent = final_text[self.sent:], len(final_text)
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
