"""Predict AR, SD and SSD tokens/s from measured costs and the pair's acceptance, with the paper's
formulas (docs/saguaro.md). SSD's budget B is the largest whose cache build (glue + K branch steps
of B rows) fits one verification with HEADROOM."""

import math
from dataclasses import dataclass, field

from ssd_engine.saguaro.calibration import DEFAULT_ALPHA, DEFAULT_E_FAST, DEFAULT_R, Calibration
from ssd_engine.saguaro.fanout import expected_hit_rate, fanout_for_outcomes
from ssd_engine.saguaro.speedup import ssd_speedup
from ssd_engine.speculative.ssd.draft.build_budget import HEADROOM

K_RANGE = range(1, 9)
# the smallest K within this of the best wins: past the calibrated K the outcome law is extrapolated
K_TIE = 0.97
MAX_BUDGET = 64


@dataclass(frozen=True)
class Acceptance:
    """What the pair accepts, from its calibration (or the documented defaults)."""

    position_rates: tuple[
        float, ...
    ]  # P(draft i accepted | drafts before it accepted), i = 1..K_cal
    miss_by_fanout: tuple[float, ...]  # P(bonus not among the top F candidates), F = 1, 2, ...
    r: float
    e_fast: float  # tokens per round from the fast backup

    @classmethod
    def from_calibration(cls, cal: Calibration | None) -> "Acceptance":
        if cal is None:
            return cls((DEFAULT_ALPHA,), (), DEFAULT_R, DEFAULT_E_FAST)
        at_least = [sum(cal.outcome_probs[i:]) for i in range(len(cal.outcome_probs))]
        rates = tuple(
            at_least[i] / at_least[i - 1] if at_least[i - 1] > 0 else 0.0
            for i in range(1, len(at_least))
        )
        return cls(rates or (cal.alpha,), tuple(cal.miss_by_fanout), cal.r, cal.e_fast)

    def rate(self, position: int) -> float:
        """Acceptance of draft `position` (1-based) given the ones before it were accepted; past the
        calibrated K, the rates' geometric mean (pairs accept whole runs more than i.i.d.)."""
        if position <= len(self.position_rates):
            return self.position_rates[position - 1]
        tail = [max(r, 1e-6) for r in self.position_rates[1:] or self.position_rates]
        return math.exp(sum(map(math.log, tail)) / len(tail))

    def outcome_probs(self, k: int) -> list[float]:
        """P(exactly j accepted), j = 0..K."""
        at_least, running = [1.0], 1.0
        for i in range(1, k + 1):
            running *= self.rate(i)
            at_least.append(running)
        return [at_least[j] - at_least[j + 1] for j in range(k)] + [at_least[k]]

    def tokens_per_round(self, k: int) -> float:
        """E(K): accepted drafts plus the bonus token."""
        return sum((j + 1) * p for j, p in enumerate(self.outcome_probs(k)))

    def miss(self, fanout: int) -> float:
        if fanout <= 0:
            return 1.0
        if fanout <= len(self.miss_by_fanout):
            return self.miss_by_fanout[fanout - 1]
        last = self.miss_by_fanout[-1] if self.miss_by_fanout else 0.3
        return last * (max(len(self.miss_by_fanout), 1) / fanout) ** self.r


@dataclass(frozen=True)
class Costs:
    """Seconds of one forward by rows, as functions (planning/costs.py measures them)."""

    target_all: object  # rows -> s, the target on every core
    target_one: object  # rows -> s, the target on SSD's target cores, the draft's streaming memory
    draft_all: object  # rows -> s, the SD draft on every core
    draft_one: object  # rows -> s, the SSD draft on its own cores
    ssd_possible: bool  # enough cores for disjoint target and draft sets


@dataclass
class Prediction:
    mode: str
    k: int
    tokens_per_s: float
    detail: dict = field(default_factory=dict)


def predict_ar(costs: Costs) -> Prediction:
    return Prediction("ar", 0, 1 / costs.target_all(1))


def predict_sd(costs: Costs, acc: Acceptance, k: int) -> Prediction:
    round_s = costs.target_all(k + 1) + k * costs.draft_all(1)
    e = acc.tokens_per_round(k)
    return Prediction("sd", k, e / round_s, {"tokens_per_round": e, "round_s": round_s})


def predict_ssd(costs: Costs, acc: Acceptance, k: int) -> Prediction:
    verify = costs.target_one(k + 1)  # measured while the draft's cores stream memory
    glue = costs.draft_one(k + 1)
    build = lambda b: glue + k * costs.draft_one(b)
    budget = max([b for b in range(1, MAX_BUDGET + 1) if build(b) <= HEADROOM * verify] or [1])
    probs = acc.outcome_probs(k)
    fanout = fanout_for_outcomes(probs, acc.r, budget)
    p_hit = expected_hit_rate(fanout, probs, acc.miss)
    e = acc.tokens_per_round(k)
    t_p, t_jit = build(budget) / verify, k * costs.draft_one(1) / verify
    # a miss takes the just-in-time primary or the fast backup, whichever Theorem 7 rates higher
    jit, fast = ssd_speedup(p_hit, e, e, t_p, t_jit), ssd_speedup(p_hit, e, acc.e_fast, t_p, 0.0)
    speedup = max(jit, fast)
    return Prediction(
        "ssd",
        k,
        speedup / verify,
        {
            "budget": budget,
            "floor_t_p": build(1) / verify,
            "fanout": fanout,
            "p_hit": p_hit,
            "t_p": t_p,
            "t_jit": t_jit,
            "tokens_per_round": e,
            "miss_backup": "jit" if jit >= fast else "fast",
        },
    )


def predict_all(costs: Costs, acc: Acceptance, ks=K_RANGE) -> dict[str, Prediction]:
    """The best K of each mode; SSD only where the cores allow it."""
    best = {"ar": predict_ar(costs), "sd": _best_k([predict_sd(costs, acc, k) for k in ks])}
    if costs.ssd_possible:
        best["ssd"] = _best_k([predict_ssd(costs, acc, k) for k in ks])
    return best


def _best_k(predictions: list[Prediction]) -> Prediction:
    top = max(p.tokens_per_s for p in predictions)
    return min((p for p in predictions if p.tokens_per_s >= K_TIE * top), key=lambda p: p.k)
