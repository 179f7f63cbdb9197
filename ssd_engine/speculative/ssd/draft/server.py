"""The draft's state and round steps: apply the outcomes, look each wanted sequence up (a hit
replies at once, a miss after the fallback), build the next cache while the target verifies."""

import json
import logging
import time

from ssd_engine.core.streams import Stream, stream_generator
from ssd_engine.core.structured_outputs import StructuredOutputsParams
from ssd_engine.models.tokenizer_source import load_tokenizer
from ssd_engine.runtime.block_manager import BlockManager
from ssd_engine.saguaro.source import Source
from ssd_engine.sampling.grammar import Grammars, GrammarState
from ssd_engine.sampling.synthetic import BernoulliDraws, synthetic_draws
from ssd_engine.speculative.ngram import fast_proposal
from ssd_engine.speculative.ssd.draft.build_budget import BuildBudget
from ssd_engine.speculative.ssd.draft.cache_builder import CacheBuilder, bonus_rank
from ssd_engine.speculative.ssd.draft.trunk import DraftSeq, Trunk
from ssd_engine.speculative.ssd.process import DraftSpec
from ssd_engine.speculative.ssd.protocol import DraftParams, DraftTimings, Request, Speculation

log = logging.getLogger("ssd_engine")


class DraftServer:
    def __init__(
        self,
        trunk: Trunk,
        builder: CacheBuilder,
        fanouts: list,
        seed: int,
        budget: BuildBudget | None = None,
        synthetic_hits: BernoulliDraws | None = None,
        fanout_tables: list | None = None,
    ) -> None:
        self.trunk, self.builder, self.seed = trunk, builder, seed
        self.synthetic_hits = synthetic_hits  # benchmarking: hit or miss drawn, not looked up
        self.fanouts = fanouts
        self.budget = budget  # None: every build prepares the planned fan-out
        self.fanout_tables = fanout_tables or []
        self.seqs: dict[int, DraftSeq] = {}
        self.grammar_source: DraftSpec | None = None
        self._grammars: Grammars | None = None  # built on the first structured request
        self.build_seconds = self.lookup_seconds = 0.0
        self.planned_rows = 0

    @property
    def k(self) -> int:
        return self.trunk.k

    def apply(self, req: Request) -> None:
        """Forget finished sequences, learn new ones, append tokens; size the next build."""
        if self.budget is not None:
            b = self.builder  # the cache build's own time, without prompt prefills
            self.budget.update(
                req.window_s, b.seconds, b.glue_seconds, b.branch_rows, self.planned_rows
            )
        for seq_id in req.finished:
            seq = self.seqs.pop(seq_id, None)
            if seq is not None:
                self.trunk.drop(seq)
                if self._grammars is not None:
                    self._grammars.forget(seq_id)
        for e in req.entries:
            if e.params is not None:
                old = self.seqs.pop(e.seq_id, None)
                if old is not None:
                    self.trunk.drop(old)
                draft_gen, backup_gen = self._generators(e.seq_id, e.params, len(e.tokens))
                planned = fanout_for(self.fanouts, e.params.temperature)
                table = (
                    fanout_for(self.fanout_tables, e.params.temperature)
                    if self.fanout_tables
                    else []
                )
                seq = self.seqs[e.seq_id] = DraftSeq(
                    e.seq_id,
                    list(e.tokens),
                    e.params,
                    draft_gen,
                    backup_gen,
                    planned_fanout=planned,
                    fanout=list(planned),
                    fanout_table=table,
                )
                seq.grammar = self._grammar(seq)
                continue
            seq = self.seqs[e.seq_id]
            seq.tokens.extend(e.tokens)
            if seq.grammar is not None:
                seq.grammar.catch_up(seq.outputs)
            key = (e.accepted, e.tokens[-1]) if e.accepted >= 0 and seq.sent is not None else None
            seq.bonus_rank = bonus_rank(seq, *key) if key and seq.ranked else -1
            seq.sent, seq.ranked = None, None
            built, seq.cache = seq.cache, self._kept(seq.cache, key)
            seq.hit_key = key if key in built and seq.cache.get(key) is built[key] else None

    def _grammar(self, seq: DraftSeq) -> GrammarState | None:
        """A structured request's grammar state (None: unstructured or unbuildable; the drafts then
        go unmasked, as verification masks the target regardless)."""
        if not seq.params.grammar:
            return None
        try:
            if self._grammars is None:
                spec = self.grammar_source
                tokenizer = load_tokenizer(spec.tokenizer, None, "auto", self.trunk.vocab)
                self._grammars = Grammars(
                    tokenizer, self.trunk.runner.config.vocab_size, set(spec.eos_token_ids)
                )
            kind, value = json.loads(seq.params.grammar)
            self._grammars.forget(seq.seq_id)
            return self._grammars.state(
                seq.seq_id, StructuredOutputsParams(**{kind: value}), seq.outputs
            )
        except (ValueError, OSError) as error:
            log.warning(
                "SSD draft: no grammar for sequence %d (%s); its drafts are unmasked",
                seq.seq_id,
                error,
            )
            return None

    def _kept(self, cache: dict, key) -> dict:
        """The cache entry the next lookup may serve: the one built for the outcome (empty: a miss).
        Under synthetic_hit a draw decides: a hit serves the outcome's entry, else any built one
        (only its cost is real); a miss serves nothing. Nothing built: a miss without a draw."""
        if self.synthetic_hits is None:
            return {key: cache[key]} if key in cache else {}
        if key is None or not cache:
            return {}
        if not self.synthetic_hits.draw(1)[0]:
            return {}
        return {key: cache[key] if key in cache else next(iter(cache.values()))}

    def lookup(self, wanted: list[int], backup: Source = Source.JIT) -> list[Speculation]:
        """The next speculation of each wanted sequence: from the cache, else from `backup`
        (JIT: the primary drafts now; FAST: n-gram, else random)."""
        started = time.perf_counter()
        speculations: dict[int, Speculation] = {}
        missed = []
        for seq_id in wanted:
            seq = self.seqs[seq_id]
            if not self.trunk.reserve(seq, len(seq) + self.k):
                speculations[seq_id] = Speculation(Source.NONE, [])
            elif seq.cache:
                speculations[seq_id] = next(iter(seq.cache.values()))
            else:
                missed.append(seq)
        if missed and backup == Source.JIT:
            for seq, speculation in zip(missed, self.trunk.draft_jit(missed)):
                speculations[seq.seq_id] = speculation
        else:
            for seq in missed:
                tokens = fast_proposal(seq.tokens, self.k, self.trunk.vocab, seq.backup_generator)
                speculations[seq.seq_id] = Speculation(Source.FAST, tokens)
        for seq_id, speculation in speculations.items():
            seq = self.seqs[seq_id]
            seq.sent, seq.cache = (speculation if speculation.source != Source.NONE else None), {}
            speculation.bonus_rank, seq.bonus_rank = seq.bonus_rank, -1
        self.lookup_seconds = time.perf_counter() - started
        return [speculations[i] for i in wanted]

    def build(self, wanted: list[int]) -> None:
        started = time.perf_counter()
        speculating = [self.seqs[i] for i in wanted if self.seqs[i].sent is not None]
        self.builder.branch_rows = 0
        if speculating:
            planned = [s.planned_fanout for s in speculating]
            self.planned_rows = sum(map(sum, planned))
            if self.budget is not None:
                tables = [s.fanout_table for s in speculating]
                for seq, fanout in zip(speculating, self.budget.fanouts(planned, tables)):
                    seq.fanout = fanout
            self.builder.build(speculating)
        behind = [s for s in self.seqs.values() if s.sent is None and len(s.trunk) < len(s) - 1]
        behind = [s for s in behind if self.trunk.reserve(s, len(s))]
        if behind:  # all but the last token, which the first round feeds
            self.trunk.extend(behind, [s.tokens[len(s.trunk) : -1] for s in behind], 1)
        self.build_seconds = time.perf_counter() - started

    def timings(self) -> DraftTimings:
        b = self.builder
        return DraftTimings(
            self.build_seconds, self.lookup_seconds, b.glue_seconds, b.step_seconds, b.step_rows
        )

    def _generators(self, seq_id: int, params: DraftParams, num_tokens: int) -> tuple:
        """The sequence's draft and backup streams, unrelated to the target's. Salted with the token
        count: one re-learnt after preemption must not replay draws that shaped its output."""
        device = self.trunk.runner.device
        salt = ("request", num_tokens) if params.seed >= 0 else ("engine", seq_id, num_tokens)
        seed = params.seed if params.seed >= 0 else self.seed
        draft = (
            None if params.greedy else stream_generator(seed, Stream.DRAFT, *salt, device=device)
        )
        return draft, stream_generator(seed, Stream.BACKUP, "draft process", *salt, device=device)


