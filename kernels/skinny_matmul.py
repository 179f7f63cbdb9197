"""A decode step's matmul with its neighbours folded in: one Triton launch for a few rows (T <= 16)
times a weight, where the layer otherwise launches a norm, the GEMM and an elementwise op.

    y = linear(rms_norm(x) if norm_weight else x, weight, bias)      prologue: the row's RMSNorm
    y = silu(y[:, :N]) * y[:, N:]         when silu_mul (weight holds gate's rows, then up's)
    y = y + residual                      epilogue: the residual add

Each rounds where the torch ops round (the norm's output, the matmul's, SiLU's, to the activations'
dtype), so results stay within rounding of the unfused path. Every row is computed alone with one
reduction order whatever T is (BLOCK_T is fixed), so a row's bits never depend on the other rows.
Runs on CUDA, or on CPU under TRITON_INTERPRET=1."""
from dataclasses import dataclass

import torch

from ssd_engine.utils.launches import kernel_launch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs without triton
    triton = None

MAX_ROWS = 16


@dataclass(frozen=True)
class SkinnyConfig:
    """Tile sizes: BLOCK_N output columns a program, BLOCK_K of the reduction a loop step; dot: tensor
    cores on a 16-row tile (else a broadcast multiply and sum, which allows BLOCK_N < 16)."""
    block_n: int = 16
    block_k: int = 256
    dot: bool = True
    num_warps: int = 4

    def __str__(self) -> str:
        return f"{'dot' if self.dot else 'fma'} n{self.block_n} k{self.block_k} w{self.num_warps}"


if triton is not None:

    @triton.jit
    def _row_inv_rms(x_ptr, sx, rows, r_ok, K, eps, BLOCK_K: tl.constexpr):
        total = tl.zeros([rows.shape[0]], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            xv = tl.load(x_ptr + rows[:, None] * sx + ks[None, :], mask=r_ok[:, None] & (ks[None, :] < K),
                         other=0.0).to(tl.float32)
            total += tl.sum(xv * xv, axis=1)
        return 1.0 / tl.sqrt(total / K + eps)

    @triton.jit
    def _partial(x_ptr, w_ptr, nw_ptr, inv, rows, r_ok, cols, c_ok, K, sx, sw, acc,
                 NORM: tl.constexpr, DOT: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
        """acc + x[rows] @ w[cols].T over all of K (x normed first when NORM)."""
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            xv = tl.load(x_ptr + rows[:, None] * sx + ks[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            if NORM:
                nw = tl.load(nw_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
                xv = (xv.to(tl.float32) * inv[:, None] * nw[None, :]).to(xv.dtype)
            if DOT:
                w = tl.load(w_ptr + cols[None, :] * sw + ks[:, None], mask=c_ok[None, :] & k_ok[:, None], other=0.0)
                acc = tl.dot(xv, w, acc, input_precision=PRECISION)
            else:
                w = tl.load(w_ptr + cols[:, None] * sw + ks[None, :], mask=c_ok[:, None] & k_ok[None, :], other=0.0)
                acc += tl.sum(xv.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        return acc

    @triton.jit
    def _skinny_kernel(x_ptr, w_ptr, b_ptr, nw_ptr, res_ptr, out_ptr, T, N, K, eps, sx, sw, sr, so,
                       NORM: tl.constexpr, BIAS: tl.constexpr, SILU: tl.constexpr, RESIDUAL: tl.constexpr,
                       DOT: tl.constexpr, PRECISION: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.arange(0, BLOCK_T)
        r_ok, c_ok = rows < T, cols < N
        inv = tl.zeros([BLOCK_T], tl.float32)
        if NORM:
            inv = _row_inv_rms(x_ptr, sx, rows, r_ok, K, eps, BLOCK_K)
        acc = _partial(x_ptr, w_ptr, nw_ptr, inv, rows, r_ok, cols, c_ok, K, sx, sw,
                       tl.zeros([BLOCK_T, BLOCK_N], tl.float32), NORM, DOT, BLOCK_K, PRECISION)
        if BIAS:
            acc += tl.load(b_ptr + cols, mask=c_ok, other=0.0).to(tl.float32)[None, :]
        dtype = out_ptr.dtype.element_ty
        y = acc.to(dtype).to(tl.float32)  # the matmul's output, rounded as torch's is
        if SILU:  # the up half: weight rows N + cols
            up = _partial(x_ptr, w_ptr + N * sw, nw_ptr, inv, rows, r_ok, cols, c_ok, K, sx, sw,
                          tl.zeros([BLOCK_T, BLOCK_N], tl.float32), NORM, DOT, BLOCK_K, PRECISION)
            y = (y / (1.0 + tl.exp(-y))).to(dtype).to(tl.float32) * up.to(dtype).to(tl.float32)
        if RESIDUAL:
            y += tl.load(res_ptr + rows[:, None] * sr + cols[None, :], mask=r_ok[:, None] & c_ok[None, :],
                         other=0.0).to(tl.float32)
        tl.store(out_ptr + rows[:, None] * so + cols[None, :], y.to(dtype), mask=r_ok[:, None] & c_ok[None, :])


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  norm_weight: torch.Tensor | None = None, eps: float = 0.0, silu_mul: bool = False,
                  residual: torch.Tensor | None = None, config: SkinnyConfig = SkinnyConfig()) -> torch.Tensor:
    """x [T, K] (T <= MAX_ROWS), weight [N', K] (N' = 2 N with silu_mul), bias [N'], norm_weight [K],
    residual [T, N] -> [T, N] (the module docstring's formula)."""
    rows, k = x.shape
    n = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    assert rows <= MAX_ROWS and weight.shape[1] == k and x.stride(-1) == 1 and weight.stride(-1) == 1
    assert bias is None or not silu_mul
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if residual is not None:
        assert residual.shape == out.shape and residual.stride(-1) == 1
    operands = [t for t in (x, weight, bias, norm_weight, residual, out) if t is not None]
    with kernel_launch("skinny_linear", *operands):
        _skinny_kernel[(triton.cdiv(n, config.block_n),)](
            x, weight, bias if bias is not None else x, norm_weight if norm_weight is not None else x,
            residual if residual is not None else x, out, rows, n, k, float(eps), x.stride(0), weight.stride(0),
            residual.stride(0) if residual is not None else 0, out.stride(0),
            NORM=norm_weight is not None, BIAS=bias is not None, SILU=silu_mul, RESIDUAL=residual is not None,
            DOT=config.dot, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # fp32 stays fp32
            BLOCK_T=MAX_ROWS if config.dot else triton.next_power_of_2(rows),
            BLOCK_N=config.block_n, BLOCK_K=config.block_k, num_warps=config.num_warps)
    return out
