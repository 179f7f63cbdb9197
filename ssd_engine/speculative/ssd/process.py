"""Start the SSD draft process (coordinator side); its main loop is speculative/ssd/draft/loop.py.
It dies with the coordinator, and loads its model before announcing itself, so a draft that fails
to load is reported at start-up with its exit code, never as a hang."""

import os
import subprocess
from dataclasses import asdict, dataclass, fields, replace

import torch.distributed as dist

from ssd_engine.core.config import EngineConfig
from ssd_engine.core.config_sections import CacheConfig, ModelConfig
from ssd_engine.core.options import is_section
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
    adds scratch blocks itself), the engine's resolved config (K and SSD's policy in its speculative
    section, max_num_seqs in its scheduler's, the seed; its model is the target's), the Saguaro
    plan's fan-outs."""

    runner: RunnerSpec
    config: EngineConfig
    fanouts: tuple  # ((temperature, (F_0..F_K)), ...): a request takes the nearest one's
    fanout_tables: tuple  # ((temperature, (F at budget 1..planned)), ...); empty: scale down
    vocab: int  # proposable ids: shared by tokenizer, draft and target
    # structured outputs: the target's tokenizer folder and end ids
    tokenizer: str = ""
    eos_token_ids: tuple = ()

    @property
    def k(self) -> int:
        return self.config.speculative.k

    def to_args(self) -> dict:
        """Plain values (JSON's) that `from_args` rebuilds this spec from."""
        return asdict(self)

    @classmethod
    def from_args(cls, args: dict) -> "DraftSpec":
        runner = args["runner"]
        runner_spec = RunnerSpec(
            _rebuilt(ModelConfig, runner["model"]),
            _rebuilt(CacheConfig, runner["cache"]),
            runner["max_position"],
            runner["checkpoint_config"],
        )
        speculative = args["config"]["speculative"]
        synthetic = speculative["synthetic"]
        speculative = {
            **speculative,
            "synthetic": None if synthetic is None else Synthetic(**synthetic),
        }
        config = _rebuilt(EngineConfig, {**args["config"], "speculative": speculative})
        plain = {name: _tuples(value) for name, value in args.items()}
        return cls(**{**plain, "runner": runner_spec, "config": config})


def _rebuilt(kind: type, values: dict) -> object:
    """The config or section `kind` of `values`, its fields as asdict gave them and JSON carried
    them: sections rebuilt, lists tuples again (every sequence a config holds is a tuple). An
    EngineConfig decides its resolved values again from the same options: the sender's config."""
    return kind(
        **{
            f.name: _rebuilt(f.default_factory, values[f.name])
            if is_section(f)
            else _tuples(values[f.name])
            for f in fields(kind)
        }
    )


def _tuples(value: object) -> object:
    return tuple(map(_tuples, value)) if isinstance(value, (list, tuple)) else value


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
        draft_spec.k,
        (draft_spec.vocab,) * draft_spec.config.scheduler.max_num_seqs,
        draft_spec.vocab,
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
