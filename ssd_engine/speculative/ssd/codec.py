"""The byte layout of protocol.py's messages, shared by both ends: one uint8 tensor of typed
sections, each on an 8-byte boundary so it is read in place as a typed view.
Request = [int64 ints | float32 floats | utf-8 text]
    header    [total_bytes, kind, backup, n_finished, n_entries, n_wanted, n_ints, n_floats]
    finished  ids
    entries   [seq_id, is_new, k, n_tokens, (top_k, seed, num_prompt_tokens, grammar bytes when new),
              tokens...]
    wanted    [seq_id, q_width]
    floats    [window_s], then per new entry [temperature, top_p, min_p]
    text      the new entries' grammars, one after another
total_bytes leads, so the link reads a request's length from its first word (`request_size`).
Reply = [float64 timings | int64 ints | narrow q slots | wide q slots] (`ReplyLayout`):
    timings   [build_s, lookup_s, glue_s, step_s]
    ints      [step_rows], then per wanted [source, q_mode, bonus_rank, K tokens]
    q slots   per wanted K * q_width floats: COMPACT as [K x top_k int32 ids][K x top_k float32
              probs], FULL rows as they are, unused when ONE_HOT. Narrow slots come first, wide
              (whole-row) ones last, each in wanted order: all a host reads lies before `wide_at`,
              so a reply held on a GPU crosses to the host only up to there.
"""

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from ssd_engine.saguaro.source import Source
from ssd_engine.speculative.ssd.protocol import (
    DraftParams,
    DraftTimings,
    Entry,
    Kind,
    QMode,
    Reply,
    Request,
    Speculation,
    SupportRows,
    Wanted,
    q_mode_of_width,
)

REQUEST_HEADER = 8
TIMINGS = 4
INT, FLOAT, TIME = 8, 4, 8  # bytes per int64, float32, float64


def request_size(frame: torch.Tensor) -> int:
    """Bytes of the request that starts `frame` (at least its first 8 bytes)."""
    return int(frame[:INT].numpy().view(np.int64)[0])


def encode_request(req: Request) -> torch.Tensor:
    ints = [
        0,
        int(req.kind),
        int(req.backup),
        len(req.finished),
        len(req.entries),
        len(req.wanted),
        0,
        0,
    ]
    floats = [req.window_s]
    text = b""
    ints += req.finished
    for e in req.entries:
        p = e.params
        ints += (e.seq_id, int(p is not None), e.accepted, len(e.tokens))
        if p is not None:
            grammar = p.grammar.encode()
            ints += (p.top_k, p.seed, p.num_prompt_tokens, len(grammar))
            floats += (p.temperature, p.top_p, p.min_p)
            text += grammar
        ints += e.tokens
    for w in req.wanted:
        ints += (w.seq_id, w.q_width)
    ints[6], ints[7] = len(ints), len(floats)
    numbers = INT * len(ints) + FLOAT * len(floats)
    ints[0] = numbers + len(text)
    out = np.empty(ints[0], dtype=np.uint8)
    out[: INT * len(ints)].view(np.int64)[:] = ints
    out[INT * len(ints) : numbers].view(np.float32)[:] = floats
    out[numbers:] = np.frombuffer(text, dtype=np.uint8)
    return torch.from_numpy(out)


