"""SD's K chosen every step (`speculation_per_step="goodput"`): the plan's K or 0 (plain decoding).

Speculation pays at a small batch, where a verification of K + 1 rows costs about what one row does,
and can lose at a large one, where the target's step grows with its rows and rejected drafts are
paid for. Which side of that line a batch is on depends on the machine, the pair and the prompts'
acceptance, so it is measured here, on the engine's own steps: per batch size (in powers of two),
the emitted tokens per second of the steps that ran K and of those that ran plain decoding, each a
running average. A step runs the arm with the higher rate at its batch size, or, until both arms
have run there, at the nearest batch size where both have (a draining batch passes through every
smaller size: trying both arms at once at each costs more than it tells). An arm never run anywhere
is run at once; one never run at this batch size is tried after FIRST_LOOK steps there, and one not
run there for EXPLORE_EVERY steps (more for K, whose try costs the draft's catch-up) once more, so
the estimates follow the load and the acceptance.

Exactness is the verifier's: a plain step samples the target's law, a speculated one verifies, and
the draft catches up with whatever tokens it missed (speculative/sd.py). Seeded requests promise the
same tokens alone or in any batch, and a step's K would make theirs depend on the batch: a step
whose batch holds one runs K.
"""
from collections import Counter
from dataclasses import dataclass

from ssd_engine.core.structures import Sequence

# steps of one batch size between tries of the arm not chosen: plain decoding is cheap to try, K
# after a run of plain steps is not (the draft first catches up over every token it missed)
EXPLORE_EVERY = {"plain": 64, "speculate": 256}
FIRST_LOOK = 4      # steps at a batch size before an arm never run at it is tried there
WEIGHT = 0.25       # of the newest step in an arm's running average


@dataclass
class Arm:
    rate: float | None = None  # emitted tokens per second
    last_step: int = -1        # the step count when it last ran


class StepChoice:
    def __init__(self, k: int) -> None:
        self.k = k
        self.arms: dict[tuple[int, int], Arm] = {}  # (batch-size bucket, K) -> its measurements
        self.steps = 0
        self.steps_by_k: Counter = Counter()

    def choose(self, running: list[Sequence]) -> int:
        """K for the step about to run over (at most) `running`."""
        self.steps += 1
        k = self._choose(running)
        self.steps_by_k[k] += 1
        return k

    def _choose(self, running: list[Sequence]) -> int:
        if not running or any(seq.params.seed is not None for seq in running):
            return self.k
        bucket = len(running).bit_length()
        for k in (self.k, 0):
            arm = self.arms.setdefault((bucket, k), Arm(last_step=self.steps))  # new here: its wait starts now
            if not any(a.rate is not None for (_, arm_k), a in self.arms.items() if arm_k == k):
                return k  # never measured at any batch size
            every = EXPLORE_EVERY["speculate" if k else "plain"] if arm.rate is not None else FIRST_LOOK
            if self.steps - arm.last_step > every:
                return k
        rates = self._nearest_pair(bucket)
        return max(rates, key=rates.get) if rates else self.k

    def _nearest_pair(self, bucket: int) -> dict[int, float] | None:
        """Both arms' rates at this batch size, else at the nearest one that measured both (rates at
        different batch sizes are not comparable: only their order within one is read)."""
        both = sorted((abs(b - bucket), b) for b in {b for b, _ in self.arms}
                      if all(self.arms.get((b, k), Arm()).rate is not None for k in (self.k, 0)))
        if not both:
            return None
        b = both[0][1]
        return {k: self.arms[b, k].rate for k in (self.k, 0)}

    def record(self, k: int, decoding: int, emitted: int, seconds: float) -> None:
        """A step that decoded `decoding` sequences (and prefilled none) and emitted `emitted` tokens."""
        if decoding == 0 or seconds <= 0:
            return
        arm = self.arms.setdefault((decoding.bit_length(), k), Arm())
        rate = emitted / seconds
        arm.rate = rate if arm.rate is None else (1 - WEIGHT) * arm.rate + WEIGHT * rate
        arm.last_step = self.steps

    def summary(self) -> dict:
        return {"steps_by_k": dict(sorted(self.steps_by_k.items()))}

    def reset(self) -> None:
        """Fresh step counts (the measured rates stay: they are what the choice has learned)."""
        self.steps_by_k.clear()
