"""kernels/skinny_matmul.py, on CPU under Triton's interpreter (on a CUDA machine, compiled on the GPU):
each fusion (RMSNorm prologue + bias; SiLU-mul epilogue; residual add) against the torch ops it folds
in, for both tile kinds, and a row's bits alone equal to its bits among other rows. fp32 only: the
interpreter's bf16 `tl.dot` is not bf16's (the GPU run in scripts/gpu_check.sh's `skinny` stage
checks bf16)."""
import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from ssd_engine.kernels.skinny_matmul import SkinnyConfig, skinny_linear  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CHECK_PLACEMENT = True  # a GPU runs this file too: a host tensor meeting the device fails


@pytest.mark.parametrize("config", [SkinnyConfig(16, 32), SkinnyConfig(8, 64, dot=False)], ids=str)
def test_each_fusion_matches_the_torch_ops_and_rows_are_independent(config):
    g = torch.Generator().manual_seed(0)
    k, n, rows = 96, 40, 5
    new = lambda *shape: torch.randn(*shape, generator=g).to(DEVICE)  # noqa: E731
    x, w, bias, residual = new(rows, k), new(2 * n, k) / 10, new(2 * n), new(rows, n)
    norm = (torch.rand(k, generator=g) + 0.5).to(DEVICE)
    close = dict(atol=2e-5, rtol=2e-5)
    normed = skinny_linear(x, w, bias, norm_weight=norm, eps=1e-6, config=config)
    torch.testing.assert_close(normed, F.linear(F.rms_norm(x, (k,), norm, 1e-6), w, bias), **close)
    gate_up = F.linear(x, w)
    torch.testing.assert_close(skinny_linear(x, w, silu_mul=True, config=config),
                               F.silu(gate_up[:, :n]) * gate_up[:, n:], **close)
    torch.testing.assert_close(skinny_linear(x, w[:n], residual=residual, config=config),
                               F.linear(x, w[:n]) + residual, **close)
    for row in (0, rows - 1):  # alone, a row has the bits it has among the others
        alone = skinny_linear(x[row:row + 1], w, bias, norm_weight=norm, eps=1e-6, config=config)
        assert torch.equal(alone[0], normed[row])
