"""Find on CPU what would fail on a GPU: a host tensor where the device is needed.

On CPU the engine's device is the host, so a line that forgets `device=` still runs. On a GPU the same
line raises ("Expected all tensors to be on the same device"), or a Triton kernel is handed a host
pointer ("Pointer argument cannot be accessed from Triton (cpu tensor?)"). That is how the first GPU
run failed: paths tested only on CPU passed host tensors to device code.

`PlacementChecker` (a `TorchFunctionMode`) tags every tensor made through torch with the place it
would have on a GPU: device, host, or unknown. The convention is `sync_count.py`'s: code names the
accelerator with a `torch.device` object (the engine's `device`; also inside `with torch.device(d)`)
or a device string other than "cpu", and the host with no device or the string "cpu". So in the
engine's and its user's code (tests, benchmarks):
- a factory given a `torch.device` object or "cuda..." makes a device tensor; given none or "cpu", a
  host tensor;
- `.to(device)` / `.cuda()` move to the device, `.cpu()` / `.to("cpu")` to the host; each hands back a
  copy here, as on a GPU, so the two places never share memory;
- any other op's output is on the device when an input is, else unknown when an input is, else host.
Installed libraries (transformers, the tests' oracle) pass `device=x.device` along, which says nothing
here: their factories given a `torch.device` object make unknown tensors, and nothing is reported
from inside them. Tags belong to storages, so views, `nn.Parameter`s and cache slices share the tag of
what they look into.

Reported, by kind and call site (file:line):
- `mixed`: an op given both a device tensor and a host tensor with one or more dimensions (a host
  0-dim tensor is a scalar CUDA accepts). Host indices inside `t[...]` are allowed, as CUDA allows
  them; `copy_`, slice assignments (a copy) and moves are meant to cross.
- `kernel`: a Triton launch (`utils/launches.py`) given a host tensor.

A `Tensor.device` read never reaches the mode, so a `torch.device` object does not say where it came
from: `device=x.device` or `.to(x.device)` written on the calling line is read from the source and
follows `x`'s place. Limits: written otherwise (a variable set from `x.device` earlier) the object
names the device. Tensors made before the checker
started, or by memory it never saw made (a file mapped by safetensors), are host tensors: build the
engine inside it. The mode is thread-local: a thread of one's own enters the same checker to be
checked. CPU-only branches are not a GPU's: tests take the GPU's branch (tests/placement_harness.py).
"""

import linecache
import os
import re
import sys
import threading
from collections import Counter
from contextlib import contextmanager
from enum import Enum

import torch
from torch.overrides import TorchFunctionMode

from instrumentation.op_count import CONTEXTLIB, HERE, TORCH_DIR, call_site, tensors_in
from instrumentation.sync_count import READS, _moves_to_host
from ssd_engine.utils import launches

T = torch.Tensor
PACKAGE = os.path.dirname(HERE) + os.sep
# torch's own library code that makes tensors with `device=x.device` (assert_close's comparisons)
TORCH_LIBRARY = os.path.join(TORCH_DIR, "testing") + os.sep
# functions whose tensors may sit on different devices
CROSSING = {T.copy_, T.to, T.cpu, T.cuda, T.pin_memory, T.new_tensor}
DEVICE_OF = re.compile(r"(?:device=|\.to\()\s*([A-Za-z_][\w.]*)\.device\b")
IN_PLACE_DUNDERS = {
    "__setitem__",
    "__iadd__",
    "__isub__",
    "__imul__",
    "__itruediv__",
    "__ior__",
    "__iand__",
}


class Place(Enum):
    HOST = "host"
    DEVICE = "device"
    UNKNOWN = "unknown"  # made by library code from a device object it was handed


def _storage(t: torch.Tensor) -> int | None:
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # opaque tensors (oneDNN's packed weights)
        return None
    return ptr or None  # an empty tensor has no memory to tell apart


def _our_caller():
    """The innermost frame outside torch when it is the engine's or its user's code; None when it is
    an installed library's (transformers, ...)."""
    frame = sys._getframe(2)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path.startswith(TORCH_LIBRARY):
            return None
        if not path.startswith((TORCH_DIR, HERE, CONTEXTLIB)):
            ours = path.startswith(PACKAGE) or not any(
                d in path for d in ("site-packages", "dist-packages")
            )
            return frame if ours else None
        frame = frame.f_back
    return None


def _device_source(frame) -> torch.Tensor | None:
    """The tensor `x` of a `device=x.device` (or `.to(x.device)`) on the caller's line, if any."""
    found = DEVICE_OF.search(linecache.getline(frame.f_code.co_filename, frame.f_lineno))
    if not found:
        return None
    head, *attrs = found.group(1).split(".")
    value = frame.f_locals.get(head, frame.f_globals.get(head))
    for attr in attrs:
        value = getattr(value, attr, None)
    return value if isinstance(value, torch.Tensor) else None


def _writes_in_place(func, kwargs) -> bool:
    name = getattr(func, "__name__", "")
    return (
        "out" in kwargs
        or name in IN_PLACE_DUNDERS
        or (name.endswith("_") and not name.startswith("__"))
    )


