"""Build the speculation cache S^{T+1} while the target verifies round T (SSD, Algorithm 1).

For each sequence with a speculation x_1..x_K out for verification:
1. glue: extend its trunk with the committed tokens it lacks, then x_1..x_K; this yields the
   draft's distribution at every position 1..K+1 of the speculation;
2. predict outcomes: for each accepted count k with fan-out F_k > 0, the bonus-token candidates are
   the draft's top-F_k tokens at position k+1, excluding x_{k+1} (a rejected token is never the
   bonus; k = K has no exclusion);
3. decode every branch (k, t*) K steps at once, each attending to its trunk prefix (committed +
   x_1..x_k) and its own path (tree_mask.py), sampling each token and keeping its exact q row.
"""
import torch

from ssd_engine.spec.draft_trunk import DraftSeq, Trunk
from ssd_engine.spec.payload import HIT, Speculation
from ssd_engine.spec.tree_mask import branch_metadata


class CacheBuilder:
    def __init__(self, trunk: Trunk, fanout: list[int], scratch_base: int, max_branches: int) -> None:
        assert len(fanout) == trunk.k + 1
        self.trunk, self.fanout = trunk, fanout
        self.scratch_base, self.max_branches = scratch_base, max_branches  # slots reserved for branch paths

    @property
    def branches_per_seq(self) -> int:
        return sum(self.fanout)

    def build(self, seqs: list[DraftSeq]) -> None:
        """Fill seq.cache for every sequence (their `sent` speculation must be set)."""
        k = self.trunk.k
        for seq in seqs:
            seq.cache = {}
            seq.cut_trunk(len(seq) - 1)
        feeds = [(s.tokens + s.sent.tokens)[len(s.trunk):] for s in seqs]
        logits = self.trunk.extend(seqs, feeds, k + 1)  # [S, K+1, V]: distributions at positions 1..K+1
        if self.branches_per_seq == 0 or not seqs:
            return
        branch_seq, branch_k, branch_tok = self._candidates(seqs, logits[:, :, :self.trunk.vocab])
        for start in range(0, len(branch_seq), self.max_branches):
            part = slice(start, start + self.max_branches)
            self._decode(seqs, branch_seq[part], branch_k[part], branch_tok[part])

    def _candidates(self, seqs: list[DraftSeq], logits: torch.Tensor):
        """Per branch: its sequence index, accepted count k and bonus token t*."""
        k = self.trunk.k
        widest = max(self.fanout) + 1
        top = logits.topk(min(widest, logits.shape[-1]), dim=-1).indices.tolist()  # [S, K+1, widest]
        branch_seq, branch_k, branch_tok = [], [], []
        for i, seq in enumerate(seqs):
            for accepted, fan in enumerate(self.fanout):
                excluded = seq.sent.tokens[accepted] if accepted < k else None
                picks = [t for t in top[i][accepted] if t != excluded][:fan]
                branch_seq += [i] * len(picks)
                branch_k += [accepted] * len(picks)
                branch_tok += picks
        return branch_seq, branch_k, branch_tok

    @torch.no_grad()
    def _decode(self, seqs: list[DraftSeq], branch_seq: list[int], branch_k: list[int], branch_tok: list[int]) -> None:
        trunk, k = self.trunk, self.trunk.k
        device = trunk.runner.device
        rows = len(branch_seq)
        bs = trunk.blocks.block_size
        width = max(len(s.trunk) for s in seqs)
        pages = -(-width // bs)
        tables = torch.tensor([s.block_table[:pages] + [0] * (pages - len(s.block_table[:pages])) for s in seqs])
        trunk_slots = (tables[:, :, None] * bs + torch.arange(bs)).view(len(seqs), -1)[:, :width].to(device)
        seq_index = torch.tensor(branch_seq, device=device)
        committed = torch.tensor([len(s) for s in seqs], device=device)
        visible = committed[seq_index] + torch.tensor(branch_k, device=device)   # fork point = t*'s position
        scratch = (self.scratch_base + torch.arange(rows * k, device=device)).view(rows, k)
        params = [seqs[i].params for i in branch_seq]
        gens = [seqs[i].generator for i in branch_seq]
        ids = torch.tensor(branch_tok, device=device)
        drawn, rows_q = [], []
        for step in range(k):
            meta = branch_metadata(trunk_slots, seq_index, visible, scratch, step)
            logits = trunk.runner.run_metadata(ids, visible + step, meta)
            ids, q = trunk.sample(logits, params, gens)
            drawn.append(ids)
            rows_q.append(q)
        tokens = torch.stack(drawn, dim=1).tolist()
        q_all = None if rows_q[0] is None else torch.stack(rows_q, dim=1)  # [R, K, vocab]
        for r, (i, accepted, bonus) in enumerate(zip(branch_seq, branch_k, branch_tok)):
            q = None if q_all is None or seqs[i].params.greedy else q_all[r]
            seqs[i].cache[(accepted, bonus)] = Speculation(HIT, tokens[r], q)
