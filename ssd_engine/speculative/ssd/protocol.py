"""The messages of an SSD round as typed values (their byte layout is codec.py's): once a round a
`Request` (the round's news, and the sequences `Wanted` now); when any is wanted, a `Reply` whose
size follows from the request alone, so the coordinator knows what to receive."""

import enum
from dataclasses import dataclass, field

import torch

from ssd_engine.saguaro.source import Source

RANK_DEPTH = 32  # bonus ranks are tracked this deep; deeper ones are reported as RANK_DEPTH


class Kind(enum.IntEnum):
    ROUND = 1
    SHUTDOWN = 2


class QMode(enum.IntEnum):
    """How a speculation's q rows travel. Every q sent is the exact row its token was sampled from;
    ONE_HOT sends none and the tokens are verified as deterministic proposals, still exactly."""

    ONE_HOT = 0
    COMPACT = 1  # top-k rows as top_k (id, prob) pairs
    FULL = 2


@dataclass
class DraftParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = -1  # -1: none
    grammar: str = ""  # StructuredOutputsParams' key as JSON ("": none)
    num_prompt_tokens: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def q_width(params: DraftParams, vocab: int) -> int:
    """Floats per drafted position for its q row: 0 when greedy, top_k (id, prob) pairs when under
    half a row, else the whole row."""
    if params.greedy:
        return 0
    if 0 < params.top_k < vocab // 2:
        return 2 * params.top_k
    return vocab


def q_mode_of_width(width: int, vocab: int) -> QMode:
    if width == 0:
        return QMode.ONE_HOT
    return QMode.FULL if width == vocab else QMode.COMPACT


@dataclass
class Entry:
    seq_id: int
    accepted: int  # drafts accepted in the round just verified (-1: it had no draft speculation)
    tokens: list[int]  # new committed tokens (the bonus token t* last); all tokens so far when new
    params: DraftParams | None = None  # set for a sequence new to the draft


@dataclass
class Wanted:
    seq_id: int
    q_width: int  # its reply slot's floats per drafted position


@dataclass
class Request:
    kind: Kind = Kind.ROUND
    finished: list[int] = field(default_factory=list)
    entries: list[Entry] = field(default_factory=list)
    wanted: list[Wanted] = field(default_factory=list)
    backup: Source = Source.JIT  # what a miss takes this round: JIT or FAST
    window_s: float = 0.0  # the last verification (last reply -> this request; 0: none)

    @property
    def wanted_ids(self) -> list[int]:
        return [w.seq_id for w in self.wanted]


@dataclass(frozen=True)
class SupportRows:
    """K q rows given by their supports, as a COMPACT slot carries them."""

    ids: torch.Tensor  # [K, n] int32; ids past a row's support carry probability 0
    probs: torch.Tensor  # [K, n] float32

    def dense(self, vocab: int) -> torch.Tensor:
        """[K, vocab]: each probability at its id, bit for bit."""
        return torch.zeros(self.ids.shape[0], vocab).scatter_add_(1, self.ids.long(), self.probs)


@dataclass
class Speculation:
    """One sequence's next K tokens and the rows they were sampled from (None: verify as one-hot)."""

    source: Source
    tokens: list[int]
    q: torch.Tensor | SupportRows | None = None  # [K, vocab] float32
    # the bonus token t*'s rank among the draft's candidates (RANK_DEPTH: deeper; -1: no prediction)
    bonus_rank: int = -1


@dataclass
class DraftTimings:
    """The draft's last cache build (glue; one branch step over step_rows rows), this lookup."""

    build_s: float = 0.0
    lookup_s: float = 0.0
    glue_s: float = 0.0
    step_s: float = 0.0
    step_rows: int = 0


@dataclass
class Reply:
    timings: DraftTimings
    speculations: list[Speculation]  # one per wanted sequence, in order
