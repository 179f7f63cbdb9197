"""A tensor-parallel worker (ranks 1..N-1): runs rank 0's commands, mirroring its block tables."""

import os
import traceback

import torch

from ssd_engine.core.structures import BlockTable, new_block_table
from ssd_engine.distributed import supervise
from ssd_engine.distributed.comm import TPGroup
from ssd_engine.runtime.model_runner import ModelRunner, RunnerSpec
from ssd_engine.runtime.step_inputs import StepInputs


def common_prefix(a: BlockTable, b: BlockTable) -> int:
    """How many leading blocks two tables share: one whole compare (the usual case), else bisect."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    same, differ = 0, n  # a[:same] == b[:same]; a[:differ] != b[:differ]
    while differ - same > 1:
        mid = (same + differ) // 2
        if a[:mid] == b[:mid]:
            same = mid
        else:
            differ = mid
    return same


class BlockTableMirror:
    """Each live sequence's block table as the workers know it (rank 0 keeps the same copy)."""

    def __init__(self) -> None:
        self.tables: dict[int, BlockTable] = {}

    def delta(self, seq_id: int, table: BlockTable) -> tuple[int, BlockTable]:
        """Rank 0: how to turn the last table sent for seq_id into `table` (blocks kept, blocks appended)."""
        table = new_block_table(table)  # a copy: the sequence's own table changes after this step
        keep = common_prefix(self.tables.get(seq_id, new_block_table()), table)
        self.tables[seq_id] = table
        return keep, table[keep:]

    def apply(self, seq_id: int, keep: int, appended: BlockTable) -> BlockTable:
        table = self.tables.get(seq_id, new_block_table())[:keep] + new_block_table(appended)
        self.tables[seq_id] = table
        return table

    def forget(self, seq_id: int) -> None:
        self.tables.pop(seq_id, None)


def step_message(seq_ids, inputs: StepInputs, mirror: BlockTableMirror, freed: list[int]) -> tuple:
    """What a worker needs to rebuild `inputs`; device-held fed tokens follow by broadcast."""
    deltas = [mirror.delta(i, t) for i, t in zip(seq_ids, inputs.block_tables)]
    held_at = inputs.on_device[0] if inputs.on_device is not None else None
    return seq_ids, inputs.starts, inputs.token_ids, deltas, inputs.logit_rows, freed, held_at


class Worker:
    def __init__(self, tp: TPGroup) -> None:
        self.tp = tp
        self.runner: ModelRunner | None = None
        self.mirror = BlockTableMirror()

    def init_runner(self, runner_spec: RunnerSpec) -> None:
        failed = False
        try:
            self.runner = runner_spec.build(self.tp)
        except Exception:
            traceback.print_exc()
            failed = True
        if self.tp.barrier_status(failed) or failed:
            raise SystemExit(1)  # rank 0 reports it; a half-built model must not serve

    def capture_graphs(self, keys: list) -> None:
        self.runner.capture_graphs(keys)

    def forward(self, message: tuple) -> None:
        seq_ids, starts, token_ids, deltas, logit_rows, freed, held_at = message
        for seq_id in freed:
            self.mirror.forget(seq_id)
        tables = [self.mirror.apply(i, keep, new) for i, (keep, new) in zip(seq_ids, deltas)]
        on_device = None
        if held_at is not None:
            on_device = (
                held_at,
                self.tp.broadcast(
                    torch.empty(len(held_at), dtype=torch.long, device=self.runner.device)
                ),
            )
        self.runner.run(StepInputs(starts, token_ids, tables, logit_rows, on_device))


def serve(tp: TPGroup) -> None:
    """Run commands from rank 0 until it says shutdown."""
    worker = Worker(tp)
    while True:
        method, args = tp.recv_command()
        if method == "shutdown":
            return
        getattr(worker, method)(*args)


def ready_key(rank: int) -> str:
    return f"started/{rank}"


def worker_process(
    port: int,
    rank: int,
    size: int,
    cores: list[int] | None,
    threads: int,
    device: str,
    timeout_s: float,
    shm_fd: int | None = None,
) -> None:
    """A spawned worker (ranks 1..N-1 on this machine): join rank 0's store, then serve."""
    parent = os.getppid()  # rank 0, or its fork server, which dies with it
    if cores is not None:
        os.sched_setaffinity(0, cores)
    torch.set_num_threads(threads)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    store = supervise.join_store(port, size, timeout_s)
    supervise.announce_ready(store, ready_key(rank))
    tp = TPGroup.create(
        store,
        rank,
        size,
        torch.device(device),
        timeout_s,
        loopback=True,
        shm_fd=shm_fd,
        peers_alive=lambda: os.getppid() == parent,
    )
    serve(tp)