def decode_request(frame: torch.Tensor) -> Request:
    raw = frame.numpy()
    total, kind, backup, n_fin, n_ent, n_want, n_ints, n_floats = (
        raw[: INT * REQUEST_HEADER].view(np.int64).tolist()
    )
    if raw.size < total:
        raise ValueError(f"request of {total} bytes, got {raw.size}")
    w = raw[: INT * n_ints].view(np.int64).tolist()
    floats = iter(raw[INT * n_ints : INT * n_ints + FLOAT * n_floats].view(np.float32).tolist())
    text, text_at = raw[INT * n_ints + FLOAT * n_floats : total].tobytes(), 0
    at = REQUEST_HEADER
    req = Request(Kind(kind), w[at : at + n_fin], backup=Source(backup), window_s=next(floats))
    at += n_fin
    for _ in range(n_ent):
        seq_id, is_new, accepted, n = w[at : at + 4]
        at += 4
        params = None
        if is_new:
            top_k, seed, num_prompt, n_text = w[at : at + 4]
            at += 4
            grammar, text_at = text[text_at : text_at + n_text].decode(), text_at + n_text
            params = DraftParams(
                next(floats), top_k, next(floats), next(floats), seed, grammar, num_prompt
            )
        req.entries.append(Entry(seq_id, accepted, w[at : at + n], params))
        at += n
    req.wanted = [Wanted(w[i], w[i + 1]) for i in range(at, at + 2 * n_want, 2)]
    return req


@dataclass(frozen=True)
class ReplyLayout:
    """Where everything sits in a reply: a function of the request alone."""

    k: int
    q_widths: tuple[int, ...]  # per wanted sequence, floats per drafted position
    vocab: int  # the draft's proposable ids: a slot this wide carries whole rows

    @classmethod
    def of(cls, request: Request, k: int, vocab: int) -> "ReplyLayout":
        return cls(k, tuple(w.q_width for w in request.wanted), vocab)

    @property
    def ints_at(self) -> int:
        return TIME * TIMINGS

    @property
    def q_at(self) -> int:
        return self.ints_at + INT * (1 + len(self.q_widths) * (3 + self.k))

    @cached_property
    def slots_at(self) -> tuple[int, ...]:
        """Byte offset of each wanted sequence's q slot: narrow slots, then wide ones."""
        at, offsets = self.q_at, {}
        for wide in (False, True):
            for i, width in enumerate(self.q_widths):
                if (width == self.vocab) == wide:
                    offsets[i] = at
                    at += FLOAT * self.k * width
        return tuple(offsets[i] for i in range(len(self.q_widths)))

    @property
    def wide_at(self) -> int:
        return self.q_at + FLOAT * self.k * sum(w for w in self.q_widths if w != self.vocab)

    @property
    def size(self) -> int:
        return self.q_at + FLOAT * self.k * sum(self.q_widths)


