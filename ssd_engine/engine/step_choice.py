"""SD's K chosen every step (`speculation_per_step="goodput"`): the plan's K or 0 (plain decoding).

Per batch-size bucket, each arm's tokens/s over steady steps is its running mean of tokens per step
over its running mean of step time; a step runs the faster arm and re-tries the other now and then.
A step that also reads prompt tokens decodes plainly: those steps are not what the rates measure.
Exactness is the verifier's; a batch holding a seeded request always runs K, so its tokens do not
depend on the batch."""

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

from ssd_engine.core.structures import Sequence

# steps of one batch size between tries of the arm not chosen; K's try pays the draft's catch-up
EXPLORE_EVERY = {"plain": 64, "speculate": 256}
FIRST_LOOK = 4  # steps at a batch size before an arm never run at it is tried there
# steady steps an arm tried at a batch size runs for there before its rate is compared
MIN_SAMPLES = 8
# K losing to plain decoding by less than this share is re-tried sooner, in proportion: a
# speculated step emits 1..K+1 tokens by chance, so a few steps can misjudge a close call
CLOSE = 0.25
STEP_WEIGHT = 0.25  # of the newest step in an arm's running step time (the host's speed moves)
TOKENS_WEIGHT = 0.05  # of the newest step in its running tokens per step: a speculated step emits
# 1..K+1 tokens a row by chance, so its mean needs many steps; a step's time does not
# draft tokens a sequence behind in a steady speculated round (the bonus, the last draft)
STEADY_LAG = 2
# of the time since K last ran at a batch size, spent on a catch-up to re-measure it
EXPLORE_SHARE = 0.1


class Draft(Protocol):
    """What the choice reads of SD's draft (speculative/sd.py)."""

    catch_up_s_per_token: float | None

    def lag(self, seqs: list[Sequence]) -> int: ...


@dataclass
class Arm:
    step_s: float | None = None  # running average of a steady step's seconds
    tokens: float | None = None  # running average of the tokens a steady step emitted
    samples: int = 0  # steady steps averaged into them
    last_step: int = -1  # the step count when it last ran
    # when it last ran (or was first wanted)
    last_time: float = field(default_factory=time.monotonic)

    @property
    def rate(self) -> float | None:
        """Emitted tokens per second: mean tokens per step over mean step time."""
        return None if self.step_s is None else self.tokens / self.step_s

    def add(self, emitted: int, seconds: float) -> None:
        """One steady step. Its first MIN_SAMPLES step times keep their fastest: an arm's first steps
        at a batch size can carry one-time costs (a GPU compiles kernels and replays graphs for the
        first time) that would otherwise linger, since the slower-looking arm is rarely re-run. Its
        tokens weigh as a plain mean at first, so the first draw does not linger either."""
        self.samples += 1
        if self.step_s is None:
            self.step_s, self.tokens = seconds, float(emitted)
            return
        if self.samples <= MIN_SAMPLES:
            self.step_s = min(self.step_s, seconds)
        else:
            self.step_s += STEP_WEIGHT * (seconds - self.step_s)
        self.tokens += max(TOKENS_WEIGHT, 1 / self.samples) * (emitted - self.tokens)


