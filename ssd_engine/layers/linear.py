"""Linear layers with an optional prepared CPU weight (layers/weight_formats.py); the output keeps
the input's dtype. Prepacking exists because eager `F.linear` costs nearly M times one row for the
small M of verification; layout "dual" keeps the plain weight too, for M = 1.
Under tensor parallelism a Linear holds this rank's rows (`shards`) or input columns (`cols`)."""

import torch
import torch.nn.functional as F
from torch import nn

from ssd_engine.distributed.comm import TPGroup
from ssd_engine.distributed.partition import Span
from ssd_engine.layers.weight_formats import PreparedWeight, prepare


class Linear(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        shards: dict[str | None, Span] | None = None,
        cols: Span | None = None,
        reduce: TPGroup | None = None,
    ) -> None:
        """shards: HF tensor name (None: the layer's one tensor) -> the span of its rows kept here.
        cols: the span of input columns kept here; reduce: the group to all-reduce outputs over."""
        super().__init__()
        self.shards = shards or {None: Span(0, out_features)}
        self.cols = cols
        self.reduce = reduce if reduce is not None and reduce.size > 1 else None
        out_local = sum(span.size for span in self.shards.values())
        self.in_features = cols.size if cols else in_features
        self.out_features = out_local
        self.weight = nn.Parameter(torch.empty(out_local, self.in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_local), requires_grad=False) if bias else None
        # HF tensor name -> (row offset in this rank's weight, rows)
        self.shard_offsets: dict[str | None, tuple[int, int]] = {}
        offset = 0
        for name, span in self.shards.items():
            self.shard_offsets[name] = (offset, span.size)
            offset += span.size
        self.prepared: PreparedWeight | None = None

    def load(self, loaded: torch.Tensor, shard: str | None = None, is_bias: bool = False) -> None:
        rows = self.shards[shard]
        loaded = loaded.narrow(0, rows.start, rows.size)
        if self.cols is not None and not is_bias:
            loaded = loaded.narrow(1, self.cols.start, self.cols.size)
        start, size = self.shard_offsets[shard]
        target = (self.bias if is_bias else self.weight).narrow(0, start, size)
        if target.shape != loaded.shape:
            raise ValueError(
                f"weight shape {tuple(loaded.shape)} does not fit {tuple(target.shape)}"
            )
        target.copy_(loaded)

    def pack_for_cpu(
        self, keep_plain: bool, fmt: str = "fp32", row_independent: bool = False
    ) -> None:
        """Prepare the weight in format `fmt`; drop the plain one unless `keep_plain` ("dual")."""
        if self.weight.device.type != "cpu":
            return
        self.prepared = prepare(self.weight.data, fmt, row_independent)
        if not keep_plain:
            self.weight = None

    def use_prepared(self, prepared: PreparedWeight) -> None:
        """Multiply by `prepared` from now on and drop the plain weight."""
        self.prepared = prepared
        self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.reduce else self.bias  # row-parallel: add the bias once, after the sum
        if self.prepared is not None and (x.shape[0] > 1 or self.weight is None):
            out = self.prepared(x, bias)
            if out.dtype != x.dtype:
                out = out.to(x.dtype)
        else:
            out = F.linear(x, self.weight, bias)
        if self.reduce:
            self.reduce.all_reduce(out)
            if self.bias is not None:
                out = out + self.bias
        return out
