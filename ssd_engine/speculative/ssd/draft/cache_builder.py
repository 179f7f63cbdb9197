"""Build the speculation cache S^{T+1} while the target verifies round T (SSD, Algorithm 1). Per
sequence with x_1..x_K out: glue (extend the trunk through x_K: the draft's rows at 1..K+1); for
each k with F_k > 0 take the top-F_k bonus candidates at k+1, excluding x_{k+1} (a rejected token
is never the bonus); decode every branch (k, t*) K steps at once, keeping each token's exact q row.
On a hit whose scratch path is intact, the glue copies that path into the trunk, feeds x_K alone."""

import time

import torch

from ssd_engine.saguaro.source import Source
from ssd_engine.sampling.grammar import DraftMasks
from ssd_engine.speculative.ssd.draft.branch_cache import BranchCache, DecodedBranches, find_row
from ssd_engine.speculative.ssd.draft.tree_mask import branch_metadata
from ssd_engine.speculative.ssd.draft.trunk import DraftSeq, Trunk
from ssd_engine.speculative.ssd.protocol import RANK_DEPTH
from ssd_engine.utils.host_upload import padded_rows, upload

KEEP_LOGITS_BYTES = 256 * 2**20  # wider builds recompute the glue


class CacheBuilder:
    def __init__(self, trunk: Trunk, scratch_base: int, max_branches: int) -> None:
        self.trunk = trunk
        self.scratch_base, self.max_branches = (
            scratch_base,
            max_branches,
        )  # slots reserved for branch paths
        # the last build's glue forward and mean branch step
        self.glue_seconds = self.step_seconds = 0.0
        self.step_rows = 0
        self.branch_rows = 0
        self.seconds = 0.0
        self.glue_rows = 0
        # the last build's rows per seq_id, their (k, t*) and step logits [rows, V], for hits
        self.paths: dict[int, tuple[int, int]] = {}
        self.path_keys: list[tuple[int, int]] = []
        self.step_logits: list[torch.Tensor] = []

    def build(self, seqs: list[DraftSeq]) -> None:
        """Fill seq.cache and seq.ranked for every sequence (`sent` must be set)."""
        k = self.trunk.k
        started = time.perf_counter()
        for seq in seqs:
            seq.cache = BranchCache(seq.params.greedy)
            seq.cut_trunk(len(seq) - 1)
        widest = min(max(RANK_DEPTH, max(max(s.fanout) for s in seqs) + 1), self.trunk.vocab)
        # structured requests: what the grammar allows at positions 1..K+1, how many are reachable
        grammar = [
            s.grammar.along(s.sent.tokens, k + 1) if s.grammar is not None else None for s in seqs
        ]
        reused = self._reuse_hit_paths(seqs, widest, grammar)
        self.paths, self.path_keys, self.step_logits = {}, [], []
        feeds = [(s.tokens + s.sent.tokens)[len(s.trunk) :] for s in seqs]
        rows = [1 if r is not None else k + 1 for r in reused]
        glued = self.trunk.extend_rows(seqs, feeds, rows)[:, : self.trunk.vocab]
        free = [allowed is None for allowed in grammar]
        ranks = glued.topk(widest, dim=-1).indices.tolist() if any(free) else []  # one read for all
        top, end = [], 0
        for seq, earlier, n, allowed in zip(seqs, reused, rows, grammar):
            if allowed is None:
                own = ranks[end : end + n]
            else:  # rank only the tokens the grammar allows
                masked = (
                    glued[end : end + n]
                    .float()
                    .masked_fill(~allowed[0][k + 1 - n :, : glued.shape[1]], float("-inf"))
                )
                own = masked.topk(widest, dim=-1).indices.tolist()
            end += n
            seq.ranked = (earlier or []) + own
            top.append(seq.ranked)
        self.glue_seconds, self.glue_rows = time.perf_counter() - started, sum(rows)
        self.step_seconds, self.step_rows = 0.0, 0
        branch_seq, branch_k, branch_tok, spans = self._candidates(seqs, top, grammar)
        self.branch_rows = len(branch_seq)
        for start in range(0, len(branch_seq), self.max_branches):
            part = slice(start, start + self.max_branches)
            # one part only, so its paths survive; its fp32 step logits kept within a bound
            keep = (
                len(branch_seq) <= self.max_branches
                and len(branch_seq) * k * self.trunk.vocab * 4 <= KEEP_LOGITS_BYTES
            )
            branches = self._decode(
                seqs, branch_seq[part], branch_k[part], branch_tok[part], keep_paths=keep
            )
            stop = start + len(branches.keys)
            for seq, (first, last) in zip(seqs, spans):
                seq.cache.add(branches, max(first, start) - start, min(last, stop) - start)
            if keep:
                self.path_keys = branches.keys
                self.paths = {
                    seq.seq_id: span for seq, span in zip(seqs, spans) if span[1] > span[0]
                }
        self.seconds = time.perf_counter() - started

    def _reuse_hit_paths(
        self, seqs: list[DraftSeq], widest: int, grammar: list
    ) -> list[list | None]:
        """Where a sequence's speculation is a branch of the last build (trunk ending just before
        t*): copy its path K/V into the trunk, return its steps' top ids; None where it glues."""
        k, bs, vocab = self.trunk.k, self.trunk.blocks.block_size, self.trunk.vocab
        out, src, dst, hit_rows, free = [], [], [], [], []
        for seq, allowed in zip(seqs, grammar):
            span = self.paths.get(seq.seq_id) if seq.sent.source == Source.HIT else None
            row = find_row(self.path_keys, *span, seq.hit_key) if span is not None else None
            if row is None or len(seq.trunk) != len(seq) - 1:
                out.append(None)
                continue
            fork = len(seq) - 1
            src += [self.scratch_base + row * k + j for j in range(k)]
            dst += [seq.block_table[p // bs] * bs + p % bs for p in range(fork, fork + k)]
            seq.trunk.extend([seq.tokens[-1]] + seq.sent.tokens[: k - 1])
            if allowed is None:
                out.append([])
                hit_rows.append(row)
                free.append(len(out) - 1)
                continue
            steps = torch.stack([step[row, :vocab] for step in self.step_logits])
            steps = steps.float().masked_fill(~allowed[0][:k, :vocab], float("-inf"))
            out.append(steps.topk(widest, dim=-1).indices.tolist())
        if hit_rows:
            steps = torch.stack([step[hit_rows, :vocab] for step in self.step_logits], dim=1)
            for index, ranks in zip(free, steps.topk(widest, dim=-1).indices.tolist()):
                out[index] = ranks
        if src:
            self.trunk.runner.copy_kv(src, dst)
        return out

    def _candidates(self, seqs: list[DraftSeq], top: list, grammar: list):
        """Per branch: its sequence index, k and t*; per sequence: its branches' [start, stop)."""
        k = self.trunk.k
        branch_seq, branch_k, branch_tok, spans = [], [], [], []
        for i, seq in enumerate(seqs):
            first = len(branch_seq)
            reachable = grammar[i][1] if grammar[i] is not None else k + 1
            for accepted, fan in enumerate(seq.fanout[:reachable]):
                excluded = seq.sent.tokens[accepted] if accepted < k else None
                picks = [t for t in top[i][accepted] if t != excluded][:fan]
                branch_seq += [i] * len(picks)
                branch_k += [accepted] * len(picks)
                branch_tok += picks
            spans.append((first, len(branch_seq)))
        return branch_seq, branch_k, branch_tok, spans

    @torch.no_grad()
    def _decode(
        self,
        seqs: list[DraftSeq],
        branch_seq: list[int],
        branch_k: list[int],
        branch_tok: list[int],
        keep_paths: bool,
    ) -> DecodedBranches:
        """Decode these branches K steps at once: row r = branch r."""
        trunk, k = self.trunk, self.trunk.k
        device = trunk.runner.device
        rows = len(branch_seq)
        bs = trunk.blocks.block_size
        width = max(len(s.trunk) for s in seqs)
        pages = -(-width // bs)
        lengths = [len(s) for s in seqs]
        visible_host = [lengths[i] + accepted for i, accepted in zip(branch_seq, branch_k)]
        tables, seq_index, visible, ids = upload(
            [
                padded_rows([s.block_table for s in seqs], pages),
                branch_seq,
                visible_host,
                branch_tok,
            ],
            device,
            torch.int32,
        )
        tables = tables.view(len(seqs), pages)
        scratch = (self.scratch_base + torch.arange(rows * k, device=device)).view(rows, k)
        params = [seqs[i].params for i in branch_seq]
        gens = [seqs[i].generator for i in branch_seq]
        masks = self._branch_masks(seqs, branch_seq, branch_k, branch_tok)
        drawn, rows_q = [], []
        started = time.perf_counter()
        for step in range(k):
            meta = branch_metadata(tables, seq_index, visible, max(visible_host), scratch, step, bs)
            logits = trunk.runner.run_metadata(ids, visible + step, meta)
            ids, q = trunk.sample(
                masks.apply(logits) if masks else logits,
                params,
                gens,
                [seqs[i].fanout[step] for i in branch_seq],
            )
            if masks is not None:
                masks.took(ids)
            if keep_paths:
                self.step_logits.append(logits)
            drawn.append(ids)
            rows_q.append(q)
        if rows > self.step_rows:  # time the widest part
            self.step_seconds, self.step_rows = (time.perf_counter() - started) / k, rows
        return DecodedBranches(
            list(zip(branch_k, branch_tok)),
            torch.stack(drawn, dim=1).cpu(),
            None if rows_q[0] is None else torch.stack(rows_q, dim=1),
        )

    @staticmethod
    def _branch_masks(
        seqs: list[DraftSeq], branch_seq: list[int], branch_k: list[int], branch_tok: list[int]
    ) -> DraftMasks | None:
        """Each branch's grammar: its sequence's advanced over x_1..x_k and t* (None: unstructured,
        or a path the grammar forbids)."""
        if not any(seqs[i].grammar is not None for i in branch_seq):
            return None
        states = []
        for i, accepted, bonus in zip(branch_seq, branch_k, branch_tok):
            state = seqs[i].grammar.fork() if seqs[i].grammar is not None else None
            if state is not None and not all(
                state.advance(t) for t in seqs[i].sent.tokens[:accepted] + [bonus]
            ):
                state = None
            states.append(state)
        return DraftMasks(states)


def bonus_rank(seq: DraftSeq, k: int, bonus: int) -> int:
    """`bonus`'s rank among outcome k's candidates (RANK_DEPTH: untracked); cached iff < F_k."""
    excluded = seq.sent.tokens[k] if k < len(seq.sent.tokens) else None
    candidates = [t for t in seq.ranked[k] if t != excluded][:RANK_DEPTH]
    return candidates.index(bonus) if bonus in candidates else RANK_DEPTH
