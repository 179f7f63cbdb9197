"""Which verification outcomes the draft prepares: fan-out F_0..F_K per accepted count k.
Theorem 12: with P(miss | F) ∝ F^(-r) and sum_k F_k = B, hits peak at F_k ∝ P(k)^(1/(1+r))."""

import math


def outcome_probabilities(alpha: float, k: int) -> list[float]:
    """P(exactly j drafts accepted), j = 0..k, for i.i.d. acceptance with rate alpha."""
    return [alpha**j * (1 - alpha) for j in range(k)] + [alpha**k]


def geometric_weights(alpha: float, r: float, k: int) -> list[float]:
    """Unnormalised F_j: alpha^(j/(1+r)), times (1-alpha)^(-1/(1+r)) at j = K; in log space."""
    _check_model(alpha, r)
    if alpha in (0, 1):  # only one outcome is possible: every branch goes to it
        return [0.0] * k + [1.0] if alpha == 1 else [1.0] + [0.0] * k
    logs = [j * math.log(alpha) / (1 + r) for j in range(k)]
    logs.append(k * math.log(alpha) / (1 + r) - math.log(1 - alpha) / (1 + r))
    top = max(logs)
    return [math.exp(x - top) for x in logs]


def geometric_fanout_real(alpha: float, r: float, budget: float, k: int) -> list[float]:
    """The closed form before rounding: F_k = B * w_k / sum(w)."""
    weights = geometric_weights(alpha, r, k)
    total = sum(weights)
    return [budget * w / total for w in weights]


def round_to_budget(real: list[float], budget: int) -> list[int]:
    """Largest-remainder rounding to `budget` (ties to the smaller k: non-increasing stays so)."""
    floors = [math.floor(x + 1e-9) for x in real]
    short = budget - sum(floors)
    order = sorted(range(len(real)), key=lambda j: (-(real[j] - floors[j]), j))
    for j in order[: max(short, 0)]:
        floors[j] += 1
    return floors


def geometric_fanout(alpha: float, r: float, budget: int, k: int) -> list[int]:
    """Theorem 12's fan-out for K = k drafts, as integers >= 0 summing to `budget`."""
    _check_budget(budget)
    return round_to_budget(geometric_fanout_real(alpha, r, budget, k), budget)


def uniform_fanout(budget: int, k: int) -> list[int]:
    """The baseline: B spread evenly over k = 0..K (the remainder to the smallest k)."""
    _check_budget(budget)
    return round_to_budget([budget / (k + 1)] * (k + 1), budget)


def fanout_for_outcomes(probs: list[float], r: float, budget: int) -> list[int]:
    """Theorem 12's F_k ∝ P(k)^(1/(1+r)) for any outcome distribution, summing to `budget`."""
    _check_budget(budget)
    if not r > 0 or any(p < 0 for p in probs) or sum(probs) <= 0:
        raise ValueError(
            f"need r > 0 and a non-negative, non-zero outcome distribution; got r={r}, P={probs}"
        )
    weights = [p ** (1 / (1 + r)) for p in probs]
    total = sum(weights)
    return round_to_budget([budget * w / total for w in weights], budget)


def expected_hit_rate(fanout: list[int], alpha, miss_by_fanout) -> float:
    """sum_k P(k) (1 - miss(F_k)), miss(0) = 1: the per-round hit rate a fan-out should give.
    `alpha`: the acceptance rate (i.i.d. outcomes) or the outcome distribution P(0..K) itself."""
    probs = (
        outcome_probabilities(alpha, len(fanout) - 1) if isinstance(alpha, (int, float)) else alpha
    )
    return sum(p * (1 - (1.0 if f == 0 else miss_by_fanout(f))) for p, f in zip(probs, fanout))


def _check_model(alpha: float, r: float) -> None:
    if not 0 <= alpha <= 1:
        raise ValueError(f"acceptance rate alpha must be in [0, 1], got {alpha!r}")
    if not r > 0:
        raise ValueError(f"miss-rate exponent r must be > 0, got {r!r}")


def _check_budget(budget: int) -> None:
    if not (isinstance(budget, int) and not isinstance(budget, bool) and budget >= 0):
        raise ValueError(f"fan-out budget B must be an integer >= 0, got {budget!r}")


def scale_fanout(planned: list[int], budget: int) -> list[int]:
    """`planned` scaled down to sum to `budget`, keeping its (B-independent) proportions."""
    _check_budget(budget)
    total = sum(planned)
    if budget >= total:
        return list(planned)
    return round_to_budget([budget * f / total for f in planned], budget)
