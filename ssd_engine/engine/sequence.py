"""Per-request state: tokens, how many have KV computed, pages, and output bookkeeping."""
import enum
import functools
import itertools
import time
from dataclasses import dataclass, field

import torch

from ssd_engine.sampling.streams import Stream, stream_generator
from ssd_engine.sampling_params import SamplingParams


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
    def __init__(self, prompt_token_ids: list[int], params: SamplingParams, block_size: int,
                 prompt: str | None = None) -> None:
        self.seq_id = next(_ids)
        self.prompt = prompt
        self.params = params
        self.block_size = block_size
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0   # tokens whose K/V is in the cache
        self.num_cached_tokens = 0     # of those, how many came from the prefix cache
        self.block_table: list[int] = []
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.metrics = SequenceMetrics()
        # a seeded request owns its streams, so its tokens don't depend on batch composition;
        # the target's and the draft's are unrelated (see sampling/streams.py)
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = stream_generator(params.seed, Stream.TARGET)

    def __len__(self) -> int:
        return len(self.token_ids)

    @functools.cached_property
    def draft_generator(self) -> torch.Generator | None:
        """The colocated (SD) draft's sampling stream of a seeded request."""
        return None if self.params.seed is None else stream_generator(self.params.seed, Stream.DRAFT)

    @functools.cached_property
    def backup_generator(self) -> torch.Generator | None:
        """The coordinator's fast backup's stream of a seeded request (after a draft failure)."""
        return None if self.params.seed is None else stream_generator(self.params.seed, Stream.BACKUP, "coordinator")

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

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
        return self.token_ids[index * self.block_size:(index + 1) * self.block_size]