class StepChoice:
    def __init__(self, k: int) -> None:
        self.k = k
        self.arms: dict[tuple[int, int], Arm] = {}  # (batch-size bucket, K) -> its measurements
        self.steps = 0
        self.steps_by_k: Counter = Counter()
        # whether the step last chosen started with a catch-up (its rate is not steady)
        self.caught_up = False

    def choose(self, running: list[Sequence], draft: Draft, prefill: bool = False) -> int:
        """K for the step about to run over (at most) `running`; `prefill`: the step also reads
        prompt tokens, and then decodes plainly (a seeded request's batch excepted): drafting would
        hold back that prompt's first token, and the rates compared here come from decode-only steps."""
        self.steps += 1
        seeded = any(seq.params.seed is not None for seq in running)
        k = 0 if prefill and not seeded else self._choose(running)
        lag = draft.lag(running) if k else 0
        self.caught_up = lag > STEADY_LAG * len(running)
        if self.caught_up and not self._catch_up_pays(running, lag, draft.catch_up_s_per_token):
            k, self.caught_up = 0, False
        if k:
            self.arms.setdefault((len(running).bit_length(), k), Arm()).last_time = time.monotonic()
        self.steps_by_k[k] += 1
        return k

    def _catch_up_pays(self, running: list[Sequence], lag: int, s_per_token: float | None) -> bool:
        """Whether reading `lag` tokens into the draft first is paid back by speculating over what
        the batch has left to generate at the measured rates, or re-measures K (EXPLORE_SHARE)."""
        if any(seq.params.seed is not None for seq in running):
            return True  # a seeded request's batch always drafts K (the module docstring)
        bucket = len(running).bit_length()
        if self._nearest_pair(bucket) is None or s_per_token is None:
            return True  # nothing measured yet: this step measures it
        cost = lag * s_per_token
        since = time.monotonic() - self.arms.setdefault((bucket, self.k), Arm()).last_time
        if cost <= EXPLORE_SHARE * since:
            return True
        # another batch size's rates are no promise here (a larger batch's verification costs more)
        rates = self._rates_at(bucket)
        if not (rates[self.k] and rates[0]):
            return False
        left = sum(max(seq.params.max_tokens - seq.num_output_tokens, 0) for seq in running)
        return left / rates[0] - left / rates[self.k] > cost

    def _choose(self, running: list[Sequence]) -> int:
        if not running or any(seq.params.seed is not None for seq in running):
            return self.k
        bucket = len(running).bit_length()
        for k in (self.k, 0):
            # new here: its wait starts now
            arm = self.arms.setdefault((bucket, k), Arm(last_step=self.steps))
            if not any(a.rate is not None for (_, arm_k), a in self.arms.items() if arm_k == k):
                return k  # never measured at any batch size
            if arm.rate is not None and arm.samples < MIN_SAMPLES:
                return k  # one step's rate is noise: an arm tried here runs until it has a few
            every = (
                (self._retry_every(bucket) if k else EXPLORE_EVERY["plain"])
                if arm.rate is not None
                else FIRST_LOOK
            )
            if self.steps - arm.last_step > every and not (
                k and arm.rate is None and self._lost_below(bucket)
            ):
                return k
        rates = self._nearest_pair(bucket)
        return max(rates, key=rates.get) if rates else self.k

    def _retry_every(self, bucket: int) -> int:
        """Steps between tries of K at a batch size where it lost: EXPLORE_EVERY's, less where it lost
        by less than CLOSE (down to a sixteenth)."""
        rates = self._rates_at(bucket)
        every = EXPLORE_EVERY["speculate"]
        if not (rates[self.k] and rates[0]):
            return every
        return int(every * min(1.0, max(1 / 16, (rates[0] / rates[self.k] - 1) / CLOSE)))

    def _lost_below(self, bucket: int) -> bool:
        """Whether K lost to plain decoding at the largest smaller batch size that measured both:
        then K is not first tried at a larger one, whose verification only costs more."""
        below = [b for b in self._measured_buckets() if b < bucket]
        return bool(below) and self.arms[max(below), self.k].rate < self.arms[max(below), 0].rate

    def _measured_buckets(self) -> set[int]:
        """Batch-size buckets where both arms have a rate."""
        return {b for b, _ in self.arms if None not in self._rates_at(b).values()}

    def _nearest_pair(self, bucket: int) -> dict[int, float] | None:
        """Both arms' rates at this batch size, else at the nearest one that measured both."""
        both = sorted((abs(b - bucket), b) for b in self._measured_buckets())
        if not both:
            return None
        return self._rates_at(both[0][1])

    def _rates_at(self, bucket: int) -> dict[int, float | None]:
        """K's and plain decoding's measured rates at a batch-size bucket (None: not measured there)."""
        return {k: self.arms.get((bucket, k), Arm()).rate for k in (self.k, 0)}

    def record(self, k: int, decoding: int, emitted: int, seconds: float) -> None:
        """A step that decoded `decoding` sequences (and prefilled none) and emitted `emitted` tokens."""
        # a catch-up is not a steady round
        if decoding == 0 or seconds <= 0 or (k and self.caught_up):
            return
        bucket = decoding.bit_length()
        arm = self.arms.setdefault((bucket, k), Arm())
        before = arm.step_s
        arm.add(emitted, seconds)
        arm.last_step = self.steps
        other = self.arms.get((bucket, 0 if k else self.k))
        if before and other is not None and other.step_s is not None:
            # the host's speed and the batch's context lengths move both arms' step times alike: the
            # arm not running keeps its ratio to this one instead of a stale time
            other.step_s *= arm.step_s / before

    def summary(self) -> dict:
        return {"steps_by_k": dict(sorted(self.steps_by_k.items()))}

    def reset(self) -> None:
        """Fresh step counts (the measured rates stay: they are what the choice has learned)."""
        self.steps_by_k.clear()
