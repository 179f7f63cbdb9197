"""SD's K chosen every step (`speculation_per_step="goodput"`): any K from 0 (plain decoding) to the
engine's K, whichever is predicted to emit the most tokens per second at the batch's size.

A K's prediction is the tokens a row emits at K, from the running acceptance of each draft position
(shared by every K: a step at K says how often positions 1..K are accepted), over its step time at
that batch-size bucket: measured where K ran there, else interpolated from the plain step and a
speculated one (each draft token costs one draft forward and one verified row). A K predicted best
but not yet run at a bucket is run there, which measures it; the best's neighbours are re-tried now
and then. A step that also reads prompt tokens decodes plainly: those steps are not what the times
measure. Exactness is the verifier's; a batch holding a seeded request always drafts the starting K,
so its tokens do not depend on the batch."""

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

from ssd_engine.core.structures import Sequence

# steps of one batch size between tries of a neighbour of the chosen K: 0's try is cheap; a
# speculated one's pays the draft's catch-up
EXPLORE_EVERY = {"plain": 64, "speculate": 256}
FIRST_LOOK = 4  # steps at a batch size before plain decoding, never run there, is tried
# steady steps a K tried at a batch size runs for there before its time is compared
MIN_SAMPLES = 4
# a neighbour predicted slower than the chosen K by less than this share is re-tried sooner, in
# proportion: a few steps can misjudge a close call
CLOSE = 0.25
STEP_WEIGHT = 0.25  # of the newest step in an arm's running step time (the host's speed moves)
# per recorded step, the weight the acceptance counts keep: a window of some hundred steps, so a
# batch whose requests change is soon read as it is
ACCEPTANCE_DECAY = 0.99
PRIOR_ACCEPTANCE, PRIOR_WEIGHT = 0.5, 2.0  # a position never reached reads as this many rows of it
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
    """One K's steps at one batch-size bucket."""

    step_s: float | None = None  # running average of a steady step's seconds
    samples: int = 0  # steady steps averaged into it
    last_step: int = -1  # the step count when it last ran
    # when it last ran (or was first wanted)
    last_time: float = field(default_factory=time.monotonic)

    def add(self, seconds: float) -> None:
        """One steady step. Its first MIN_SAMPLES step times keep their fastest: an arm's first
        steps at a batch size can carry one-time costs (a GPU compiles kernels and replays graphs
        for the first time) that would otherwise linger, since the slower-looking arm is rarely
        re-run."""
        self.samples += 1
        if self.step_s is None:
            self.step_s = seconds
        elif self.samples <= MIN_SAMPLES:
            self.step_s = min(self.step_s, seconds)
        else:
            self.step_s += STEP_WEIGHT * (seconds - self.step_s)


class Acceptance:
    """Running acceptance of draft positions 1..K: of the rows that reached position j (all of
    1..j-1 accepted), the share that accepted j."""

    def __init__(self, k: int) -> None:
        self.reached = [0.0] * k
        self.accepted = [0.0] * k

    def add(self, rounds: list[tuple[int, int]]) -> None:
        """(accepted, drafted) per verified row of one step."""
        self.reached = [n * ACCEPTANCE_DECAY for n in self.reached]
        self.accepted = [n * ACCEPTANCE_DECAY for n in self.accepted]
        for accepted, drafted in rounds:
            for j in range(min(accepted + 1, drafted)):
                self.reached[j] += 1
            for j in range(accepted):
                self.accepted[j] += 1

    def tokens(self, k: int) -> float:
        """Expected tokens a row emits at K = k."""
        return self.tokens_by_k()[k]

    def tokens_by_k(self) -> list[float]:
        """Expected tokens a row emits at each K from 0 up: the bonus plus each accepted prefix. A
        position never reached reads as the one before it (acceptance rarely rises along the
        drafts)."""
        totals, reach, rate = [1.0], 1.0, PRIOR_ACCEPTANCE
        for reached, accepted in zip(self.reached, self.accepted):
            if reached > 0:
                rate = (accepted + PRIOR_WEIGHT * rate) / (reached + PRIOR_WEIGHT)
            reach *= rate
            totals.append(totals[-1] + reach)
        return totals


