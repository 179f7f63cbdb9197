"""Per-request sampling parameters, with vLLM's field names and defaults."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class SamplingParams:
    """How one request is decoded.

    temperature: 0 means greedy (argmax); otherwise logits are divided by it.
    top_p:       keep the smallest set of top tokens whose probability reaches top_p (1 = off).
    top_k:       keep the k most likely tokens. -1 and 0 both mean "disabled", as in current vLLM.
    min_p:       drop tokens whose probability is below min_p times the top token's (0 = off).
    seed:        a seeded request draws only from its own generator, so its output does not
                 depend on what else is in the batch.
    stop / stop_token_ids are normalised to (possibly empty) lists.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False

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
