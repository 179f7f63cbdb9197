"""Count where a GPU would wait for the device: host reads of device tensors, measured on CPU.

On a GPU the host queues kernels ahead of the device; reading a device tensor's values on the
host (`.item()`, `.tolist()`, `bool(t)`, `.cpu()`, ...) or running an op whose output shape
depends on its values (`nonzero`, boolean-mask indexing, ...) makes the host wait for every
queued kernel: the pipeline drains, and the next launches start from idle. A round needs one
(the accepted tokens must reach the host to be emitted); each more is a bubble.

On CPU every tensor is a host tensor, so `SyncCounter` (a `TorchFunctionMode`, which sees every
torch function and Tensor method called in Python) tracks which tensors *would* live on the
device: those created with an explicit `device=` that is not the string "cpu" (the engine passes
its `device` object for what belongs on the accelerator, and builds host-only tensors without
one), moved there with `.to(device)`, or computed from any such tensor. A host read of one of
them is a sync, counted by kind and call site (file:line). A read of a host tensor is not.

Tensors made before counting started (weights, the KV cache, the SSD link's buffers) carry no
mark; what is computed from them together with marked tensors does. So the SSD reply's arrival
is not counted: on CPU and on one shared GPU it lands in host memory (gloo); with the draft on a
GPU of its own (NCCL) the reply's `.cpu()` in speculative/ssd/link.py is one more read per round.

The other way waits too: a copy from pageable host memory to the device is queued behind every
kernel before it (torch synchronizes the stream around it), so these count as well, kind "h2d":
`torch.tensor(data, device=...)`, `.to(device)` / `.copy_()` of a host tensor without
`non_blocking=True` (which declares a pinned source: utils/host_upload.py), a host tensor written
into a device tensor, and a device tensor indexed by a Python list or a host tensor (torch moves the
index with a blocking copy). A host tensor is one made while counting without a device (or computed
from such tensors only): a tensor from before counting may live anywhere and is never counted.
"""

from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

from instrumentation.op_count import call_site, tensors_in

MARK = "_ssd_would_be_on_device"
HOST_MARK = "_ssd_made_on_the_host"
T = torch.Tensor
# a host read of the values: the host waits for the device to produce them
READS = {
    T.item: "item",
    T.tolist: "tolist",
    T.numpy: "numpy",
    T.cpu: "cpu",
    T.__bool__: "bool",
    T.__int__: "int",
    T.__float__: "float",
    T.__index__: "index",
    T.__format__: "format",
    T.__repr__: "repr",
    T.__array__: "numpy",
}
# output shapes that depend on the values: the host must read them to allocate
DATA_DEPENDENT = {
    torch.nonzero: "nonzero",
    T.nonzero: "nonzero",
    torch.argwhere: "nonzero",
    torch.masked_select: "masked_select",
    T.masked_select: "masked_select",
    torch.unique: "unique",
    T.unique: "unique",
    torch.unique_consecutive: "unique",
    T.unique_consecutive: "unique",
}


def on_device(t: torch.Tensor) -> bool:
    return getattr(t, MARK, False)


def _is_device_arg(value) -> bool:
    """A device a tensor is created on or moved to that stands for the accelerator: any
    torch.device, or a device string other than "cpu" (a literal "cpu" means the host)."""
    if isinstance(value, torch.device):
        return True
    return isinstance(value, str) and value.split(":")[0] in ("cuda", "xpu", "mps", "meta", "hip")


def on_host(t: torch.Tensor) -> bool:
    return getattr(t, HOST_MARK, False)


def _mark(value, mark: str = MARK) -> None:
    for t in tensors_in(value):
        try:
            setattr(t, mark, True)
        except (AttributeError, RuntimeError):
            pass


class SyncCounter(TorchFunctionMode):
    """`with SyncCounter() as syncs: ...`; `syncs.counts` maps (kind, call site) -> host reads of
    would-be device tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = tensors_in((args, kwargs))
        device_in = any(on_device(t) for t in inputs)
        sync = self._sync_kind(func, args, kwargs, device_in)
        if sync:
            self.counts[(sync, call_site())] += 1
        out = func(*args, **kwargs)
        to_device = self._leaves_on_device(func, args, kwargs, device_in)
        if func in (T.to, T.cpu) and out is args[0] and to_device != device_in:
            # a move between host and device, which on CPU hands back the tensor itself: on a GPU
            # the result is a new tensor and the original stays where it was, so the result
            # becomes an alias, marked (or not) on its own
            out = out.view_as(out)
        if to_device:
            _mark(out)
        # made here, from host values only
        elif func not in READS and all(on_host(t) for t in inputs):
            _mark(out, HOST_MARK)
        return out

    @staticmethod
    def _sync_kind(func, args, kwargs, device_in: bool) -> str | None:
        if _uploads_blocking(func, args, kwargs, device_in):
            return "h2d"
        if not device_in:
            return None
        if func in READS:
            return READS[func]
        if func in DATA_DEPENDENT:
            return DATA_DEPENDENT[func]
        if func is T.to and _moves_to_host(args, kwargs):
            return "cpu"
        if func in (T.__getitem__, T.__setitem__) and len(args) > 1 and bool_index(args[1]):
            return "mask_index"
        if (
            func in (torch.repeat_interleave, T.repeat_interleave)
            and "output_size" not in kwargs
            and isinstance(args[-1] if len(args) <= 2 else args[1], torch.Tensor)
        ):
            return "repeat_interleave"  # tensor repeats: the output's length is their sum
        if func is torch.where and len(args) == 1 and not kwargs:
            return "nonzero"
        return None

    @staticmethod
    def _leaves_on_device(func, args, kwargs, device_in: bool) -> bool:
        if func in READS:
            return False
        if func is T.to:
            if _moves_to_host(args, kwargs):
                return False
            return device_in or any(_is_device_arg(a) for a in (*args[1:], kwargs.get("device")))
        if func is T.cuda:
            return True
        return device_in or _is_device_arg(kwargs.get("device"))  # a factory given the device


def _uploads_blocking(func, args, kwargs, device_in: bool) -> bool:
    """A host-to-device copy that waits for the stream (see the module docstring)."""
    if func in (torch.tensor, torch.as_tensor):
        return _is_device_arg(kwargs.get("device"))
    if func in (T.to, T.cuda) and _host_tensor(args[0]):
        targets = (*args[1:], kwargs.get("device"))
        return (func is T.cuda or any(_is_device_arg(a) for a in targets)) and kwargs.get(
            "non_blocking"
        ) is not True
    if not device_in or not args or not on_device(args[0]):
        return False
    if func is T.copy_:
        return _host_tensor(args[1]) and kwargs.get("non_blocking") is not True
    if func in (T.__getitem__, T.__setitem__):
        parts = args[1] if isinstance(args[1], tuple) else (args[1],)
        if any(isinstance(p, list) or (_host_tensor(p) and p.dim() > 0) for p in parts):
            return True  # the index crosses with a blocking copy
        return func is T.__setitem__ and _host_tensor(args[2]) and args[2].dim() > 0
    return False


def _host_tensor(value) -> bool:
    return isinstance(value, torch.Tensor) and on_host(value)


def _moves_to_host(args, kwargs) -> bool:
    targets = (*args[1:], kwargs.get("device"))
    return any(isinstance(a, str) and a.split(":")[0] == "cpu" for a in targets)


def bool_index(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)
