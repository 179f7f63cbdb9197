"""Start a tensor-parallel model: spawn worker ranks here, or join a torchrun group."""

import atexit
import os
import sys
import weakref

import torch
import torch.distributed as dist

from ssd_engine.core.config_sections import ParallelConfig
from ssd_engine.distributed import supervise
from ssd_engine.distributed.comm import SHM_CAPACITY, TPGroup
from ssd_engine.distributed.placement import describe, pin, plan_core_sets, unpin
from ssd_engine.distributed.shm_collectives import ShmCollectives
from ssd_engine.distributed.shm_collectives import supported as shm_supported
from ssd_engine.runtime.model_runner import RunnerSpec
from ssd_engine.tensor_parallel.executor import TensorParallelError, TensorParallelRunner
from ssd_engine.tensor_parallel.worker import ready_key, serve

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def torchrun_world() -> tuple[int, int] | None:
    """(rank, world size) when this process was started by torchrun, else None."""
    if all(v in os.environ for v in TORCHRUN_VARS) and int(os.environ["WORLD_SIZE"]) > 1:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def start_tensor_parallel(
    parallel: ParallelConfig, runner_spec: RunnerSpec, core_sets: list[list[int]] | None = None
) -> TensorParallelRunner:
    """`core_sets`: the ranks' cores when the caller planned them (SSD adds the draft's set)."""
    joined = torchrun_world()
    if joined is not None:
        return _join_torchrun(parallel, runner_spec, *joined)
    return _spawn(parallel, runner_spec, core_sets)


def rank_gpus(device: str, size: int, available: int) -> list[str]:
    """Each rank's GPU, consecutive from `device`'s (NCCL cannot put two ranks on one GPU)."""
    first = torch.device(device).index or 0
    if first + size > available:
        raise ValueError(
            f"tensor_parallel_size={size} from {device} needs GPUs cuda:{first}..cuda:{first + size - 1}; "
            f"this machine has {available}"
        )
    return [f"cuda:{first + rank}" for rank in range(size)]


def _spawn(
    parallel: ParallelConfig, runner_spec: RunnerSpec, core_sets: list[list[int]] | None
) -> TensorParallelRunner:
    size = parallel.tensor_parallel_size
    on_cpu = runner_spec.model.device == "cpu"
    if on_cpu:
        core_sets = core_sets or plan_core_sets(size, parallel.cpu_cores)
    else:
        core_sets = [None] * size
        gpus = rank_gpus(runner_spec.model.device, size, torch.cuda.device_count())
    threads = [
        runner_spec.model.num_threads or (len(c) if c else torch.get_num_threads())
        for c in core_sets
    ]
    store = supervise.host_store(size)
    # SSD_ENGINE_TP_SHM=0 keeps every collective on gloo
    use_shm = on_cpu and shm_supported() and os.environ.get("SSD_ENGINE_TP_SHM", "1") != "0"
    shm_fd = ShmCollectives.create_fd(size, SHM_CAPACITY) if use_shm else None
    workers = {}
    for rank in range(1, size):
        # lifeline.start, not multiprocessing: the user's __main__ is never re-imported
        device = runner_spec.model.device if on_cpu else gpus[rank]
        args = dict(
            port=store.port,
            rank=rank,
            size=size,
            cores=core_sets[rank],
            threads=threads[rank],
            device=device,
            timeout_s=parallel.distributed_timeout_s,
            shm_fd=shm_fd,
        )
        workers[rank] = supervise.start(
            f"tensor-parallel worker rank {rank}",
            "ssd_engine.tensor_parallel.worker_main",
            args,
            ready_key(rank),
            pass_fds=() if shm_fd is None else (shm_fd,),
        )
    processes = {rank: worker.process for rank, worker in workers.items()}
    restore = pin(core_sets[0], threads[0]) if on_cpu else None
    where = (
        describe(core_sets, threads)
        if on_cpu
        else ", ".join(f"rank {r}: {gpu}" for r, gpu in enumerate(gpus))
    )
    transport = ("shared memory + gloo" if use_shm else "gloo") if on_cpu else "nccl"
    print(
        f"tensor parallel: {size} ranks ({transport}); {where}; "
        f"worker pids {[p.pid for p in processes.values()]}",
        file=sys.stderr,
    )
    try:
        supervise.wait_ready(store, list(workers.values()), TensorParallelError)
        tp = TPGroup.create(
            store,
            0,
            size,
            torch.device(runner_spec.model.device),
            parallel.distributed_timeout_s,
            loopback=True,
            shm_fd=shm_fd,
            peers_alive=lambda: all(p.poll() is None for p in processes.values()),
        )
        runner = TensorParallelRunner(tp, runner_spec, processes, restore)
    except BaseException:
        _stop(processes)
        if restore is not None:
            unpin(restore)
        raise
    finally:
        if shm_fd is not None:
            # the mappings keep the memory; it goes when the last process holding it exits
            os.close(shm_fd)
    runner._store = store  # the store lives as long as the group
    close_at_exit(runner)
    return runner


def _join_torchrun(
    parallel: ParallelConfig, runner_spec: RunnerSpec, rank: int, size: int
) -> TensorParallelRunner:
    if size != parallel.tensor_parallel_size:
        raise ValueError(
            f"torchrun started WORLD_SIZE={size} processes but tensor_parallel_size="
            f"{parallel.tensor_parallel_size}; pass --tensor-parallel-size {size}"
        )
    device = runner_spec.model.device
    if device.startswith("cuda"):
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}"
        torch.cuda.set_device(device)
        runner_spec = runner_spec.with_model(device=device)
    restore = None
    if device == "cpu" and parallel.cpu_cores is not None:
        cores = plan_core_sets(size, parallel.cpu_cores)[rank]
        restore = pin(cores, runner_spec.model.num_threads or len(cores))
    store, _, _ = next(dist.rendezvous("env://", rank, size))
    tp = TPGroup.create(
        store, rank, size, torch.device(device), parallel.distributed_timeout_s, loopback=False
    )
    if rank != 0:
        serve(tp)
        # this process only served rank 0; the script's remaining work is rank 0's
        raise SystemExit(0)
    runner = TensorParallelRunner(tp, runner_spec, {}, restore)
    close_at_exit(runner)
    return runner


def _stop(processes: dict) -> None:
    for process in processes.values():
        supervise.stop(process)


def close_at_exit(owner) -> None:
    """Normal interpreter exit closes `owner` (stopping its child processes) even if close() was never called."""
    ref = weakref.ref(owner)

    def close() -> None:
        alive = ref()
        if alive is not None:
            alive.close()

    atexit.register(close)
