"""The engine's core structures and the two interfaces its loop drives: `Paged` (owns KV blocks),
`Sequence` (one request's state), `ScheduledBatch` (a step's sequences and tokens; builds its feed),
`Proposal` (a speculator's K tokens and q rows), `Outcome` (verification's result for a sequence),
`Runner` (what runs the target) and `Speculator` (SD's draft, SSD's coordinator, or n-gram)."""

import array
import enum
import functools
import itertools
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ssd_engine.core.sampling_params import SamplingParams
from ssd_engine.core.streams import Stream, stream_generator

# A KV block table: int32 block ids, packed, so a step's upload and tensor parallelism's compare
# with the workers' copies are memory copies, not walks over Python lists.
BlockTable = array.array
assert array.array("i").itemsize == 4, "block tables are uploaded as int32"


def new_block_table(blocks=()) -> BlockTable:
    return array.array("i", blocks)


class Paged(Protocol):
    """What owns KV blocks in a BlockManager (runtime/block_manager.py): a target `Sequence`, or a
    draft's own record of one (SD's DraftView, the SSD draft process's DraftSeq), whose blocks and
    computed count are the draft's while its length is the sequence's."""

    block_table: BlockTable
    num_computed_tokens: int  # tokens whose K/V sit in the blocks; dropping the blocks zeroes it

    def __len__(self) -> int: ...


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


@dataclass
class SequenceMetrics:
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None


_ids = itertools.count()


class Sequence:
    def __init__(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        block_size: int,
        prompt: str | None = None,
        sample_index: int = 0,
        leader: "Sequence | None" = None,
    ) -> None:
        """sample_index / leader: sample i of a request with params.n > 1; samples after the first wait
        for the leader's prompt to be computed, then find its pages in the prefix cache."""
        self.seq_id = next(_ids)
        self.sample_index, self.leader = sample_index, leader
        self.prompt = prompt
        self.params = params
        self.block_size = block_size
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0  # tokens whose K/V is in the cache
        self.num_cached_tokens = 0  # of those, how many came from the prefix cache
        self.block_table: BlockTable = new_block_table()
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.metrics = SequenceMetrics()
        # a seeded request owns its streams, so its tokens don't depend on batch composition;
        # the target's and the draft's are unrelated (see core/streams.py)
        self.generator: torch.Generator | None = None
        # per output token: {token id: log-probability}, the chosen one first (params.logprobs set)
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        if params.seed is not None:
            self.generator = stream_generator(params.seed, Stream.TARGET, *self._salt)

    def __len__(self) -> int:
        return len(self.token_ids)

    @functools.cached_property
    def draft_generator(self) -> torch.Generator | None:
        """The colocated (SD) draft's sampling stream of a seeded request."""
        return (
            None
            if self.params.seed is None
            else stream_generator(self.params.seed, Stream.DRAFT, *self._salt)
        )

    @functools.cached_property
    def backup_generator(self) -> torch.Generator | None:
        """The coordinator's fast backup's stream of a seeded request (after a draft failure)."""
        return (
            None
            if self.params.seed is None
            else stream_generator(self.params.seed, Stream.BACKUP, "coordinator", *self._salt)
        )

    @property
    def _salt(self) -> tuple:
        """A seeded request's sample i > 0 draws from streams of its own (sample 0's are n = 1's)."""
        return (f"sample {self.sample_index}",) if self.sample_index else ()

    @property
    def waits_for_leader(self) -> bool:
        leader = self.leader
        return (
            leader is not None
            and leader.status != SequenceStatus.FINISHED
            and leader.num_computed_tokens < leader.num_prompt_tokens
        )

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_blocks(self) -> int:
        return (len(self.token_ids) + self.block_size - 1) // self.block_size

    def block_tokens(self, index: int) -> list[int]:
        return self.token_ids[index * self.block_size : (index + 1) * self.block_size]


