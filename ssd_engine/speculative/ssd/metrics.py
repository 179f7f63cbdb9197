"""SSD counters: cache hits, acceptance by `Source` (dictionaries keyed by its label), fallbacks,
draft failures, and T_p = cache-build time / the coordinator's verification time per round
(T_p <= 1: the draft keeps up and a hit costs the target nothing)."""

from dataclasses import dataclass, field, fields

from ssd_engine.saguaro.calibration import miss_curve
from ssd_engine.saguaro.source import Source
from ssd_engine.speculative.ssd.protocol import RANK_DEPTH


@dataclass
class SSDMetrics:
    k: int
    lookups_by_accepted: list[int] = field(default_factory=list)  # index accepted + 1; 0: none
    hits_by_accepted: list[int] = field(default_factory=list)
    drafted: dict = field(default_factory=dict)  # source -> draft tokens verified
    accepted: dict = field(default_factory=dict)
    speculations: dict = field(default_factory=dict)
    draft_failures: list[str] = field(default_factory=list)
    bonus_ranks_by_accepted: list = field(default_factory=list)  # [accepted][rank]
    rounds: dict = field(default_factory=dict)
    # source -> [rounds that accepted a], a = 0..K
    rounds_by_accepted: dict = field(default_factory=dict)
    backups: dict = field(default_factory=dict)
    step_samples: list = field(
        default_factory=list
    )  # (branch rows, seconds per branch-decode step)
    glue_s: float = 0.0
    jit_s: float = 0.0
    jit_rounds: int = 0
    build_s: float = 0.0
    wait_s: float = 0.0
    verify_s: float = 0.0
    timed_rounds: int = 0
    verify_rounds: int = 0

    def __post_init__(self) -> None:
        self.lookups_by_accepted = self.lookups_by_accepted or [0] * (self.k + 2)
        self.hits_by_accepted = self.hits_by_accepted or [0] * (self.k + 2)
        self.bonus_ranks_by_accepted = self.bonus_ranks_by_accepted or [
            [0] * (RANK_DEPTH + 1) for _ in range(self.k + 1)
        ]

    def reset(self) -> None:
        """Drop every count; K stays. In place: the coordinator holds this object."""
        fresh = SSDMetrics(self.k)
        for f in fields(self):
            setattr(self, f.name, getattr(fresh, f.name))

    def record_lookup(self, prev_accepted: int, source: Source, bonus_rank: int = -1) -> None:
        self.lookups_by_accepted[prev_accepted + 1] += 1
        self.hits_by_accepted[prev_accepted + 1] += source == Source.HIT
        self._count(source)
        if prev_accepted >= 0 and bonus_rank >= 0:
            self.bonus_ranks_by_accepted[prev_accepted][min(bonus_rank, RANK_DEPTH)] += 1

    def record_backup(self, choice: Source) -> None:
        self.backups[choice.label] = self.backups.get(choice.label, 0) + 1

    def record_local(self, n: int) -> None:
        self._count(Source.LOCAL, n)

    def _count(self, source: Source, n: int = 1) -> None:
        self.speculations[source.label] = self.speculations.get(source.label, 0) + n

    def record_verified(self, source: Source, accepted: int) -> None:
        name = source.label
        self.drafted[name] = self.drafted.get(name, 0) + self.k
        self.accepted[name] = self.accepted.get(name, 0) + accepted
        self.rounds[name] = self.rounds.get(name, 0) + 1
        self.rounds_by_accepted.setdefault(name, [0] * (self.k + 1))[accepted] += 1

    def record_round(
        self,
        build_s: float,
        wait_s: float,
        glue_s: float = 0.0,
        step_s: float = 0.0,
        step_rows: int = 0,
    ) -> None:
        self.build_s += build_s
        self.wait_s += wait_s
        self.glue_s += glue_s
        self.timed_rounds += 1
        if step_rows > 0:
            self.step_samples.append((step_rows, step_s))

    def record_jit(self, lookup_s: float) -> None:
        self.jit_s += lookup_s
        self.jit_rounds += 1

    def rank_counts(self) -> list[int]:
        return [sum(col) for col in zip(*self.bonus_ranks_by_accepted)]

    def tokens_per_round(self, sources: tuple[Source, ...]) -> tuple[float, int]:
        """Mean tokens committed per verified round (accepted drafts + the bonus), and rounds."""
        return self._tokens_per_round(tuple(s.label for s in sources))

    def _tokens_per_round(self, names: tuple[str, ...]) -> tuple[float, int]:
        rounds = sum(self.rounds.get(s, 0) for s in names)
        accepted = sum(self.accepted.get(s, 0) for s in names)
        return (1 + accepted / rounds if rounds else 0.0), rounds

    def estimates(self) -> dict:
        """The fallback rule's inputs as measured so far: (value, samples) each."""
        warm, hits = sum(self.lookups_by_accepted[1:]), sum(self.hits_by_accepted[1:])
        verify = (
            self.verify_s / self.verify_rounds if self.verify_rounds and self.verify_s > 0 else 0.0
        )
        t_p = self.build_s / self.timed_rounds / verify if self.timed_rounds and verify else 0.0
        t_slow = self.jit_s / self.jit_rounds / verify if self.jit_rounds and verify else 0.0
        return dict(
            p_hit=(hits / warm if warm else 0.0, warm),
            e_primary=self.tokens_per_round((Source.HIT, Source.JIT)),
            e_fast=self.tokens_per_round((Source.FAST,)),
            t_p=(t_p, min(self.timed_rounds, self.verify_rounds)),
            t_slow=(t_slow, self.jit_rounds if verify else 0),
        )

    def record_verify(self, seconds: float) -> None:
        self.verify_s += seconds
        self.verify_rounds += 1

    def summary(self) -> dict:
        lookups, hits = sum(self.lookups_by_accepted), sum(self.hits_by_accepted)
        warm = sum(self.lookups_by_accepted[1:])
        rate = lambda a, b: a / b if b else 0.0
        mean_build = rate(self.build_s, self.timed_rounds)
        mean_verify = rate(self.verify_s, self.verify_rounds)
        hit = Source.HIT.label
        hit_acc = rate(self.accepted.get(hit, 0), self.drafted.get(hit, 0))
        miss = [s for s in self.drafted if s != hit]
        return {
            "cache_hit_rate": rate(hits, lookups),
            "cache_hit_rate_warm": rate(hits, warm),
            "cache_hit_rate_by_accepted": {
                str(accepted): rate(
                    self.hits_by_accepted[accepted + 1], self.lookups_by_accepted[accepted + 1]
                )
                for accepted in range(self.k + 1)
                if self.lookups_by_accepted[accepted + 1]
            },
            "lookups": lookups,
            "acceptance_on_hits": hit_acc,
            "acceptance_on_misses": rate(
                sum(self.accepted[s] for s in miss), sum(self.drafted[s] for s in miss)
            ),
            "acceptance_by_source": {
                s: rate(self.accepted[s], self.drafted[s]) for s in self.drafted
            },
            "speculations_by_source": dict(self.speculations),
            "draft_failures": list(self.draft_failures),
            "draft_build_s_per_round": mean_build,
            "coordinator_wait_s_per_round": rate(self.wait_s, self.timed_rounds),
            "verify_s_per_round": mean_verify,
            "T_p": rate(mean_build, mean_verify),
            "glue_s_per_round": rate(self.glue_s, self.timed_rounds),
            "branch_rows_per_build": rate(
                sum(rows for rows, _ in self.step_samples), len(self.step_samples)
            ),
            "miss_rate_by_fanout": miss_curve(self.rank_counts())[:8],
            "backup_rounds": dict(self.backups),
            # Theorem 7's inputs
            "tokens_per_round_hit": self._tokens_per_round((hit,))[0],
            "tokens_per_round_miss": self._tokens_per_round(
                tuple(s for s in self.rounds if s != hit)
            )[0],
            "jit_s_per_round": rate(self.jit_s, self.jit_rounds),
        }
