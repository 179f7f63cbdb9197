"""Linear layers with an optional prepared CPU weight (oneDNN prepacking, or a draft's or target's
bf16/int8/int4 format: layers/weight_formats.py; the output keeps the input's dtype).

Why prepack: on CPU, eager `F.linear` runs small-M matmuls (M = 2..16 rows, exactly the
verification / branch-decoding shapes) through MKL's generic path, which costs nearly M times
one row. oneDNN's packed-weight kernel shares the weight streaming across rows, so scoring 5
tokens costs ~0.9x one plain row instead of ~2.5x. For a single row with one thread, plain
`F.linear` is ~8% faster (benchmarks/results/2026-11-23-layouts.md), so:
- layout "packed": packed only, one copy (EngineConfig cpu_weight_layout "auto" at any thread count)
- layout "dual": both, plain for M = 1 and packed for M >= 2: ~8% faster one-thread decode for a
  second copy of every weight (+5.8 GB for the default target, +1.8 GB for its draft)
- layout "plain": F.linear only (what --enforce-eager gives)

Fused layers (qkv, gate_up) load each Hugging Face tensor into its slice via `shard_offsets`.
Under tensor parallelism one Linear is this rank's slice: `shards` says which rows of each HF
tensor it keeps (column-parallel), `cols` which input columns (row-parallel: the partial
products are all-reduced, then the bias is added once).
"""
import torch
import torch.nn.functional as F
from torch import nn

from ssd_engine.distributed.comm import TPGroup
from ssd_engine.distributed.partition import Span
from ssd_engine.layers.weight_formats import PreparedWeight, prepare


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 shards: dict[str | None, Span] | None = None, cols: Span | None = None,
                 reduce: TPGroup | None = None) -> None:
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
            raise ValueError(f"weight shape {tuple(loaded.shape)} does not fit {tuple(target.shape)}")
        target.copy_(loaded)

    def pack_for_cpu(self, keep_plain: bool, fmt: str = "fp32", row_independent: bool = False) -> None:
        """Prepare the weight in format `fmt`; drop the plain one unless `keep_plain` (layout "dual").
        row_independent: a target's format (layers/weight_formats.py `prepare`)."""
        if self.weight.device.type != "cpu":
            return
        self.prepared = prepare(self.weight.data, fmt, row_independent)
        if not keep_plain:
            self.weight = None

    def use_prepared(self, prepared: PreparedWeight) -> None:
        """Multiply by `prepared` from now on (a weight kept in its checkpoint's blocks) and drop the plain weight."""
        self.prepared = prepared
        self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.reduce else self.bias  # row-parallel: add the bias once, after the sum
        if self.prepared is not None and (x.shape[0] > 1 or self.weight is None):
            out = self.prepared(x, bias)
            if out.dtype != x.dtype:  # a target's bf16 / int format in an fp32 model: its activations stay fp32
                out = out.to(x.dtype)
        else:
            out = F.linear(x, self.weight, bias)
        if self.reduce:
            self.reduce.all_reduce(out)
            if self.bias is not None:
                out = out + self.bias
        return out