def fanout_for(fanouts: list, temperature: float) -> list:
    """Greedy sequences take a greedy entry when there is one; sampled ones the closest T > 0."""
    pool = [f for f in fanouts if (f[0] == 0) == (temperature == 0)] or fanouts
    return list(min(pool, key=lambda f: abs(f[0] - temperature))[1])


def new_server(draft_spec: DraftSpec, runner) -> DraftServer:
    """`runner`'s cache must hold the target-sized cache for trunks plus scratch_slots(...) past it
    for branches. `synthetic_hit` (benchmarking only) is a lookup's drawn probability of a hit."""
    config, cache = draft_spec.config, draft_spec.runner.cache
    ssd, seed = config.speculative.ssd, config.seed
    fanouts = [(t, list(f)) for t, f in draft_spec.fanouts]
    blocks = BlockManager(cache.num_kv_blocks, cache.block_size, enable_prefix_caching=False)
    trunk = Trunk(runner, blocks, draft_spec.k, draft_spec.vocab, ssd.saguaro_c)
    builder = CacheBuilder(
        trunk,
        cache.num_kv_blocks * cache.block_size,
        max_branches(fanouts, config.scheduler.max_num_seqs),
    )
    tables = [(t, [list(f) for f in table]) for t, table in draft_spec.fanout_tables]
    server = DraftServer(
        trunk,
        builder,
        fanouts,
        seed,
        BuildBudget() if ssd.fits_window else None,
        synthetic_draws(config.speculative.synthetic_hit, seed, "cache hits"),
        tables,
    )
    server.grammar_source = draft_spec
    return server


def max_branches(fanouts: list, max_num_seqs: int) -> int:
    return max(1, max_num_seqs * max(sum(f) for _, f in fanouts))


def scratch_slots(fanouts: list, k: int, max_num_seqs: int) -> int:
    return max_branches(fanouts, max_num_seqs) * k
