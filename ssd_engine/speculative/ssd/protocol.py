"""The messages of an SSD round, as typed values (their byte layout is codec.py's).

Coordinator -> draft, once per round: a `Request`, the round's news (finished ids; one `Entry` per
sequence with new committed tokens; whole prompt + sampling parameters the first time) and the
sequences that need a speculation now (`Wanted`, in batch order), with the backup a miss takes.

Draft -> coordinator, when some sequence is wanted: a `Reply`, the draft's timings and one
`Speculation` per wanted sequence. Its size follows from the request alone (each `Wanted` names
the q slot the reply reserves for it), so the coordinator knows what to receive.
"""
import enum
from dataclasses import dataclass, field

import torch

from ssd_engine.saguaro.source import Source

RANK_DEPTH = 32  # bonus ranks are tracked this deep; deeper ones are reported as RANK_DEPTH


class Kind(enum.IntEnum):
    ROUND = 1
    SHUTDOWN = 2


class QMode(enum.IntEnum):
    """How a speculation's q rows travel in its slot. Every q sent is the exact row its token was
    sampled from; ONE_HOT sends none and the target verifies the tokens as deterministic proposals
    (greedy, FAST, or rows that did not fit the slot), which is still exact."""
    ONE_HOT = 0
    COMPACT = 1  # top-k rows as top_k (id, prob) pairs
    FULL = 2     # whole rows


@dataclass
class DraftParams:
    """What the draft needs of a request's sampling parameters."""
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = -1  # -1: none
    # structured outputs: StructuredOutputsParams' key as JSON ("": none) and where the output starts, so
    # the draft follows the grammar too (higher acceptance; verification masks the target regardless)
    grammar: str = ""
    num_prompt_tokens: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def q_width(params: DraftParams, vocab: int) -> int:
    """Floats per drafted position reserved for its q row: none when greedy (verified one-hot),
    top_k (id, prob) pairs when that is under half a row, else the whole row."""
    if params.greedy:
        return 0
    if 0 < params.top_k < vocab // 2:
        return 2 * params.top_k
    return vocab


def q_mode_of_width(width: int, vocab: int) -> QMode:
    """The best mode a slot of `width` floats allows."""
    if width == 0:
        return QMode.ONE_HOT
    return QMode.FULL if width == vocab else QMode.COMPACT


@dataclass
class Entry:
    seq_id: int
    accepted: int       # drafts accepted in the round just verified (-1: it had no draft speculation)
    tokens: list[int]   # new committed tokens (the bonus token t* last); all tokens so far when new
    params: DraftParams | None = None  # set for a sequence the draft has not seen


@dataclass
class Wanted:
    seq_id: int
    q_width: int  # the reply's q slot for it: floats per drafted position (q_width(params, vocab))


@dataclass
class Request:
    kind: Kind = Kind.ROUND
    finished: list[int] = field(default_factory=list)
    entries: list[Entry] = field(default_factory=list)
    wanted: list[Wanted] = field(default_factory=list)
    backup: Source = Source.JIT  # what a miss takes this round: JIT or FAST
    # the target's last verification (reply -> this request, the coordinator's clock; 0: none):
    # the window the draft's last cache build overlapped (draft/build_budget.py)
    window_s: float = 0.0

    @property
    def wanted_ids(self) -> list[int]:
        return [w.seq_id for w in self.wanted]


@dataclass(frozen=True)
class SupportRows:
    """K q rows given by their supports, as a COMPACT slot carries them: far smaller than the rows
    (40 pairs against 151,936 floats), so the coordinator uploads these and scatters on the device."""
    ids: torch.Tensor    # [K, n] int32; ids past a row's support carry probability 0
    probs: torch.Tensor  # [K, n] float32

    def dense(self, vocab: int) -> torch.Tensor:
        """[K, vocab]: each probability at its id, bit for bit (adding the padding's zeros changes nothing)."""
        return torch.zeros(self.ids.shape[0], vocab).scatter_add_(1, self.ids.long(), self.probs)


@dataclass
class Speculation:
    """One sequence's next K tokens and the rows they were sampled from (None: verify as one-hot)."""
    source: Source
    tokens: list[int]
    q: torch.Tensor | SupportRows | None = None  # [K, vocab] float32 (a received COMPACT slot: SupportRows)
    # where the round's bonus token t* stood among the draft's candidates for it (0 = its first;
    # RANK_DEPTH = deeper than tracked; -1 = no prediction was made): the miss rate at every fan-out
    bonus_rank: int = -1


@dataclass
class DraftTimings:
    """The draft's last cache build (glue forward; one branch-decode step over step_rows rows)
    and this round's lookup."""
    build_s: float = 0.0
    lookup_s: float = 0.0
    glue_s: float = 0.0
    step_s: float = 0.0
    step_rows: int = 0


@dataclass
class Reply:
    timings: DraftTimings
    speculations: list[Speculation]  # one per wanted sequence, in the request's order
