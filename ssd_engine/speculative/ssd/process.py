"""Start the SSD draft process (coordinator side); its main loop is speculative/ssd/draft/loop.py.

Like tensor-parallel workers it is a fresh interpreter (`python -m ssd_engine.speculative.ssd.draft.main`),
pinned to its own cores on CPU or on its own GPU, that dies with the coordinator in every phase
(distributed/lifeline.py) and finds it through a TCPStore on a kernel-picked port. It loads its
model before joining the channel, so a draft that fails to load is reported at start-up with its
exit code, never as a hang.
"""
import datetime
import subprocess
import time
from dataclasses import asdict, dataclass

import torch.distributed as dist

from ssd_engine.distributed import lifeline

STARTUP_TIMEOUT_S = 300.0


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


def spawn(spec: DraftSpec, cores: list[int] | None, threads: int, timeout_s: float):
    """-> (process, store); returns once the draft has loaded its model and waits on the channel."""
    store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S))
    args = dict(port=store.port, cores=cores, threads=threads, timeout_s=timeout_s, spec=asdict(spec))
    process = lifeline.start("ssd_engine.speculative.ssd.draft.main", args, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not store.check(["draft/ready"]):
        if process.poll() is not None:
            raise RuntimeError(f"SSD draft process (pid {process.pid}) exited with code {process.returncode} "
                               f"while starting (its traceback is above)")
        if time.monotonic() > deadline:
            process.kill()
            process.wait()
            raise RuntimeError(f"SSD draft process did not start within {STARTUP_TIMEOUT_S:.0f} s")
        time.sleep(0.02)
    return process, store
