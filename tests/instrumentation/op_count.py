"""Count the aten ops a piece of code dispatches: a device-independent proxy of a GPU step's cost.

Decoding one token is launch-bound on a GPU long before it is bandwidth-bound: every dispatched
op that computes is at least one kernel launch (a few microseconds each, more than a small
layer's arithmetic), so ops per decoder layer predict the GPU's floor on a step's time on any
machine, measured on CPU. `OpCounter` is a `TorchDispatchMode`: it sees each op the dispatcher
routes, once, as eager mode runs it (a composite op such as SDPA counts once; the ops it runs
inside are not seen), by op name, kind, call site and scope:

- kind "compute": an op that writes memory (a new tensor or an in-place write): on a GPU a
  kernel launch; "view": an op whose outputs alias an input and that writes nothing (view,
  split, slice, a `to` that changes nothing): host-side metadata, no kernel.
- site: the innermost file:line outside torch that called it (repository-relative), so a count
  points at the line to fuse.
- scope: which module's forward it ran in (`scoped`: e.g. each decoder layer), "step" outside.

Under `torch.inference_mode` (how the engine runs its forwards) the dispatcher shows composite
ops such as `to` or `reshape` as they are called, not what they decompose into.
"""

import contextlib
import os
import sys
from collections import Counter
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ssd_engine.utils import launches

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
HERE = os.path.dirname(os.path.abspath(__file__))
CONTEXTLIB = os.path.abspath(contextlib.__file__)  # a `with` entered through ExitStack
# no compute: tensor metadata, or a tensor built from Python values (on a GPU an upload, not a kernel)
METADATA_OPS = {"detach", "detach_", "alias", "lift_fresh", "empty", "empty_like", "empty_strided"}


def call_site() -> str:
    """The innermost frame outside torch and this package: `path:line function`, the path relative
    to the repository when it is inside it (result files name no machine's directories)."""
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith((TORCH_DIR, HERE, CONTEXTLIB)):
            shown = (
                os.path.relpath(path, REPO)
                if path.startswith(REPO + os.sep)
                else os.path.basename(path)
            )
            return f"{shown}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


def tensors_in(value) -> list[torch.Tensor]:
    """The tensors in an op's arguments or outputs (nested in lists, tuples and dicts)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_in(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors_in(v)]
    return []


def storage_address(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    # opaque tensors (oneDNN's packed weights) have none
    except (
        RuntimeError,
        NotImplementedError,
    ):
        return None


def kind_of(func, args, kwargs, out) -> str:
    """'compute' or 'view' (see the module docstring)."""
    name = func.overloadpacket.__name__
    if name in METADATA_OPS:
        return "view"
    if any(
        arg.alias_info is not None and arg.alias_info.is_write for arg in func._schema.arguments
    ):
        return "compute"  # in place (index_put_, copy_, fill_): writes memory
    outputs = tensors_in(out)
    if not outputs:
        return "compute"
    inputs = {s for t in tensors_in((args, kwargs)) if (s := storage_address(t))}
    return "view" if all(storage_address(t) in inputs for t in outputs) else "compute"


class OpCounter(launches.HearsLaunches, TorchDispatchMode):
    """`with OpCounter() as ops: ...` counts every op dispatched inside; `ops.counts` maps
    (scope, op name, kind, call site) -> calls."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()
        self.calls: Counter = Counter()  # scope -> forwards entered (e.g. decoder layers run)
        self._scopes: list[str] = ["step"]
        self._in_kernel = (
            0  # inside a Triton launch (utils/launches.py): its host ops are not kernels
        )

    @contextmanager
    def kernel(self, name: str, tensors=()):
        """One Triton kernel launch, counted as the compute op `triton:<name>`."""
        self.counts[(self._scopes[-1], f"triton:{name}", "compute", call_site())] += 1
        self._in_kernel += 1
        try:
            yield
        finally:
            self._in_kernel -= 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._in_kernel:
            return out
        self.counts[
            (
                self._scopes[-1],
                func.overloadpacket.__name__,
                kind_of(func, args, kwargs, out),
                call_site(),
            )
        ] += 1
        return out

    @contextmanager
    def scoped(self, modules, names):
        """While inside, ops run in `modules[i]`'s forward are in scope `names[i]` (a str for all)."""
        names = [names] * len(modules) if isinstance(names, str) else names
        handles = []
        for module, name in zip(modules, names):
            handles.append(
                module.register_forward_pre_hook(lambda *_, name=name: self._enter(name))
            )
            handles.append(module.register_forward_hook(lambda *_: self._leave()))
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    @contextmanager
    def scope(self, name: str):
        """Ops run inside are in scope `name` (e.g. the sampling after a forward)."""
        self._enter(name)
        try:
            yield self
        finally:
            self._leave()

    def _enter(self, scope: str) -> None:
        self._scopes.append(scope)
        self.calls[scope] += 1

    # returns None: a forward hook's return value would replace the output
    def _leave(
        self,
    ) -> None:
        self._scopes.pop()

    def total(self, scope: str | None = None, kind: str | None = None) -> int:
        """Ops in `scope` (None: every scope) of `kind` (None: both kinds)."""
        return sum(
            n
            for (s, _, k, _), n in self.counts.items()
            if (scope is None or s == scope) and (kind is None or k == kind)
        )

    def by(self, field: str, scope: str | None = None) -> Counter:
        """Ops per op name ("op") or per call site ("site") in `scope` (None: every scope), each
        key paired with its kind: {(op or site, kind): calls}."""
        index = {"op": 1, "site": 3}[field]
        out: Counter = Counter()
        for key, n in self.counts.items():
            if scope is None or key[0] == scope:
                out[(key[index], key[2])] += n
        return out

    def scopes(self) -> list[str]:
        return sorted({key[0] for key in self.counts})


@contextmanager
def without_row_padding():
    """Run one- and two-row matmuls unpadded while inside. Row padding (layers/row_padding.py) is a
    CPU-only choice measured per machine: counting with it would make the ops per layer differ
    between machines (+3 per padded Linear) and from what a GPU runs. A runner built inside
    never measures it either."""
    from ssd_engine.layers import row_padding

    saved = dict(row_padding._padded)
    row_padding._padded.update(
        {dtype: {} for dtype in (torch.float32, torch.bfloat16, torch.float16)}
    )
    try:
        yield
    finally:
        row_padding._padded.clear()
        row_padding._padded.update(saved)