class PlacementChecker(launches.HearsLaunches, TorchFunctionMode):
    """`with PlacementChecker() as placement: ...`; `placement.findings` maps (kind, what, call site)
    -> count, `placement.report()` lists them; `kernels_checked` counts launches by thread."""

    def __init__(self) -> None:
        super().__init__()
        self.places: dict[int, Place] = {}  # storage address -> place (host when absent)
        self.findings: Counter = Counter()
        self.kernels_checked: Counter = Counter()
        self._launching = threading.local()  # per thread: inside a kernel launch

    def place(self, t: torch.Tensor) -> Place | None:
        """None: no storage to tell (opaque weights), never reported."""
        ptr = _storage(t)
        return None if ptr is None else self.places.get(ptr, Place.HOST)

    def _tag(self, value, place: Place) -> None:
        for t in tensors_in(value):
            ptr = _storage(t)
            if ptr is None:
                continue
            # also forgets a freed tensor whose memory the allocator handed out again
            if place is Place.HOST:
                self.places.pop(ptr, None)
            else:
                self.places[ptr] = place

    def assume_on_device(self, *values) -> None:
        """Tag tensors (or a module's parameters and buffers) as the device's: memory a GPU run has on
        the device where a CPU-only branch made host memory."""
        for value in values:
            if isinstance(value, torch.nn.Module):
                value = [*value.parameters(), *value.buffers()]
            self._tag(value, Place.DEVICE)

    # ---- the checks -----------------------------------------------------------------------
    def _check_mixed(self, func, args, kwargs) -> None:
        if func in CROSSING:
            return
        if func is T.__getitem__:
            args = args[:1]  # host indices are fine
        elif func is T.__setitem__:
            if not tensors_in(args[1]):
                return  # a slice assignment is a copy, which may cross
            args = (
                args[0],
                *args[2:],
            )  # an index_put: host indices are fine, the values must be on self's device
        places = {
            self.place(t)
            for t in tensors_in((args, kwargs))
            if t.dim() > 0 or self.place(t) is not Place.HOST
        }
        if Place.DEVICE in places and Place.HOST in places:
            self.findings[("mixed", getattr(func, "__name__", str(func)), call_site())] += 1

    @contextmanager
    def kernel(self, name: str, tensors=()):
        """A launch: its tensors checked; the interpreter's host copies inside it are no GPU work."""
        self.kernels_checked[threading.current_thread().name] += 1
        host = [str(i) for i, t in enumerate(tensors) if self.place(t) is Place.HOST]
        if host:
            self.findings[("kernel", f"{name} (host tensors {','.join(host)})", call_site())] += 1
        self._launching.depth = getattr(self._launching, "depth", 0) + 1
        try:
            yield
        finally:
            self._launching.depth -= 1

    def _named_place(self, value, caller) -> Place | None:
        """The place a `device` argument names; None: no device named."""
        if isinstance(value, str):
            return Place.HOST if value.split(":")[0] == "cpu" else Place.DEVICE
        if not isinstance(value, torch.device):
            return None
        if caller is None:
            return Place.UNKNOWN
        source = _device_source(caller)  # `device=x.device`: wherever x is
        return Place.DEVICE if source is None else (self.place(source) or Place.DEVICE)

    # ---- the mode -------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.OpOverload) or getattr(self._launching, "depth", 0):
            return func(
                *args, **kwargs
            )  # an aten op called from a dispatch mode's code, or inside a launch
        caller = _our_caller()
        if caller is not None:
            self._check_mixed(func, args, kwargs)
        inputs = {self.place(t) for t in tensors_in((args, kwargs))}
        named_place = lambda value: self._named_place(value, caller)
        out = func(*args, **kwargs)
        if (
            (func in READS and func is not T.cpu)
            or not isinstance(out, (torch.Tensor, list, tuple))
            or _writes_in_place(func, kwargs)
        ):
            return out  # a host value, or a destination that keeps its place
        named = (
            [named_place(a) for a in (*args[1:], kwargs.get("device"))]
            if func is T.to
            else [named_place(kwargs.get("device"))]
        )
        moved = (
            Place.HOST
            if func is T.cpu or (func is T.to and _moves_to_host(args, kwargs))
            else Place.DEVICE
            if func is T.cuda
            else next((p for p in named if p is not None), None)
        )
        if (
            func in (T.to, T.cpu, T.cuda)
            and moved is not None
            and isinstance(out, torch.Tensor)
            and _storage(out) == _storage(args[0])
            and self.place(args[0]) is not moved
        ):
            out = out.clone()  # on a GPU a move makes a new tensor; the original stays where it was
        if moved is None:
            moved = next((p for p in (Place.DEVICE, Place.UNKNOWN) if p in inputs), Place.HOST)
        self._tag(out, moved)
        return out

    def report(self) -> list[str]:
        return [
            f"{kind} {what} x{n} at {site}"
            for (kind, what, site), n in sorted(self.findings.items())
        ]