class StepChoice:
    def __init__(self, k: int, start: int | None = None) -> None:
        self.k = k  # the most drafts a step may take
        self.start = min(start or k, k)  # run first, and by every batch holding a seeded request
        self.arms: dict[tuple[int, int], Arm] = {}  # (batch-size bucket, K) -> its step times
        self.acceptance = Acceptance(k)
        self.steps = 0
        self.steps_by_k: Counter = Counter()
        # whether the step last chosen started with a catch-up (its time is not steady)
        self.caught_up = False

    def choose(self, running: list[Sequence], draft: Draft, prefill: bool = False) -> int:
        """K for the step about to run over (at most) `running`; `prefill`: the step also reads
        prompt tokens, and then decodes plainly (a seeded request's batch excepted): drafting would
        hold back that prompt's first token, and the times compared here come from decode-only
        steps."""
        self.steps += 1
        seeded = any(seq.params.seed is not None for seq in running)
        k = 0 if prefill and not seeded else self._choose(running)
        lag = draft.lag(running) if k else 0
        self.caught_up = lag > STEADY_LAG * len(running)
        if self.caught_up and not self._catch_up_pays(running, k, lag, draft.catch_up_s_per_token):
            k, self.caught_up = 0, False
        if k:
            self._arm(len(running).bit_length(), k).last_time = time.monotonic()
        self.steps_by_k[k] += 1
        return k

    def _arm(self, bucket: int, k: int, **new) -> Arm:
        return self.arms.setdefault((bucket, k), Arm(**new))

    def _catch_up_pays(
        self, running: list[Sequence], k: int, lag: int, s_per_token: float | None
    ) -> bool:
        """Whether reading `lag` tokens into the draft first is paid back by speculating at `k` over
        what the batch has left to generate at the predicted rates, or re-measures it
        (EXPLORE_SHARE)."""
        if any(seq.params.seed is not None for seq in running):
            return True  # a seeded request's batch always drafts (the module docstring)
        bucket = len(running).bit_length()
        if self._nearest_rates(bucket) is None or s_per_token is None:
            return True  # nothing measured yet: this step measures it
        cost = lag * s_per_token
        if cost <= EXPLORE_SHARE * (time.monotonic() - self._arm(bucket, k).last_time):
            return True
        rates = self._rates_at(bucket)
        if rates is None:
            return False  # another batch size's rates are no promise here
        left = sum(max(seq.params.max_tokens - seq.num_output_tokens, 0) for seq in running)
        rows = len(running)  # the rates are a row's
        return left / (rows * rates[0]) - left / (rows * rates[k]) > cost

    def _choose(self, running: list[Sequence]) -> int:
        if not running or any(seq.params.seed is not None for seq in running):
            return self.start
        bucket = len(running).bit_length()
        plain = self._arm(bucket, 0, last_step=self.steps)  # new here: its wait starts now
        for k in range(self.k + 1):
            arm = self.arms.get((bucket, k))
            if arm is not None and arm.step_s is not None and arm.samples < MIN_SAMPLES:
                return k  # one step's time is noise: a K tried here runs until it has a few
        ran = {k for (_, k), arm in self.arms.items() if arm.step_s is not None}
        if not ran - {0}:
            return self.start  # speculation never measured at any batch size
        if plain.step_s is None and (0 not in ran or self.steps - plain.last_step > FIRST_LOOK):
            return 0
        here = self._rates_at(bucket)
        rates = here or self._nearest_rates(bucket)
        if not rates:
            return self.start
        best = max(rates, key=rates.get)
        for k in sorted({0, best - 1, best + 1} - {best}):
            if 0 <= k <= self.k and self._retry_due(
                bucket, k, rates[k] / rates[best], here is None
            ):
                return k
        if best and self._arm(bucket, best).step_s is None and self._lost_below(bucket):
            return 0  # predicted best, never run here, but plain decoding won at a smaller size
        return best

    def _retry_due(self, bucket: int, k: int, relative: float, borrowed: bool) -> bool:
        """Whether `k`, predicted at `relative` times the chosen K's rate, is tried now: where this
        batch size's rates are read from another's (`borrowed`), FIRST_LOOK steps after it was first wanted here
        (a K: unless plain decoding won at a smaller size); then EXPLORE_EVERY's steps after it last
        ran here, a K sooner where predicted within CLOSE of the chosen one (down to a
        sixteenth)."""
        arm = self._arm(bucket, k, last_step=self.steps)  # never run here: its wait starts now
        if arm.step_s is None and borrowed and not (k and self._lost_below(bucket)):
            every = FIRST_LOOK  # a batch size's first look at it
        elif not k:
            every = EXPLORE_EVERY["plain"]
        else:
            behind = max(1 / relative - 1, 0.0)
            every = EXPLORE_EVERY["speculate"] * min(1.0, max(1 / 16, behind / CLOSE))
        return self.steps - arm.last_step > every

    def _lost_below(self, bucket: int) -> bool:
        """Whether plain decoding beat every K at the largest smaller batch size that measured both:
        then no K is first tried at a larger one, whose verification only costs more."""
        below = [b for b in self._measured_buckets() if b < bucket]
        if not below:
            return False
        rates = self._rates_at(max(below))
        return max(rates, key=rates.get) == 0

    def _measured_buckets(self) -> set[int]:
        """Batch-size buckets where plain decoding and some K both ran."""
        ran = [(b, k) for (b, k), arm in self.arms.items() if arm.step_s is not None]
        return {b for b, k in ran if not k} & {b for b, k in ran if k}

    def _nearest_rates(self, bucket: int) -> dict[int, float] | None:
        """The rates at the nearest batch size that measured both kinds of step."""
        both = sorted((abs(b - bucket), b) for b in self._measured_buckets())
        return self._rates_at(both[0][1]) if both else None

    def _rates_at(self, bucket: int) -> dict[int, float] | None:
        """Each K's predicted tokens per second at a batch-size bucket, from its measured step time
        or one interpolated between the plain step and the nearest speculated K that ran there;
        None where plain decoding or every K is unmeasured there."""
        times = {
            k: arm.step_s
            for (b, k), arm in self.arms.items()
            if b == bucket and arm.step_s is not None
        }
        if 0 not in times or len(times) < 2:
            return None
        plain, tokens = times[0], self.acceptance.tokens_by_k()
        rates = {}
        for k in range(self.k + 1):
            step_s = times.get(k)
            if step_s is None:
                ran = min((j for j in times if j), key=lambda j: abs(j - k))
                # a noisy plain step can read slower than a speculated one: never below the fastest
                step_s = max(plain + (times[ran] - plain) * k / ran, min(times.values()))
            rates[k] = tokens[k] / step_s
        return rates

    def record(
        self, k: int, decoding: int, seconds: float, rounds: list[tuple[int, int]] = ()
    ) -> None:
        """A step at K = k that decoded `decoding` sequences (and prefilled none) in `seconds`;
        `rounds`: (accepted, drafted) for each of its verified rows."""
        if rounds:
            self.acceptance.add(list(rounds))
        # a catch-up is not a steady round
        if decoding == 0 or seconds <= 0 or (k and self.caught_up):
            return
        bucket = decoding.bit_length()
        arm = self._arm(bucket, k)
        before = arm.step_s
        arm.add(seconds)
        arm.last_step = self.steps
        if before:
            # the host's speed and the batch's context lengths move every K's step time alike:
            # the ones not running keep their ratio to this one instead of a stale time
            for (b, other_k), other in self.arms.items():
                if b == bucket and other_k != k and other.step_s is not None:
                    other.step_s *= arm.step_s / before

    def summary(self) -> dict:
        return {"steps_by_k": dict(sorted(self.steps_by_k.items()))}

    def reset(self) -> None:
        """Fresh step counts (the measured times and acceptance stay: they are what the choice has
        learned)."""
        self.steps_by_k.clear()
