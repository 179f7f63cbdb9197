"""Continuous batching with chunked prefill and preemption by recompute.

Running sequences go first (oldest first), then waiting ones while the token budget and
`max_num_seqs` allow. When blocks run out, the newest running sequence is preempted: its blocks are
freed and it returns to the front of the queue (FCFS fairness)."""

import time
from collections import deque
from typing import Callable, Protocol

from ssd_engine.core.structures import ScheduledBatch, Sequence, SequenceStatus
from ssd_engine.engine.prefill_pacer import PrefillPacer
from ssd_engine.runtime.block_manager import BlockManager
from ssd_engine.sampling.verifier import StepResult


class SequenceHolder(Protocol):
    """A part keeping per-sequence state beside the target's blocks (draft KV, grammars...)."""

    def release(self, seq: Sequence) -> None:
        """Forget `seq`: its blocks were freed (it finished, was aborted, or was preempted)."""
        ...


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        prefill_tokens_while_decoding: int | None = None,
        pacer: PrefillPacer | None = None,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefill_tokens_while_decoding = prefill_tokens_while_decoding
        self.pacer = pacer  # caps a step's prompt tokens by time while others decode
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._holders: list[SequenceHolder] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def tell_on_release(self, holder: SequenceHolder) -> None:
        """`holder.release(seq)` is called whenever a sequence's blocks are freed."""
        self._holders.append(holder)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def prefill_pending(self) -> bool:
        """Whether the next step reads prompt tokens: a running prompt not yet read whole, or a
        waiting request with a free place in the batch."""
        return any(len(s) - s.num_computed_tokens > 1 for s in self.running) or bool(
            self.waiting and len(self.running) < self.max_num_seqs
        )

    def schedule(self, k: int = 0) -> ScheduledBatch:
        """`k`: draft tokens a decoding sequence is verified with this step (its extra slots)."""
        batch = ScheduledBatch([], [])
        budget = prefill_budget = self.max_num_batched_tokens
        decoders = sum(1 for s in self.running if len(s) - s.num_computed_tokens == 1)
        if decoders:  # the running requests' next token waits for the step's prompt tokens
            if self.prefill_tokens_while_decoding:
                prefill_budget = self.prefill_tokens_while_decoding
            if self.pacer is not None:
                prefill_budget = min(prefill_budget, self.pacer.prompt_tokens(decoders, k))
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            remaining = len(seq) - seq.num_computed_tokens
            decoding = remaining == 1
            want = 1 + k if decoding else min(remaining, budget, prefill_budget)
            if decoding and want > budget:
                break
            if want == 0:  # a prompt with no prefill budget left this step: it goes on next step
                index += 1
                continue
            if not self._make_room(seq, seq.num_computed_tokens + want, batch):
                break  # it preempted itself: it was the newest, nothing after it runs
            batch.seqs.append(seq)
            batch.num_new_tokens.append(want)
            budget -= want
            prefill_budget -= 0 if decoding else want
            index += 1
        while (
            self.waiting
            and min(budget, prefill_budget) > 0
            and len(self.running) < self.max_num_seqs
        ):
            seq = self.waiting[0]
            if seq.waits_for_leader or not self.block_manager.can_allocate(seq):
                break  # FIFO: a sample waits a step for its leader's pages, those behind it too
            self.block_manager.allocate(seq)
            want = min(len(seq) - seq.num_computed_tokens, budget, prefill_budget)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(want)
            budget -= want
            prefill_budget -= want
        return batch

    def _make_room(self, seq: Sequence, num_tokens: int, batch: ScheduledBatch) -> bool:
        """Grow `seq` to `num_tokens` slots, preempting the newest sequences if blocks run out."""
        bm = self.block_manager
        while bm.slots_needed(seq, num_tokens) > bm.num_free_blocks:
            victim = self.running[-1]
            self._preempt(victim, batch)
            if victim is seq:
                return False
        bm.grow(seq, num_tokens)
        return True

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        if seq in batch.seqs:
            i = batch.seqs.index(seq)
            del batch.seqs[i], batch.num_new_tokens[i]
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def postprocess(
        self,
        batch: ScheduledBatch,
        speculated: list[bool],
        results: list[StepResult],
        append: Callable[[Sequence, StepResult], None],
        on_verified: Callable[[Sequence, StepResult], None],
    ) -> list[Sequence]:
        """After a step's forward, each sequence of `batch` with its result: `append` adds its emitted
        tokens (and checks its stops); its computed tokens and pages follow; a verified sequence's
        outcome goes to `on_verified` before a finished one is released. -> the finished ones."""
        finished = []
        for seq, n, verified, result in zip(batch.seqs, batch.num_new_tokens, speculated, results):
            if result.tokens is None:  # a prefill chunk that does not reach the end of the prompt
                seq.num_computed_tokens += n
                continue
            if seq.metrics.first_token_time is None:
                seq.metrics.first_token_time = time.perf_counter()
            append(seq, result)
            # every emitted token but the last has its K/V computed; rejected drafts' slots are dropped
            seq.num_computed_tokens = len(seq) - 1
            self.settle(seq, verified)
            if verified:
                on_verified(seq, result)
            if seq.finish_reason is not None:
                seq.metrics.finish_time = time.perf_counter()
                self.finish(seq)
                finished.append(seq)
        return finished

    def settle(self, seq: Sequence, verified: bool) -> None:
        """After a step appended `seq`'s tokens: a verified sequence frees the slots of its rejected
        drafts; blocks now full of final tokens enter the prefix cache."""
        if verified:
            self.block_manager.trim(seq)
        self.block_manager.commit(seq)

    def finish(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        self._release(seq)

    def abort(self, seq: Sequence) -> None:
        """Drop an unfinished request wherever it is (queued or running) and free its blocks."""
        if seq.status == SequenceStatus.FINISHED:
            return
        if seq in self.waiting:
            self.waiting.remove(seq)
        seq.finish_reason = seq.finish_reason or "abort"
        self.finish(seq)

    def _release(self, seq: Sequence) -> None:
        self.block_manager.deallocate(seq)
        for holder in self._holders:
            holder.release(seq)
