"""Appending sampled tokens to a sequence and deciding when it stops.

Tokens are appended one by one and the first stop condition wins, so no token beyond a stop, EOS or
max_tokens is ever emitted. Stop strings are searched in a tail's text; the whole output is decoded
only to confirm a hit, as decoding it every token costs O(length)."""

from ssd_engine.core.outputs import RequestMetrics, RequestOutput
from ssd_engine.core.structures import Sequence

# a tail's first characters may differ from the whole text's (a cut character's bytes, a stripped
# leading space): this many characters of a tail are not trusted
UNTRUSTED_CHARS = 16


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def append(
        self, seq: Sequence, tokens: list[int], logprobs: list[dict[int, float]] | None = None
    ) -> int:
        """Append tokens (and logprobs, where asked) until one finishes `seq`; -> how many were."""
        params = seq.params
        for count, token in enumerate(tokens, start=1):
            seq.token_ids.append(token)
            if logprobs is not None and seq.logprobs is not None:
                seq.logprobs.append(logprobs[count - 1])
            if (
                token in self.eos_token_ids and not params.ignore_eos
            ) or token in params.stop_token_ids:
                seq.finish_reason = "stop"
            elif params.stop and self._hit_stop_string(seq):
                seq.finish_reason = "stop"
            elif seq.num_output_tokens >= params.max_tokens or len(seq) >= self.max_model_len:
                seq.finish_reason = "length"
            if seq.finish_reason is not None:
                return count
        return len(tokens)

    def _hit_stop_string(self, seq: Sequence) -> bool:
        """Whether the output's text now holds a stop string (it did not before the last token). A
        tail covering the longest stop plus the last token's text decides "no"; "yes" is confirmed
        on the whole text, so the answer is the whole text's either way."""
        stops, ids = seq.params.stop, seq.output_token_ids
        needed = (
            max(map(len, stops))
            + len(self.tokenizer.decode(ids[-1:], skip_special_tokens=True))
            + 4
            + UNTRUSTED_CHARS
        )
        tokens = (
            needed  # most tokens decode to one character or more; byte tokens may take up to 4 each
        )
        while tokens < len(ids):
            tail = self.tokenizer.decode(ids[-tokens:], skip_special_tokens=True)
            if len(tail) >= needed:
                if _cut_at_stop(tail, stops) is None:
                    return False
                break
            tokens *= 2
        return _cut_at_stop(self._decode(seq), stops) is not None

    def final_text(self, seq: Sequence) -> str:
        text = self._decode(seq)
        cut = _cut_at_stop(text, seq.params.stop)
        return text if cut is None else cut  # like vLLM, the stop string itself is not returned

    def _decode(self, seq: Sequence) -> str:
        return self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)

    def to_output(self, seq: Sequence, spec_metrics) -> RequestOutput:
        """The finished (or aborted) request's output, with its speculation counters."""
        m = seq.metrics
        metrics = RequestMetrics(
            ttft_s=(m.first_token_time or m.finish_time) - m.arrival_time,
            e2e_s=m.finish_time - m.arrival_time,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=min(seq.num_cached_tokens, seq.num_prompt_tokens),
        )
        return RequestOutput(
            seq.seq_id,
            seq.prompt,
            seq.token_ids[: seq.num_prompt_tokens],
            self.final_text(seq),
            seq.output_token_ids,
            seq.finish_reason,
            metrics,
            spec_metrics,
            seq.logprobs,
        )


def _cut_at_stop(text: str, stops: list[str]) -> str | None:
    positions = [text.find(stop) for stop in stops if stop and stop in text]
    return text[: min(positions)] if positions else None
