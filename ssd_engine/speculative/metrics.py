"""Speculation metrics with vLLM's definitions: acceptance rate = accepted / drafted; mean
acceptance length = 1 + accepted / rounds (bonus included); per-position rate = P(draft i accepted)
over rounds; histogram[a] = rounds that accepted exactly a drafts."""

from dataclasses import dataclass, field


@dataclass
class SpecCounters:
    k: int
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    accepted_histogram: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.accepted_per_position = self.accepted_per_position or [0] * self.k
        self.accepted_histogram = self.accepted_histogram or [0] * (self.k + 1)

    def record(self, accepted: int, drafted: int) -> None:
        """One round that drafted `drafted` (<= K: SD's per-step choice may draft fewer) tokens."""
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        for i in range(accepted):
            self.accepted_per_position[i] += 1
        self.accepted_histogram[accepted] += 1

    def summary(self) -> dict:
        rounds = max(self.rounds, 1)
        return {
            "rounds": self.rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
            "mean_acceptance_length": 1 + self.accepted / rounds if self.rounds else 0.0,
            "per_position_acceptance_rate": [a / rounds for a in self.accepted_per_position],
            "accepted_length_histogram": list(self.accepted_histogram),
        }


class SpecMetrics:
    """Engine-wide counters plus one set per request."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.total = SpecCounters(k)
        self.per_request: dict[int, SpecCounters] = {}

    def reset(self) -> None:
        """Drop every count; K stays."""
        self.total = SpecCounters(self.k)
        self.per_request = {}

    def record(self, seq_id: int, accepted: int, drafted: int) -> None:
        self.total.record(accepted, drafted)
        self.per_request.setdefault(seq_id, SpecCounters(self.k)).record(accepted, drafted)

    def pop(self, seq_id: int) -> dict:
        counters = self.per_request.pop(seq_id, None)
        return counters.summary() if counters else {}
