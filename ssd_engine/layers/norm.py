"""RMSNorm as torch's fused op; with the residual add, one layer op (layers/layer_ops.py)."""

import torch
import torch.nn.functional as F
from torch import nn

from ssd_engine.layers.layer_ops import LayerOps


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps, self.shape = eps, (dim,)
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.layer_ops: LayerOps | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32: the reference's bits. bf16: accumulates in fp32 and rounds once, after the weight
        return F.rms_norm(x, self.shape, self.weight, self.eps)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); residual None: (norm(x), x)."""
        if self.layer_ops is not None:
            return self.layer_ops.add_rms_norm(x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual
        return self(x), x
