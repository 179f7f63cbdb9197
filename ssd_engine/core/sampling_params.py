"""Per-request sampling parameters, with vLLM's field names and defaults."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ssd_engine.core.options import option


@dataclass
class SamplingParams:
    """How one request is decoded; each field's meaning is its `option` help (also the CLI's --help).
    stop / stop_token_ids are normalised to (possibly empty) lists."""

    temperature: float = option(1.0, "0 is greedy (argmax); otherwise the logits are divided by it")
    top_p: float = option(1.0, "keep the smallest set of most likely tokens whose probability reaches top_p, "
                               "in (0, 1] (1: off)")
    top_k: int = option(-1, "keep the k most likely tokens; -1 and 0 both disable it, as in vLLM")
    min_p: float = option(0.0, "drop tokens less likely than min_p times the top token, in [0, 1] (0: off)")
    seed: int | None = option(None, "a seeded request draws only from its own generator, so its output does "
                                    "not depend on the rest of the batch")
    max_tokens: int = option(16, "most tokens to generate")
    stop: str | list[str] | None = option(None, "stop at the first occurrence of this string, which is cut "
                                                "from the text (CLI: repeat for several)")
    stop_token_ids: list[int] | None = option(None, "stop once this token id is generated (CLI: repeat for "
                                                    "several)")
    ignore_eos: bool = option(False, "keep generating past the end-of-sequence token")

    def __post_init__(self) -> None:
        # `not (x >= 0)` also rejects nan, which compares false with everything.
        if not (self.temperature >= 0) or math.isinf(self.temperature):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be an int >= 1, or -1/0 to disable, got {self.top_k!r}")
        if not (0 <= self.min_p <= 1):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be an int > 0, got {self.max_tokens!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
