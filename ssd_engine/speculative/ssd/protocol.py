"""The two fused tensors of an SSD round, defined once: pack, unpack, sizes.

Coordinator -> draft: one int64 `Request` in a preallocated buffer of REQUEST_CAPACITY words
(a round whose new prompts do not fit sends the rest in a second tensor; the header says so).

    header  [kind, total_words, n_finished, n_entries, n_wanted, backup, 0, 0]
                                                       backup: what a miss takes this round (JIT or FAST)
    finished ids                                       n_finished words
    entries, one per sequence with news                n_entries variable-length records:
        [seq_id, is_new, k, num_new, tokens...]        k = drafts accepted in the round just verified
                                                       (-1: that round had no draft speculation);
                                                       the bonus token t* is tokens[-1]
        is_new adds [temperature, top_k, top_p, min_p, seed] before the tokens (floats as their
        float32 bit pattern, seed -1 = none); its tokens are then all tokens so far
    wanted ids                                         n_wanted words: need a speculation now, in batch order

Draft -> coordinator: one float32 `Reply`, whose size both sides compute from the request
(`reply_words`), so it needs no header of its own to be received. Token ids are < 2**24, so
float32 holds them exactly.

    header  [build_seconds, lookup_seconds, glue_seconds, step_seconds, step_rows, 0, 0, 0]
            the draft's last cache build (glue forward; one branch-decode step over step_rows rows)
            and this lookup
    per wanted sequence: [source, q_mode, bonus_rank, K tokens...]
        bonus_rank: where the round's bonus token t* stood among the draft's candidates for it
        (0 = its first; RANK_DEPTH = deeper than tracked; -1 = no prediction was made), so the
        coordinator learns the miss rate at every fan-out from any one
    per wanted sequence with a q slot: K rows of q_words(params) floats

source: a `Source` (source.py). q_mode: ONE_HOT (verify as deterministic proposals:
greedy, FAST, or a row that did not fit its slot), COMPACT (top-k rows as top_k (id, prob) pairs),
FULL (the whole row). Every q sent is the exact row its token was sampled from.
"""
from dataclasses import dataclass, field

import torch

from ssd_engine.speculative.ssd.source import Source

REQUEST_CAPACITY = 8192
HEADER = 8
REPLY_HEADER = 8
RANK_DEPTH = 32
ROUND, SHUTDOWN = 1, 2
ONE_HOT, COMPACT, FULL = 0, 1, 2


@dataclass
class DraftParams:
    """What the draft needs of a request's sampling parameters."""
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = -1

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def q_words(params: DraftParams, vocab: int) -> int:
    """Floats per drafted position reserved for its q row."""
    if params.greedy:
        return 0
    if 0 < params.top_k < vocab // 2:
        return 2 * params.top_k
    return vocab


@dataclass
class Entry:
    seq_id: int
    k: int
    tokens: list[int]
    params: DraftParams | None = None  # set for a sequence the draft has not seen (tokens = all so far)


@dataclass
class Request:
    kind: int = ROUND
    finished: list[int] = field(default_factory=list)
    entries: list[Entry] = field(default_factory=list)
    wanted: list[int] = field(default_factory=list)
    backup: Source = Source.JIT


def _f2i(x: float) -> int:
    return int(torch.tensor([x], dtype=torch.float32).view(torch.int32).item())


def _i2f(x: int) -> float:
    return float(torch.tensor([x], dtype=torch.int32).view(torch.float32).item())


def pack_request(req: Request) -> torch.Tensor:
    words = [req.kind, 0, len(req.finished), len(req.entries), len(req.wanted), req.backup, 0, 0]
    words += req.finished
    for e in req.entries:
        words += [e.seq_id, int(e.params is not None), e.k, len(e.tokens)]
        if e.params is not None:
            p = e.params
            words += [_f2i(p.temperature), p.top_k, _f2i(p.top_p), _f2i(p.min_p), p.seed]
        words += e.tokens
    words += req.wanted
    words[1] = len(words)
    return torch.tensor(words, dtype=torch.int64)