def q_slots(
    speculations: list[Speculation], widths: tuple[int, ...], vocab: int
) -> list[tuple[QMode, SupportRows | None]]:
    """Each speculation's mode in its slot, and for COMPACT its support on the host (one read)."""
    modes = [
        QMode.ONE_HOT if s.q is None else q_mode_of_width(w, vocab)
        for s, w in zip(speculations, widths, strict=True)
    ]
    compact = [i for i, m in enumerate(modes) if m == QMode.COMPACT]
    # one topk of top_k + 1 picks the support and checks it: the extra value is zero iff every row
    # has at most top_k tokens. A row with more (ties) goes one-hot, which is still exact.
    tops = [speculations[i].q.topk(widths[i] // 2 + 1, dim=-1) for i in compact]
    values = torch.cat([t.values.flatten() for t in tops]).cpu() if tops else None
    indices = torch.cat([t.indices.flatten().int() for t in tops]).cpu() if tops else None
    out: list[tuple[QMode, SupportRows | None]] = [(m, None) for m in modes]
    at = 0
    for i, top in zip(compact, tops):
        shape = top.values.shape
        rows_values = values[at : at + shape.numel()].view(shape)
        rows_ids = indices[at : at + shape.numel()].view(shape)
        at += shape.numel()
        fits = not bool(rows_values[:, -1].max() > 0)
        out[i] = (
            (QMode.COMPACT, SupportRows(rows_ids[:, :-1], rows_values[:, :-1]))
            if fits
            else (QMode.ONE_HOT, None)
        )
    return out


def encode_reply(
    reply: Reply, layout: ReplyLayout, out: torch.Tensor | None = None
) -> torch.Tensor:
    """`out`: a host or GPU buffer to write into when large enough. GPU rows are copied without
    waiting (into pinned memory or a GPU `out`); one stream sync covers the reply."""
    k, vocab = layout.k, layout.vocab
    gpu = next(
        (s.q.device for s in reply.speculations if isinstance(s.q, torch.Tensor) and s.q.is_cuda),
        None,
    )
    buf = (
        out[: layout.size]
        if out is not None and out.numel() >= layout.size
        else torch.empty(layout.size, dtype=torch.uint8, pin_memory=gpu is not None)
    )
    # what a host reads (before wide_at) is written on the host, in place when `buf` is there
    head = (
        buf[: layout.wide_at]
        if buf.device.type == "cpu"
        else torch.empty(layout.wide_at, dtype=torch.uint8, pin_memory=True)
    )
    raw = head.numpy()
    t = reply.timings
    raw[: layout.ints_at].view(np.float64)[:] = (t.build_s, t.lookup_s, t.glue_s, t.step_s)
    ints = [t.step_rows]
    slots = q_slots(reply.speculations, layout.q_widths, vocab)
    wide_at = layout.wide_at
    for speculation, width, at, (mode, support) in zip(
        reply.speculations, layout.q_widths, layout.slots_at, slots
    ):
        tokens = speculation.tokens or [0] * k
        if len(tokens) != k:
            raise ValueError(f"a speculation of {len(tokens)} tokens, the reply carries {k}")
        ints += (int(speculation.source), int(mode), speculation.bonus_rank, *tokens)
        slot = (head if at < wide_at else buf)[at : at + FLOAT * k * width]
        if mode == QMode.FULL:
            slot.view(torch.float32).view(k, width).copy_(speculation.q, non_blocking=True)
        elif mode == QMode.COMPACT:
            ids, probs = _compact_views(slot, k, width // 2)
            ids.copy_(support.ids)
            probs.copy_(support.probs)
        elif width:
            slot.zero_()  # an unused slot: nothing stale crosses
    raw[layout.ints_at : layout.q_at].view(np.int64)[:] = ints
    if buf.device.type != "cpu":
        buf[: layout.wide_at].copy_(head, non_blocking=True)
    if gpu is not None or buf.is_cuda:
        # the rows' copies must be done before the reply is announced
        torch.cuda.current_stream(gpu or buf.device).synchronize()
    return buf


def decode_reply(buf: torch.Tensor, layout: ReplyLayout) -> Reply:
    """q rows come back as views of `buf` (FULL: [K, vocab] floats; COMPACT: `SupportRows`), valid
    until `buf` is reused. A GPU `buf` crosses to the host only up to `wide_at`."""
    k = layout.k
    head = buf if buf.device.type == "cpu" else buf[: layout.wide_at].cpu()
    raw = head.numpy()
    build_s, lookup_s, glue_s, step_s = raw[: layout.ints_at].view(np.float64).tolist()
    ints = raw[layout.ints_at : layout.q_at].view(np.int64).tolist()
    speculations = []
    i = 1
    for width, at in zip(layout.q_widths, layout.slots_at):
        source, mode, rank = Source(ints[i]), QMode(ints[i + 1]), ints[i + 2]
        speculation = Speculation(
            source, ints[i + 3 : i + 3 + k] if source != Source.NONE else [], bonus_rank=rank
        )
        if mode == QMode.FULL:
            speculation.q = buf[at : at + FLOAT * k * width].view(torch.float32).view(k, width)
        elif mode == QMode.COMPACT:
            speculation.q = SupportRows(
                *_compact_views(head[at : at + FLOAT * k * width], k, width // 2)
            )
        speculations.append(speculation)
        i += 3 + k
    return Reply(DraftTimings(build_s, lookup_s, glue_s, step_s, ints[0]), speculations)


def _compact_views(slot: torch.Tensor, k: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A COMPACT slot's two halves: [k, top_k] int32 ids, then [k, top_k] float32 probabilities."""
    half = FLOAT * k * top_k
    return slot[:half].view(torch.int32).view(k, top_k), slot[half:].view(torch.float32).view(
        k, top_k
    )
