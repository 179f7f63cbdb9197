"""Start the SSD draft process (coordinator side) and run it (draft side).

Like tensor-parallel workers it is a fresh interpreter (`python -m ssd_engine.spec.draft_main`),
pinned to its own cores on CPU or on its own GPU, that dies with the coordinator in every phase
(distributed/lifeline.py) and finds it through a TCPStore on a kernel-picked port. It loads its
model before joining the channel, so a draft that fails to load is reported at start-up with its
exit code, never as a hang.
"""
import datetime
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import torch
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
    process = lifeline.start("ssd_engine.spec.draft_main", args, stdin=subprocess.DEVNULL)
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


def draft_main(port: int, cores: list[int] | None, threads: int, timeout_s: float, spec: dict) -> None:
    from ssd_engine.engine.model_runner import RunnerSpec
    from ssd_engine.spec.draft_link import DraftLink, DraftLinkError
    from ssd_engine.spec.draft_server import new_server, scratch_slots

    spec = DraftSpec(**spec)
    if cores is not None:
        os.sched_setaffinity(0, cores)
    torch.set_num_threads(threads)
    if spec.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(spec.device))
    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S))
    fanouts = [(t, list(f)) for t, f in spec.fanouts]
    scratch_pages = -(-scratch_slots(fanouts, spec.k, spec.max_num_seqs) // spec.block_size)
    runner = RunnerSpec(spec.model_path, spec.num_blocks + scratch_pages, spec.block_size, spec.max_position,
                        spec.dtype, spec.device, spec.weight_layout, spec.attention_backend,
                        spec.cuda_graph_max_batch).build()
    server = new_server(runner, spec.num_blocks, spec.block_size, spec.k, spec.vocab, fanouts, spec.saguaro_c,
                        spec.max_num_seqs, spec.seed)
    runner.capture_graphs([("paged", 1), ("tree", spec.k)])  # just-in-time drafts, branch steps
    store.set("draft/ready", str(os.getpid()))
    link = DraftLink(store, 1, timeout_s, payload_device=torch.device(spec.device))
    try:
        _serve(link, server, spec)
    except DraftLinkError:
        # the coordinator went away without a shutdown (it crashed, or exited without close()):
        # its own error says why; a traceback from here would only bury it
        print(f"SSD draft {os.getpid()}: the coordinator closed the link, exiting", file=sys.stderr)
        raise SystemExit(1) from None


def _serve(link, server, spec: DraftSpec) -> None:
    """Answer the coordinator's rounds until it says shutdown."""
    from ssd_engine.spec.payload import SHUTDOWN, pack_reply, unpack_request

    reply = torch.zeros(0)
    while True:
        request = unpack_request(link.recv_request())
        if request.kind == SHUTDOWN:
            return
        server.apply(request)
        if request.wanted:
            specs = server.lookup(request.wanted, request.backup)
            params = [server.seqs[i].params for i in request.wanted]
            packed = pack_reply(specs, params, spec.k, spec.vocab, server.timings(), out=reply)
            reply = packed if packed.numel() > reply.numel() else reply  # grows to the largest round seen
            link.send_reply(packed)
        server.build(request.wanted)
