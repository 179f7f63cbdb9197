"""Which CPU cores each rank runs on: on CPU, processes pinned to disjoint core sets stand in for
devices, so a rank's matmuls never compete with another rank's for a core."""

import os

import torch

from ssd_engine.core.core_sets import parse_core_sets
from ssd_engine.distributed.partition import even_spans


def split_evenly(cores: list[int], parts: int) -> list[list[int]]:
    """Even contiguous core sets, one per part."""
    return [cores[s.start : s.end] for s in even_spans(len(cores), parts, "cores")]


def plan_core_sets(num_ranks: int, cpu_cores: str | None) -> list[list[int]]:
    """One disjoint core set per rank: the given ones, or this process's cores split evenly."""
    available = available_cores()
    if cpu_cores is None:
        if len(available) < num_ranks:
            raise ValueError(
                f"{num_ranks} ranks need {num_ranks} disjoint core sets but this process may use only "
                f"{len(available)} cores {available}; pass cpu_cores to place them explicitly"
            )
        return split_evenly(available, num_ranks)
    sets = parse_core_sets(cpu_cores)
    if len(sets) != num_ranks:
        raise ValueError(
            f"cpu_cores {cpu_cores!r} gives {len(sets)} core sets for {num_ranks} ranks"
        )
    seen: set[int] = set()
    for cores in sets:
        outside = [c for c in cores if c not in available]
        if outside:
            raise ValueError(
                f"cpu_cores {cpu_cores!r}: cores {outside} are not available to this process ({available})"
            )
        if seen & set(cores):
            raise ValueError(
                f"cpu_cores {cpu_cores!r}: core sets overlap on {sorted(seen & set(cores))}"
            )
        seen |= set(cores)
    return sets


# Pins nest (rank 0 is the user's process, which engines may share; a probe pins inside an engine's
# pin). Each saves the state it replaced: unpinning the newest restores it; unpinning an older one
# hands that state to the pin above. Plans use the process's state before its first pin.
_pins: list[tuple[object, set[int], int]] = []  # (token, cores before it, threads before it)


def available_cores() -> list[int]:
    return sorted(_pins[0][1] if _pins else os.sched_getaffinity(0))


def pin(cores: list[int], threads: int) -> object:
    """Pin this process to `cores` with `threads` torch threads; returns a token for unpin()."""
    token = object()
    _pins.append((token, os.sched_getaffinity(0), torch.get_num_threads()))
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(threads)
    return token


def unpin(token: object) -> None:
    index = next(i for i, (held, _, _) in enumerate(_pins) if held is token)
    _, cores, threads = _pins.pop(index)
    if index == len(_pins):  # the newest pin: back to the state it replaced
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(threads)
    else:  # an older one: the pin above it now stands on the state this one replaced
        _pins[index] = (_pins[index][0], cores, threads)


def describe(core_sets: list[list[int]], threads: list[int]) -> str:
    return ", ".join(
        f"rank {r}: cores {_ranges(c)} ({t} thread{'s' * (t > 1)})"
        for r, (c, t) in enumerate(zip(core_sets, threads))
    )


def _ranges(cores: list[int]) -> str:
    parts, start = [], cores[0]
    for prev, cur in zip(cores, cores[1:] + [None]):
        if cur is None or cur != prev + 1:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    return ",".join(parts)
