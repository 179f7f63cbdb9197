"""Linear layers with optional oneDNN weight prepacking for CPU.

Why prepack: on CPU, eager `F.linear` runs small-M matmuls (M = 2..16 rows, exactly the
verification / branch-decoding shapes) through MKL's generic path, which costs nearly M times
one row. oneDNN's packed-weight kernel keeps the weight-streaming cost shared across rows,
so scoring 4 tokens costs ~1.5x one token instead of ~3x (see benchmarks/results). Packing
replaces the plain weight (no second copy in memory). `--enforce-eager` leaves weights plain.

Fused layers (qkv, gate_up) load each Hugging Face tensor into its slice via `shard_offsets`.
"""
import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 shard_sizes: dict[str, int] | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        # name of each fused HF tensor -> (row offset, rows)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, size in (shard_sizes or {}).items():
            self.shard_offsets[name] = (offset, size)
            offset += size
        self.packed: torch.Tensor | None = None

    def load(self, loaded: torch.Tensor, shard: str | None = None, is_bias: bool = False) -> None:
        target = self.bias if is_bias else self.weight
        if shard is not None:
            start, size = self.shard_offsets[shard]
            target = target.narrow(0, start, size)
        if target.shape != loaded.shape:
            raise ValueError(f"weight shape {tuple(loaded.shape)} does not fit {tuple(target.shape)}")
        target.copy_(loaded)

    def pack_for_cpu(self, batch_hint: int = 8) -> None:
        if self.weight.device.type != "cpu" or self.weight.dtype != torch.float32:
            return
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.data, batch_hint)
        self.weight = None  # the packed copy replaces it: no doubled memory

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
