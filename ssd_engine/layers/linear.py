"""Linear layers with optional oneDNN weight prepacking for CPU.

Why prepack: on CPU, eager `F.linear` runs small-M matmuls (M = 2..16 rows, exactly the
verification / branch-decoding shapes) through MKL's generic path, which costs nearly M times
one row. oneDNN's packed-weight kernel shares the weight streaming across rows, so scoring 4
tokens costs ~1.6x one token instead of ~3x. For a single row, though, plain `F.linear` is
~20% faster than the packed kernel with one thread (with two threads packed wins everywhere;
measured on this AVX2 CPU, see benchmarks/results), so:
- layout "dual": keep both, plain for M = 1 and packed for M >= 2 (fastest; ~2x weight memory)
- layout "packed": packed only (one copy; single-row decode ~20% slower)
- layout "plain": F.linear only (what --enforce-eager gives)
- layout "auto" (EngineConfig default): dual with one thread, packed with more

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

    def pack_for_cpu(self, keep_plain: bool, batch_hint: int = 8) -> None:
        if self.weight.device.type != "cpu" or self.weight.dtype != torch.float32:
            return
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.data, batch_hint)
        if not keep_plain:
            self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and (x.shape[0] > 1 or self.weight is None):
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
