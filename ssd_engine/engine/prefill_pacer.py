"""How many prompt tokens a step that also decodes may take, so that the running requests' next
token waits at most `max_decode_stall` times an unloaded decode step (Sarathi-Serve's stall-free
batching, with a time budget instead of a fixed token count).

Both costs are measured as the engine runs, per batch of decoding sequences: an unloaded decode
step's time, and a prompt token's extra time in a step that also decodes. Until a batch size has
both, a step takes FIRST_CHUNK prompt tokens, and the measurement of that step sets the next."""

from dataclasses import dataclass, field

FIRST_CHUNK = 8  # prompt tokens in a step before the cost of one is known
SMOOTHING = 0.3  # weight of a new measurement in a running estimate
HEADROOM = 0.8  # of the allowed stall the prompt tokens are planned to fill: step times vary


def _blend(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new


@dataclass
class PrefillPacer:
    max_decode_stall: float  # a step that decodes takes at most this many unloaded decode steps
    # (decoding sequences, K they are verified with) -> an unloaded step's seconds / a prompt token's
    decode_s: dict[tuple[int, int], float] = field(default_factory=dict)
    token_s: dict[tuple[int, int], float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.max_decode_stall > 1:
            raise ValueError(f"max_decode_stall must be > 1, got {self.max_decode_stall!r}")

    def prompt_tokens(self, decoding: int, k: int) -> int:
        """Prompt tokens a step with `decoding` decoding sequences verified with K = `k` may add (at
        least 1: prompts always advance)."""
        step, token = self.decode_s.get((decoding, k)), self.token_s.get((decoding, k))
        if step is None or token is None:
            return FIRST_CHUNK
        return max(1, int(HEADROOM * (self.max_decode_stall - 1) * step / token))

    def record(self, decoding: int, k: int, prompt_tokens: int, seconds: float) -> None:
        """A step of `decoding` decoding sequences (K = `k`) and `prompt_tokens` prompt tokens took `seconds`."""
        if decoding == 0:
            return
        key = (decoding, k)
        if prompt_tokens == 0:
            self.decode_s[key] = _blend(self.decode_s.get(key), seconds)
        elif key in self.decode_s:
            extra = max(seconds - self.decode_s[key], 0.0) / prompt_tokens
            self.token_s[key] = _blend(self.token_s.get(key), max(extra, 1e-6))
