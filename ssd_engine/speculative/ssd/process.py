"""Start the SSD draft process (coordinator side); its main loop is speculative/ssd/draft/loop.py.

Like tensor-parallel workers it is a fresh interpreter (`python -m ssd_engine.speculative.ssd.draft.main`),
pinned to its own cores on CPU or on its own GPU, started and awaited by distributed/supervise.py:
it dies with the coordinator in every phase and finds it through a TCPStore on a kernel-picked
port. It loads its model before announcing itself, so a draft that fails to load is reported at
start-up with its exit code, never as a hang. It inherits the reply window (reply_window.py), sized
for the largest reply a round can bring.
"""
import os
import subprocess
from dataclasses import asdict, dataclass

import torch.distributed as dist

from ssd_engine.core.config_parts import CacheConfig, ModelConfig
from ssd_engine.distributed import supervise
from ssd_engine.runtime.model_runner import RunnerSpec
from ssd_engine.speculative.ssd import reply_window
from ssd_engine.speculative.ssd.codec import ReplyLayout
from ssd_engine.speculative.ssd.reply_window import ReplyWindow

READY_KEY = "draft/ready"


@dataclass(frozen=True)
class DraftSpec:
    """What the draft process needs: its runner (the target's sizes, the draft's model, device and
    layout; the draft adds scratch pages itself) and its speculation settings."""
    runner: RunnerSpec
    k: int                # draft tokens per round
    vocab: int            # proposable ids: shared by tokenizer, draft and target
    fanouts: tuple        # ((temperature, (F_0..F_K)), ...): per request temperature, the nearest
    saguaro_c: float      # Saguaro sampling's down-weighting constant C
    max_num_seqs: int
    seed: int
    fit_window: bool = False  # shrink builds that outlast the verification (draft/build_budget.py)
    synthetic_hit: float | None = None  # benchmarking: P(a lookup hits), whatever the cache holds
    # ((temperature, (F at budget 1, ..., F at the planned budget)), ...): the fan-out a build the
    # run-time budget cuts prepares; empty: the planned fan-out scaled down
    fanout_tables: tuple = ()

    def to_args(self) -> dict:
        """Plain values for the child's JSON arguments."""
        return asdict(self)

    @classmethod
    def from_args(cls, args: dict) -> "DraftSpec":
        runner = args["runner"]
        spec = RunnerSpec(ModelConfig(**runner["model"]), CacheConfig(**runner["cache"]), runner["max_position"])
        return cls(**{**args, "runner": spec})


def spawn(spec: DraftSpec, cores: list[int] | None, threads: int,
          timeout_s: float) -> tuple[subprocess.Popen, dist.TCPStore, ReplyWindow | None]:
    """-> (process, store, the coordinator's view of the reply window); returns once the draft has
    loaded its model and waits on the channel."""
    store = supervise.host_store(2)
    args = dict(port=store.port, cores=cores, threads=threads, timeout_s=timeout_s, spec=spec.to_args())
    if not reply_window.supported():
        draft = supervise.start("SSD draft process", "ssd_engine.speculative.ssd.draft.main", args, READY_KEY)
        supervise.wait_ready(store, [draft])
        return draft.process, store, None
    capacity = ReplyLayout(spec.k, (spec.vocab,) * spec.max_num_seqs, spec.vocab).size  # every sequence sending whole rows
    fd = ReplyWindow.create_fd(capacity)
    try:
        window = ReplyWindow(fd, capacity)
        args.update(reply_fd=fd, reply_capacity=capacity)
        draft = supervise.start("SSD draft process", "ssd_engine.speculative.ssd.draft.main", args, READY_KEY,
                                pass_fds=(fd,))
    finally:
        os.close(fd)  # the mapping and the child's copy keep the memory
    supervise.wait_ready(store, [draft])
    return draft.process, store, window