def unpack_request(words: torch.Tensor) -> Request:
    w = words.tolist()
    kind, total, n_fin, n_ent, n_want, backup = w[:6]
    assert len(w) >= total, f"request of {total} words, got {len(w)}"
    at = HEADER
    req = Request(kind, w[at:at + n_fin], backup=Source(backup))
    at += n_fin
    for _ in range(n_ent):
        seq_id, is_new, k, n = w[at:at + 4]
        at += 4
        params = None
        if is_new:
            t, top_k, top_p, min_p, seed = w[at:at + 5]
            params = DraftParams(_i2f(t), top_k, _i2f(top_p), _i2f(min_p), seed)
            at += 5
        req.entries.append(Entry(seq_id, k, w[at:at + n], params))
        at += n
    req.wanted = w[at:at + n_want]
    return req


@dataclass
class Speculation:
    """One sequence's next K tokens and the rows they were sampled from (None: verify as one-hot)."""
    source: Source
    tokens: list[int]
    q: torch.Tensor | None = None     # [K, vocab] float32
    bonus_rank: int = -1              # see the reply layout


def reply_words(params: list[DraftParams], k: int, vocab: int) -> int:
    return REPLY_HEADER + len(params) * (3 + k) + sum(k * q_words(p, vocab) for p in params)


def pack_reply(specs: list[Speculation], params: list[DraftParams], k: int, vocab: int,
               timings: tuple, out: torch.Tensor | None = None) -> torch.Tensor:
    size = reply_words(params, k, vocab)
    buf = out[:size] if out is not None and out.numel() >= size else torch.empty(size)
    buf.zero_()
    buf[:len(timings)] = torch.tensor(timings, dtype=torch.float32)
    at = REPLY_HEADER
    modes = []
    for spec, p in zip(specs, params):
        mode = _q_mode(spec, p, vocab)
        modes.append(mode)
        buf[at:at + 3] = torch.tensor([spec.source, mode, spec.bonus_rank], dtype=torch.float32)
        if spec.tokens:
            buf[at + 3:at + 3 + k] = torch.tensor(spec.tokens, dtype=torch.float32)
        at += 3 + k
    for spec, p, mode in zip(specs, params, modes):
        width = q_words(p, vocab)
        if mode == FULL:
            buf[at:at + k * width] = spec.q.reshape(-1)
        elif mode == COMPACT:
            slot = buf[at:at + k * width].view(k, 2, width // 2)
            ids = (spec.q > 0).float().topk(width // 2, dim=-1).indices  # the support, padded with zeros
            slot[:, 0] = ids.float()
            slot[:, 1] = spec.q.gather(1, ids)
        at += k * width
    return buf


def _q_mode(spec: Speculation, p: DraftParams, vocab: int) -> int:
    width = q_words(p, vocab)
    if spec.q is None or width == 0:
        return ONE_HOT
    if width == vocab:
        return FULL
    # ties at the k-th logit can leave more than top_k tokens; such a row is sent as one-hot,
    # which is still exact (any proposal verified as deterministic is)
    return COMPACT if int((spec.q > 0).sum(dim=-1).max()) <= width // 2 else ONE_HOT


def unpack_reply(buf: torch.Tensor, params: list[DraftParams], k: int, vocab: int
                 ) -> tuple[list[Speculation], tuple]:
    timings = tuple(buf[:5].tolist())
    at = REPLY_HEADER
    specs, modes = [], []
    for _ in params:
        source, mode, rank = (int(v) for v in buf[at:at + 3].tolist())
        tokens = [int(t) for t in buf[at + 3:at + 3 + k].tolist()] if source != Source.NONE else []
        specs.append(Speculation(Source(source), tokens, bonus_rank=rank))
        modes.append(mode)
        at += 3 + k
    for spec, p, mode in zip(specs, params, modes):
        width = q_words(p, vocab)
        if mode == FULL:
            spec.q = buf[at:at + k * width].view(k, vocab).clone()
        elif mode == COMPACT:
            slot = buf[at:at + k * width].view(k, 2, width // 2)
            spec.q = torch.zeros(k, vocab).scatter_(1, slot[:, 0].long(), slot[:, 1])
        at += k * width
    return specs, timings
