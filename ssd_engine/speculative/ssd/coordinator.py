"""SSD, coordinator side: the speculator the engine loop calls each round, backed by the draft
process or thread. Per round it sends one request (the round's news) and, when sequences decode,
receives one reply with their next K tokens and q rows. If the draft dies or misses its deadline
the client warns once, stops it and proposes with the local n-gram backup from then on: every
request still finishes exactly, because every proposal is verified."""

import json
import logging
import time
from collections import deque

import torch

from ssd_engine.core.structures import Outcome, Proposal, ScheduledBatch, Sequence
from ssd_engine.distributed import supervise
from ssd_engine.saguaro.plan import SaguaroPlan
from ssd_engine.saguaro.source import Source
from ssd_engine.speculative.ngram import fast_proposal
from ssd_engine.speculative.prompt_window import skipped_span, windowed
from ssd_engine.speculative.ssd.codec import ReplyLayout, decode_reply, encode_request
from ssd_engine.speculative.ssd.draft_thread import DraftThread
from ssd_engine.speculative.ssd.link import CoordinatorEnd, DraftLink, DraftLinkError
from ssd_engine.speculative.ssd.metrics import SSDMetrics
from ssd_engine.speculative.ssd.process import DraftSpec, spawn
from ssd_engine.speculative.ssd.proposal_rows import QRows, proposal_probs
from ssd_engine.speculative.ssd.protocol import DraftParams, Entry, Kind, Request, Wanted, q_width

log = logging.getLogger("ssd_engine")


def draft_params(seq: Sequence, skipped: int = 0) -> DraftParams:
    """`skipped`: prompt tokens the draft never reads, not counted in its prompt."""
    p = seq.params
    grammar = json.dumps(p.structured_outputs.key) if p.structured_outputs is not None else ""
    return DraftParams(
        p.temperature,
        p.top_k,
        p.top_p,
        p.min_p,
        -1 if p.seed is None else p.seed,
        grammar,
        seq.num_prompt_tokens - skipped,
    )


