"""Appending sampled tokens to a sequence and deciding when it stops.

Several tokens may arrive at once (speculative rounds); they are appended one by one and the
first stop condition wins, so no token beyond a stop, EOS or max_tokens is ever emitted.
"""
from ssd_engine.engine.core import Sequence


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def append(self, seq: Sequence, tokens: list[int]) -> int:
        """Append tokens until one finishes `seq`; return how many were appended."""
        params = seq.params
        for count, token in enumerate(tokens, start=1):
            seq.token_ids.append(token)
            if (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
                seq.finish_reason = "stop"
            elif params.stop and self._hit_stop_string(seq):
                seq.finish_reason = "stop"
            elif seq.num_output_tokens >= params.max_tokens or len(seq) >= self.max_model_len:
                seq.finish_reason = "length"
            if seq.finish_reason is not None:
                return count
        return len(tokens)

    def _hit_stop_string(self, seq: Sequence) -> bool:
        return _cut_at_stop(self._decode(seq), seq.params.stop) is not None

    def final_text(self, seq: Sequence) -> str:
        text = self._decode(seq)
        cut = _cut_at_stop(text, seq.params.stop)
        return text if cut is None else cut  # like vLLM, the stop string itself is not returned

    def text(self, seq: Sequence) -> str:
        """The output so far, decoded (stop strings not cut)."""
        return self._decode(seq)

    def _decode(self, seq: Sequence) -> str:
        return self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)


def _cut_at_stop(text: str, stops: list[str]) -> str | None:
    positions = [text.find(stop) for stop in stops if stop and stop in text]
    return text[:min(positions)] if positions else None