@dataclass
class Proposal:
    tokens: torch.Tensor  # [n, K] draft tokens of the decoding sequences (batch order)
    probs: torch.Tensor | None  # [n, K, V] rows they were sampled from; None when all greedy
    num_draft: torch.Tensor  # [n] real drafts per row (0: no drafts this round)
    one_hot: torch.Tensor | None = (
        None  # [n] bool: verify this row as deterministic proposals (probs row unused)
    )

    @property
    def k(self) -> int:
        return self.tokens.shape[1]


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]  # tokens each sequence computes this step

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def decoding(self, k: int) -> list[bool]:
        """Which sequences decode with `k` draft slots reserved. A sequence admitted with
        all but its last token from the prefix cache also has one token left, but got n = 1."""
        return [
            len(seq) - seq.num_computed_tokens == 1 and n == 1 + k
            for seq, n in zip(self.seqs, self.num_new_tokens)
        ]

    def feed(
        self, speculated: list[bool], proposal: Proposal | None
    ) -> tuple[list[list[int]], list[list[int]], tuple[list[int], torch.Tensor] | None]:
        """(tokens fed, logit rows) per sequence, and the fed tokens that stay on the device: a
        speculated one feeds its last committed token and its K drafts (K + 1 rows to verify);
        others feed their own tokens and want the last row only at the end of the sequence.
        Drafts are never read on the host (on a GPU that would wait for the draft): they are fed
        as 0, and the third value (flat positions over the step's fed tokens, the proposal's
        tokens) puts them in place on the device; None when nothing is speculated."""
        feed, logit_rows, draft_at, base = [], [], [], 0
        for seq, n, was_speculated in zip(self.seqs, self.num_new_tokens, speculated):
            start = seq.num_computed_tokens
            if was_speculated:
                feed.append([seq.token_ids[-1]] + [0] * (n - 1))
                logit_rows.append(list(range(n)))
                draft_at.extend(range(base + 1, base + n))
            else:
                feed.append(seq.token_ids[start : start + n])
                logit_rows.append([n - 1] if start + n == len(seq) else [])
            base += n
        if not draft_at:
            return feed, logit_rows, None
        # every proposal row belongs to one speculated sequence, in batch order
        assert len(draft_at) == proposal.tokens.numel()
        return feed, logit_rows, (draft_at, proposal.tokens.reshape(-1))


@dataclass(frozen=True)
class Outcome:
    """One speculated sequence after verification and appending its tokens."""

    seq: Sequence
    accepted: int | None  # drafts accepted; None when the round had no drafts for it
    num_kept: int  # tokens whose K/V stays valid (the last emitted one has none yet)


class Runner(Protocol):
    device: torch.device

    @property
    def local(self): ...  # this process's own ModelRunner (rank 0's under tensor parallelism)

    def forward(
        self,
        batch: ScheduledBatch,
        logit_rows: list[list[int]],
        token_ids: list[list[int]] | None = None,
        on_device: tuple[list[int], torch.Tensor] | None = None,
    ) -> torch.Tensor: ...
    def capture_graphs(self, keys: list[tuple]) -> None: ...
    def release(self, seq: Sequence) -> None: ...
    def close(self) -> None: ...


class Speculator(Protocol):
    """Built with the plan's K (`parts.speculative.k`), which the engine also reserves slots and
    captures graphs for: the engine never asks a speculator for its K. `propose`'s `k`: this step's
    drafts per decoding sequence, at most that K (SD's per-step choice; SSD's cache is built for its K
    and takes only it). `prompt_window`: a long prompt's last tokens its draft model reads
    (speculative/prompt_window.py; None: the whole prompt)."""

    prompt_window: int | None

    def propose(self, batch: ScheduledBatch, decoding: list[bool], k: int) -> Proposal | None: ...
    def on_outcome(self, outcome: Outcome) -> None: ...
    def release(self, seq: Sequence) -> None: ...
    def summary(self) -> dict: ...
    def close(self) -> None: ...