class AsyncDraftClient:
    def __init__(
        self,
        draft_spec: DraftSpec,
        target_vocab: int,
        cores: list[int] | None,
        threads: int,
        timeout_s: float,
        generator: torch.Generator,
        device: torch.device,
        plan: SaguaroPlan,
        host: str = "process",
        prompt_window: int | None = None,
    ) -> None:
        self.k, self.vocab, self.target_vocab = draft_spec.k, draft_spec.vocab, target_vocab
        self.prompt_window = prompt_window
        self.device = device  # the target's: proposals are verified there
        self.timeout_s = timeout_s
        self.generator = generator
        self.plan, self.policy = plan, plan.policy
        self.backup_log: deque = deque(maxlen=4096)  # (batch size, cold, backup chosen, b* then)
        self.link: CoordinatorEnd | None = None
        if host == "thread":
            self.process = DraftThread(draft_spec, timeout_s)
            self.pid, self.link, self.name = None, self.process.link, "SSD draft thread"
        else:
            self.process, self._store, window = spawn(draft_spec, cores, threads, timeout_s)
            self.pid, self.name = self.process.pid, f"SSD draft process (pid {self.process.pid})"
            try:
                self.link = DraftLink(
                    self._store, 0, timeout_s, payload_device=device, reply_window=window
                )
            except BaseException:
                self.close()
                raise
        self.metrics = SSDMetrics(self.k)
        self.known: dict[int, int] = {}  # seq_id -> committed tokens the draft has
        self.last_accepted: dict[
            int, int
        ] = {}  # seq_id -> drafts accepted in its last verified round
        self.source: dict[int, Source] = {}
        self.finished: list[int] = []
        self.replied_at: float | None = None
        self.window_s = 0.0  # the verification since the last reply

    @property
    def alive(self) -> bool:
        return self.link is not None

    def propose(self, batch: ScheduledBatch, decoding: list[bool], k: int) -> Proposal | None:
        if k != self.k:
            raise ValueError(f"SSD drafts its K = {self.k} every round, not {k}")
        self.window_s = 0.0
        if self.replied_at is not None:
            self.window_s = time.perf_counter() - self.replied_at
            self.metrics.record_verify(self.window_s)
            self.replied_at = None
        wanted = [seq for seq, dec in zip(batch.seqs, decoding) if dec]
        if self.alive:
            try:
                return self._from_draft(batch.seqs, wanted)
            except DraftLinkError as error:
                self._lost(f"{self.name} failed: {error}")
        return self._local(wanted) if wanted else None

    def _from_draft(self, seqs: list[Sequence], wanted: list[Sequence]) -> Proposal | None:
        if self.process.poll() is not None:
            raise DraftLinkError(f"exited with code {self.process.returncode}")
        cold = sum(s.seq_id not in self.last_accepted for s in wanted)
        backup = self._backup(len(wanted), cold) if wanted else Source.JIT
        request = Request(
            finished=self.finished,
            entries=[e for e in map(self._news, seqs) if e],
            wanted=[Wanted(s.seq_id, q_width(draft_params(s), self.vocab)) for s in wanted],
            backup=backup,
            window_s=self.window_s,
        )
        started = time.perf_counter()
        self.link.send_request(encode_request(request))
        self.finished = []
        if not wanted:
            return None
        layout = ReplyLayout.of(request, self.k, self.vocab)
        reply = decode_reply(self.link.recv_reply(layout.size), layout)
        speculations, t = reply.speculations, reply.timings
        self.replied_at = time.perf_counter()
        self.metrics.record_round(
            t.build_s, self.replied_at - started, t.glue_s, t.step_s, t.step_rows
        )
        if any(speculation.source == Source.JIT for speculation in speculations):
            self.metrics.record_jit(t.lookup_s)
        for seq, speculation in zip(wanted, speculations):
            self.metrics.record_lookup(
                self.last_accepted.pop(seq.seq_id, -1), speculation.source, speculation.bonus_rank
            )
            self.source[seq.seq_id] = speculation.source
        return self._proposal(
            [s.tokens or [0] * self.k for s in speculations],
            [s.q for s in speculations],
            [s.source != Source.NONE for s in speculations],
        )

    def _backup(self, batch_size: int, cold: int) -> Source:
        """Saguaro fallback: what a miss takes this round (`cold`: certain misses)."""
        if self.policy.due():
            self.policy.update(**self.metrics.estimates())
        choice = self.policy.choose(batch_size, cold)
        self.metrics.record_backup(choice)
        self.backup_log.append((batch_size, cold, choice, self.policy.critical_batch))
        return choice

    def summary(self) -> dict:
        return {
            **self.metrics.summary(),
            **self.plan.describe(),
            "estimates": vars(self.policy.estimates),
        }

    def _news(self, seq: Sequence) -> Entry | None:
        have = self.known.get(seq.seq_id)
        self.known[seq.seq_id] = len(seq)
        if have is None:  # new, or back after preemption: its prompt windowed, its outputs whole
            skipped = skipped_span(seq.num_prompt_tokens, self.prompt_window)
            return Entry(
                seq.seq_id, -1, windowed(seq.token_ids, skipped), draft_params(seq, skipped)
            )
        if len(seq) == have:
            return None
        return Entry(seq.seq_id, self.last_accepted.get(seq.seq_id, -1), seq.token_ids[have:])

    def _proposal(self, tokens: list[list[int]], qs: list[QRows], drafted: list[bool]) -> Proposal:
        n = len(tokens)
        return Proposal(
            torch.tensor(tokens, dtype=torch.long).view(n, self.k),
            proposal_probs(qs, self.k, self.target_vocab, self.device),
            torch.tensor([self.k if d else 0 for d in drafted]),
            one_hot=torch.tensor([q is None for q in qs]),
        )

    def _local(self, wanted: list[Sequence]) -> Proposal:
        """Without a draft: n-gram (else random) proposals, verified as one-hot."""
        self.metrics.record_local(len(wanted))
        for seq in wanted:
            self.source[seq.seq_id] = Source.LOCAL
        tokens = [
            fast_proposal(s.token_ids, self.k, self.vocab, s.backup_generator or self.generator)
            for s in wanted
        ]
        return self._proposal(tokens, [None] * len(wanted), [True] * len(wanted))

    def on_outcome(self, outcome: Outcome) -> None:
        """Nothing to roll back here: the draft learns the outcome from the next request."""
        if outcome.accepted is None:  # no drafts were verified
            return
        self.last_accepted[outcome.seq.seq_id] = outcome.accepted
        self.metrics.record_verified(
            self.source.pop(outcome.seq.seq_id, Source.LOCAL), outcome.accepted
        )

    def release(self, seq: Sequence) -> None:
        """Finished or preempted: the draft forgets it (a preempted one comes back as new)."""
        if self.known.pop(seq.seq_id, None) is not None:
            self.finished.append(seq.seq_id)
        self.last_accepted.pop(seq.seq_id, None)
        self.source.pop(seq.seq_id, None)

    def _lost(self, message: str) -> None:
        log.warning("%s; finishing every request with the local n-gram speculator", message)
        self.metrics.draft_failures.append(message)
        self._stop(polite=False)

    def close(self) -> None:
        self._stop(polite=True)

    def _stop(self, polite: bool) -> None:
        link, self.link = self.link, None
        asked = False
        if polite and link is not None and self.process.poll() is None:
            try:
                link.send_request(encode_request(Request(kind=Kind.SHUTDOWN)))
                asked = True
            except Exception:
                pass
        if isinstance(self.process, DraftThread):
            if not asked:  # a building thread ends once it reads this
                self.process.link.send_request(encode_request(Request(kind=Kind.SHUTDOWN)))
            self.process.join(10.0 if asked else 0.0)
            return
        supervise.stop(self.process, exit_s=10.0 if asked else 0.0)
