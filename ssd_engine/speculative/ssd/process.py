"""Start the SSD draft process (coordinator side); its main loop is speculative/ssd/draft/loop.py.
It dies with the coordinator, and loads its model before announcing itself, so a draft that fails
to load is reported at start-up with its exit code, never as a hang."""

import os
import subprocess
from dataclasses import asdict, dataclass, replace

import torch.distributed as dist

from ssd_engine.core.config_sections import CacheConfig, ModelConfig
from ssd_engine.core.speculative_config import SpeculativeConfig, SSDConfig
from ssd_engine.core.synthetic_hook import Synthetic
from ssd_engine.distributed import supervise
from ssd_engine.runtime.model_runner import RunnerSpec
from ssd_engine.speculative.ssd import reply_window
from ssd_engine.speculative.ssd.codec import ReplyLayout
from ssd_engine.speculative.ssd.reply_window import ReplyWindow

READY_KEY = "draft/ready"


@dataclass(frozen=True)
class DraftSpec:
    """What the draft process needs: its runner (the target's sizes, the draft's model; the draft
    adds scratch blocks itself), the speculative options, the Saguaro plan's fan-outs."""

    runner: RunnerSpec
    speculative: SpeculativeConfig
    fanouts: tuple  # ((temperature, (F_0..F_K)), ...): a request takes the nearest one's
    fanout_tables: tuple  # ((temperature, (F at budget 1..planned)), ...); empty: scale down
    vocab: int  # proposable ids: shared by tokenizer, draft and target
    max_num_seqs: int
    seed: int
    # structured outputs: the target's tokenizer folder and end ids
    tokenizer: str = ""
    eos_token_ids: tuple = ()

    @property
    def k(self) -> int:
        return self.speculative.k

    def to_args(self) -> dict:
        return asdict(self)

    @classmethod
    def from_args(cls, args: dict) -> "DraftSpec":
        runner, speculative = args["runner"], args["speculative"]
        runner_spec = RunnerSpec(
            ModelConfig(**runner["model"]),
            CacheConfig(**runner["cache"]),
            runner["max_position"],
            runner["checkpoint_config"],
        )
        synthetic = speculative["synthetic"]
        speculative = SpeculativeConfig(
            **{
                **speculative,
                "ssd": SSDConfig(**speculative["ssd"]),
                "synthetic": None if synthetic is None else Synthetic(**synthetic),
            }
        )
        return cls(**{**args, "runner": runner_spec, "speculative": speculative})


def spawn(
    draft_spec: DraftSpec, cores: list[int] | None, threads: int, timeout_s: float
) -> tuple[subprocess.Popen, dist.TCPStore, ReplyWindow | None]:
    """-> (process, store, reply window), once the draft has loaded its model."""
    store = supervise.host_store(2)
    draft_spec = replace(draft_spec, runner=draft_spec.runner.for_other_processes())
    args = dict(
        port=store.port,
        cores=cores,
        threads=threads,
        timeout_s=timeout_s,
        draft_args=draft_spec.to_args(),
    )
    if not reply_window.supported():
        draft = supervise.start(
            "SSD draft process", "ssd_engine.speculative.ssd.draft.main", args, READY_KEY
        )
        supervise.wait_ready(store, [draft])
        return draft.process, store, None
    # every sequence sending whole rows
    capacity = ReplyLayout(
        draft_spec.k, (draft_spec.vocab,) * draft_spec.max_num_seqs, draft_spec.vocab
    ).size
    fd = ReplyWindow.create_fd(capacity)
    try:
        window = ReplyWindow(fd, capacity)
        args.update(reply_fd=fd, reply_capacity=capacity)
        draft = supervise.start(
            "SSD draft process",
            "ssd_engine.speculative.ssd.draft.main",
            args,
            READY_KEY,
            pass_fds=(fd,),
        )
    finally:
        os.close(fd)  # the mapping and the child's copy keep the memory
    supervise.wait_ready(store, [draft])
    return draft.process, store, window
