"""Start the SSD draft process (coordinator side); its main loop is speculative/ssd/draft/loop.py.

Like tensor-parallel workers it is a fresh interpreter (`python -m ssd_engine.speculative.ssd.draft.main`),
pinned to its own cores on CPU or on its own GPU, started and awaited by distributed/supervise.py:
it dies with the coordinator in every phase and finds it through a TCPStore on a kernel-picked
port. It loads its model before announcing itself, so a draft that fails to load is reported at
start-up with its exit code, never as a hang.
"""
import subprocess
from dataclasses import asdict, dataclass

import torch.distributed as dist

from ssd_engine.distributed import supervise

READY_KEY = "draft/ready"


@dataclass(frozen=True)
class DraftSpec:
    model_path: str
    num_blocks: int
    block_size: int
    max_position: int
    dtype: str
    device: str
    weight_layout: str
    k: int
    vocab: int            # proposable ids: shared by tokenizer, draft and target
    fanouts: tuple        # ((temperature, (F_0..F_K)), ...): per request temperature, the nearest
    saguaro_c: float      # Saguaro sampling's down-weighting constant C
    max_num_seqs: int
    seed: int
    attention_backend: str = "auto"
    cuda_graph_max_batch: int = 0


def spawn(spec: DraftSpec, cores: list[int] | None, threads: int,
          timeout_s: float) -> tuple[subprocess.Popen, dist.TCPStore]:
    """-> (process, store); returns once the draft has loaded its model and waits on the channel."""
    store = supervise.host_store(2)
    args = dict(port=store.port, cores=cores, threads=threads, timeout_s=timeout_s, spec=asdict(spec))
    draft = supervise.start("SSD draft process", "ssd_engine.speculative.ssd.draft.main", args, READY_KEY)
    supervise.wait_ready(store, [draft])
    return draft.process, store
