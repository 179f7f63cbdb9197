"""Saguaro fallback: on a cache miss, draft just in time with the primary (slow, exact-quality)
below the critical batch size b*, use the fast backup (n-gram, else random) at or above it.
Theorem 17: b* = ln x* / ln p, x* = [E_h (1 + T_p) - E_p] / [E_p (M - 1) + E_h (1 + T_p - M)],
with M = max(1, T_p), E_h = p E_p + (1 - p) E_f; slow wins where x = p^b > x*."""

import math
from dataclasses import dataclass

from ssd_engine.saguaro.source import Source

NEVER = math.inf  # b* when the slow backup always wins


def speedup_slow(b: float, p: float, e_p: float, t_p: float, t_slow: float | None = None) -> float:
    x, m = p**b, max(1.0, t_p)
    return e_p / (m * x + (1 - x) * (1 + (t_p if t_slow is None else t_slow)))


def speedup_fast(b: float, p: float, e_p: float, e_f: float, t_p: float) -> float:
    x, m = p**b, max(1.0, t_p)
    return (p * e_p + (1 - p) * e_f) / (m * x + (1 - x))


def critical_batch_size(
    p: float, e_p: float, e_f: float, t_p: float, t_slow: float | None = None
) -> float:
    """b*: the slow backup is the better one for batch sizes b < b* (inf: always; 0: never).
    t_slow: the slow backup's measured cost (a miss costs 1 + t_slow instead of 1 + T_p)."""
    if not 0 <= p <= 1 or e_p <= 0 or e_f <= 0 or t_p < 0:
        raise ValueError(
            f"need 0 <= p <= 1, E_p > 0, E_f > 0, T_p >= 0; got p={p}, E_p={e_p}, E_f={e_f}, T_p={t_p}"
        )
    m = max(1.0, t_p)
    t_b = t_p if t_slow is None else t_slow
    e_h = p * e_p + (1 - p) * e_f
    denominator = e_p * (m - 1) + e_h * (1 + t_b - m)
    if denominator <= 0:  # no crossover with slow winning small batches: decide once, at b = 1
        return (
            NEVER
            if speedup_slow(1, p, e_p, t_p, t_slow) >= speedup_fast(1, p, e_p, e_f, t_p)
            else 0.0
        )
    x_star = (e_h * (1 + t_b) - e_p) / denominator
    if x_star <= 0:
        return NEVER
    if x_star >= 1 or p >= 1:
        return 0.0 if x_star >= 1 else NEVER
    if p <= 0:
        return 0.0  # every sequence misses: x = 0 < x* for every b >= 1
    return math.log(x_star) / math.log(p)


@dataclass
class Estimates:
    """Running estimates the rule needs; priors come from the calibration."""

    p_hit: float
    e_primary: float
    e_fast: float
    t_p: float
    t_slow: float | None = None  # the just-in-time backup's cost / verification; None: T_p

    @property
    def slow_cost(self) -> float:
        return self.t_p if self.t_slow is None else self.t_slow


class FallbackPolicy:
    """Picks each round's backup (Source.JIT or FAST); mode "auto" (b* recomputed every `period`
    rounds; `prior`, worth `min_samples` samples, blended with measurements), "jit" or "fast"."""

    def __init__(
        self,
        mode: str,
        prior: Estimates,
        pinned: float | None = None,
        period: int = 16,
        min_samples: int = 8,
    ) -> None:
        self.mode, self.prior, self.pinned = mode, prior, pinned
        self.period, self.min_samples = period, min_samples
        self.estimates = prior
        self.rounds = 0
        self.critical_batch = pinned if pinned is not None else critical_batch_size(**_args(prior))

    def choose(self, batch_size: int, cold: int = 0) -> Source:
        """`cold`: sequences in their first decode round, which no cache can serve. Without them the
        rule is b < b*; with them no round is all hits (x = 0): compare the backups directly."""
        self.rounds += 1
        if self.mode != "auto":
            return Source[self.mode.upper()]
        if cold == 0 or self.pinned is not None:
            return Source.JIT if batch_size < self.critical_batch else Source.FAST
        e = self.estimates
        warm = batch_size - cold
        fast = (
            warm * (e.p_hit * e.e_primary + (1 - e.p_hit) * e.e_fast) + cold * e.e_fast
        ) / batch_size
        return Source.JIT if e.e_primary / (1 + e.slow_cost) > fast else Source.FAST

    def due(self) -> bool:
        return (
            self.mode == "auto"
            and self.pinned is None
            and self.rounds > 0
            and self.rounds % self.period == 0
        )

    def update(
        self,
        p_hit: tuple[float, int],
        e_primary: tuple[float, int],
        e_fast: tuple[float, int],
        t_p: tuple[float, int],
        t_slow: tuple[float, int] = (0.0, 0),
    ) -> None:
        """Each argument is (measured value, number of samples behind it)."""

        def blend(prior: float, measured: tuple[float, int]) -> float:
            value, n = measured
            return (prior * self.min_samples + value * n) / (self.min_samples + n)

        slow_prior = self.prior.slow_cost
        self.estimates = Estimates(
            blend(self.prior.p_hit, p_hit),
            blend(self.prior.e_primary, e_primary),
            blend(self.prior.e_fast, e_fast),
            blend(self.prior.t_p, t_p),
            blend(slow_prior, t_slow) if t_slow[1] or self.prior.t_slow is not None else None,
        )
        if self.pinned is None:
            self.critical_batch = critical_batch_size(**_args(self.estimates))


def _args(e: Estimates) -> dict:
    return dict(p=e.p_hit, e_p=e.e_primary, e_f=e.e_fast, t_p=e.t_p, t_slow=e.t_slow)
