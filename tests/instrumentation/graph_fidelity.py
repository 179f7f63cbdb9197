"""Whether an emulated CUDA graph replays what a real one would: checked on CPU.

A real CUDA graph keeps the kernels its capture launched, with their arguments (addresses, sizes,
scalars), and a replay runs exactly those: no host code runs again. The emulation
(`capture="emulate"` in runtime/cuda_graphs.py and runtime/piecewise_graphs.py) calls the Python
forward again at every replay, so it passes code that a GPU breaks:
- a host read of a tensor's values inside the captured region (`.item()`, `bool(t)`, `.tolist()`,
  an op whose output shape depends on values, a mask index): CUDA refuses it while capturing;
- an upload from host values (`torch.tensor(..., device=...)`): refused while capturing too;
- a replay that runs other ops, sizes or scalars than the capture did (a branch on state that
  changed since): the GPU replays the capture's;
- a replay that reads a tensor the capture did not read (a step's own tensor where the capture read
  the static buffer): the GPU reads the capture-time memory, stale or freed.

`emulated_graph(fn, name)` wraps one emulated graph's forward: its first call is the capture, and
records each op the dispatcher routes (name, scalar arguments, each tensor's shape, strides, dtype
and where it came from: made inside the region by the n-th op, or an outside storage by address)
and each Triton launch (name and tensors, the ops inside it not counted); every later call records
the same way and must match. Any difference, and any host read, raises `GraphInfidelity` naming the
graph, the op and its call site. The engine calls it for each emulated graph when SSD_ENGINE_GRAPH_CHECKER
names it (`SPEC`, ssd_engine/utils/test_hooks.py): the tests turn it on; benchmarks time the
emulation without it.
"""

import threading
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from instrumentation.op_count import call_site, storage_address, tensors_in
from instrumentation.sync_count import DATA_DEPENDENT, READS, bool_index
from ssd_engine.utils import launches

SPEC = "instrumentation.graph_fidelity:emulated_graph"  # the value of SSD_ENGINE_GRAPH_CHECKER that turns it on
T = torch.Tensor
UPLOADS = {torch.tensor: "tensor", torch.as_tensor: "as_tensor"}


class GraphInfidelity(AssertionError):
    """What a real CUDA graph would refuse to capture, or replay differently from the emulation."""


class _HostReads(TorchFunctionMode):
    """Raises at a host read of any tensor: inside a captured forward every tensor is on the GPU."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        read = READS.get(func) or DATA_DEPENDENT.get(func)
        if func in UPLOADS and kwargs.get("device") is not None:
            read = f"upload ({UPLOADS[func]})"
        if func in (T.__getitem__, T.__setitem__) and len(args) > 1 and bool_index(args[1]):
            read = "mask_index"
        if read:
            raise GraphInfidelity(
                f"graph {self.name}: host read '{read}' inside the captured region "
                f"at {call_site()} (CUDA refuses it while capturing)"
            )
        return func(*args, **kwargs)


class _Recorder(TorchDispatchMode):
    """The region's launches, each as (what, site, signature): ops and Triton kernels in order."""

    def __init__(self) -> None:
        super().__init__()
        self.launches: list[tuple[str, str, tuple]] = []
        self.made: dict[int, int] = {}  # storage address -> index of the launch that made it here
        self.thread = threading.get_ident()
        self.in_kernel = 0

    def _tensor(self, t: torch.Tensor) -> tuple:
        address = storage_address(t)
        origin = ("made", self.made[address]) if address in self.made else ("outside", address)
        strides = t.stride() if t.layout == torch.strided else None
        return (
            origin,
            tuple(t.shape),
            strides,
            t.dtype,
            t.storage_offset() if address is not None else None,
        )

    def _signature(self, value):
        if isinstance(value, torch.Tensor):
            return self._tensor(value)
        if isinstance(value, (list, tuple)):
            return tuple(self._signature(v) for v in value)
        if isinstance(value, dict):
            return tuple((k, self._signature(v)) for k, v in sorted(value.items()))
        return value

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.in_kernel:  # the interpreter's copies inside a Triton launch: one kernel on a GPU
            return func(*args, **kwargs)
        signature = (self._signature(args), self._signature(kwargs))
        out = func(*args, **kwargs)
        inputs = {storage_address(t) for t in tensors_in((args, kwargs))}
        index = len(self.launches)
        self.launches.append((str(func), call_site(), signature))
        for t in tensors_in(out):
            # new memory, not a write in place
            if (address := storage_address(t)) is not None and address not in inputs:
                self.made[address] = index
        return out

    @contextmanager
    def kernel(self, name: str, tensors: tuple[torch.Tensor, ...]):
        if threading.get_ident() != self.thread:  # another thread's launch (the SSD draft thread's)
            yield
            return
        self.launches.append((f"kernel {name}", call_site(), self._signature(tensors)))
        self.in_kernel += 1
        try:
            yield
        finally:
            self.in_kernel -= 1


def _record(fn, name: str):
    recorder = _Recorder()
    launches.listen(recorder)
    try:
        with _HostReads(name), recorder:
            out = fn()
    finally:
        launches.stop_listening(recorder)
    return out, recorder.launches


def _compare(name: str, captured: list, replayed: list) -> None:
    for index, (was, now) in enumerate(zip(captured, replayed)):
        if was[0] != now[0] or was[2] != now[2]:
            how = (
                ""
                if was[0] != now[0]
                else f" with other arguments ({_first_difference(was[2], now[2])})"
            )
            raise GraphInfidelity(
                f"graph {name}: replay diverged from the capture at launch {index}: captured "
                f"{was[0]} at {was[1]}, replayed {now[0]} at {now[1]}{how}; a real CUDA graph "
                "replays the capture's"
            )
    if len(captured) != len(replayed):
        raise GraphInfidelity(
            f"graph {name}: the capture launched {len(captured)} kernels and ops, the replay "
            f"{len(replayed)}; a real CUDA graph replays the capture's"
        )


def _first_difference(was, now) -> str:
    if isinstance(was, tuple) and isinstance(now, tuple) and len(was) == len(now):
        for a, b in zip(was, now):
            if a != b:
                return _first_difference(a, b)
    return f"{was!r} -> {now!r}"


def emulated_graph(fn, name: str):
    """`fn` as an emulated graph, checked: called once to capture, then per replay."""
    captured: list | None = None

    def run():
        nonlocal captured
        out, recorded = _record(fn, name)
        if captured is None:
            captured = recorded
        else:
            _compare(name, captured, recorded)
        return out

    return run
