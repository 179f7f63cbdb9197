"""Where AR, SD and SSD would each run, as the engine places them, and their costs' cache key."""

import hashlib

import torch

from ssd_engine.core.config import EngineConfig
from ssd_engine.core.core_sets import format_core_sets, parse_core_sets
from ssd_engine.distributed.placement import available_cores, plan_core_sets, split_evenly
from ssd_engine.planning.costs import Placement
from ssd_engine.tensor_parallel.launch import torchrun_world
from ssd_engine.utils.machine import fingerprint


def placement_for(config: EngineConfig) -> tuple[Placement, str]:
    """Where AR, SD and SSD would run, as the engine places them; why SSD is no candidate ("")."""
    if config.model.device != "cpu":
        return _gpu_placement(config)
    tp, cpu_cores = config.parallel.tensor_parallel_size, config.parallel.cpu_cores
    sets = parse_core_sets(cpu_cores) if cpu_cores else [available_cores()]
    every = sorted({c for s in sets for c in s})
    if tp == 1:
        half = len(every) // 2
        if not half:
            return Placement([every], [every], []), "one core: the draft would share it"
        target_cores, draft_cores = (
            (sets[0], sets[1]) if len(sets) == 2 else (every[:half], every[half:])
        )
        return Placement([every], [target_cores], draft_cores), ""
    if cpu_cores:
        # the engine's checks (available, disjoint) before any pinning
        plan_core_sets(len(sets), cpu_cores)
    if len(every) < tp:
        raise ValueError(
            f"{tp} ranks need {tp} disjoint core sets but only {len(every)} cores {every} are given "
            f"or available; pass cpu_cores to place them explicitly"
        )
    ranks = sets if len(sets) == tp else split_evenly(every, tp)
    ssd = sets if len(sets) == tp + 1 else split_evenly(every, tp + 1) if len(every) > tp else None
    if torchrun_world() is not None:
        return Placement(ranks, ranks, []), "under torchrun the SSD draft gets no cores of its own"
    if ssd is None:
        return Placement(ranks, ranks, []), (
            f"{tp} ranks + its draft need {tp + 1} disjoint core sets, "
            f"{len(every)} core(s) here: the draft would share the ranks'"
        )
    return Placement(ranks, ssd[:-1], ssd[-1]), ""


def _gpu_placement(config: EngineConfig) -> tuple[Placement, str]:
    """Rank r on the config's GPU + r; SSD's draft on the next, a candidate only where it exists."""
    device = config.model.device
    first, tp, count = (
        torch.device(device).index or 0,
        config.parallel.tensor_parallel_size,
        len(_gpus()),
    )
    ranks = [[first + r] for r in range(tp)]
    if first + tp < count:
        return Placement(ranks, ranks, [first + tp], device), ""
    why = f"{tp} rank GPU(s) + the draft's need GPUs up to cuda:{first + tp}, {count} here: the draft would share one"
    return Placement(ranks, ranks, [], device), why


def _gpus() -> list[
    str
]:  # the visible GPUs' names (tests replace this to plan for GPUs this machine lacks)
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def placement_key(placement: Placement, tp: int) -> str:
    """The cached costs' machine part, plus the placement for ranks and GPUs (cpu_cores vary)."""
    every = placement.every
    if placement.device == "cpu" and tp == 1:
        return fingerprint(every, len(every))
    where = f"{format_core_sets(placement.ranks)}|{format_core_sets(placement.ssd_ranks)}|{format_core_sets([placement.ssd_draft])}"
    machine = (
        fingerprint(every, len(every))
        if placement.device == "cpu"
        else "|".join([torch.__version__] + _gpus())
    )
    return f"tp{tp}-" + hashlib.blake2b(f"{machine}|{where}".encode(), digest_size=6).hexdigest()
