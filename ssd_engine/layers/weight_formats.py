"""CPU weight formats for a Linear: one prepared copy of the weight and the op multiplying by it.
"fp32" / "bf16": oneDNN-packed; "int8" / "int4": weight-only, bf16 activations (the int ops are
vectorised only for bf16); "q4k": layers/q4k_weight.py. A draft's format changes only speed and
acceptance, never output. A target in a lossy format is a different model whose AR output SD must
reproduce, so `row_independent=True` keeps every call within [2, ROW_TILE] rows (int8 / int4:
[1, ROW_TILE]): the libraries pick kernels, and so summation order, by row count."""

from typing import Protocol

import torch

import ssd_engine.layers.compiled_ops  # noqa: F401  registers torch.ops.ssd_engine.onednn_linear
from ssd_engine.layers.q4k_weight import Q4KWeight
from ssd_engine.layers.row_padding import padded_rows

FORMATS = ("fp32", "bf16", "int8", "int4", "q4k")  # most precise first
ACTIVATION_DTYPE = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "int8": torch.bfloat16,
    "int4": torch.bfloat16,
    "q4k": torch.float32,
}
INT4_GROUP = 32  # input columns per scale
INT4_ROWS = 16  # the packed int4 layout tiles output rows by 16
CHUNK_ROWS = 4096  # rows quantized at a time: bounds the fp32 / int32 temporaries
# the most rows a row-independent format multiplies in one call: one kernel for every count up to it
ROW_TILE = 16


class PreparedWeight(Protocol):
    nbytes: int  # what it holds in memory (and reads per forward)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...


class OneDNNWeight:
    """fp32 or bf16 in oneDNN's blocked layout: small row counts share one pass over the weight."""

    def __init__(
        self,
        weight: torch.Tensor,
        dtype: torch.dtype,
        batch_hint: int = 8,
        row_independent: bool = False,
    ) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.to(dtype), batch_hint)
        self.dtype = dtype
        self.row_independent = row_independent
        self.nbytes = self.packed.numel() * self.packed.element_size()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if bias is not None and bias.dtype != self.dtype:
            bias = bias.to(self.dtype)
        if x.dtype != self.dtype:
            x = x.to(self.dtype)
        if self.row_independent:
            return row_tiled(lambda rows: self._matmul(rows, bias), x, min_rows=2)
        rows = x.shape[0] if x.dim() == 2 else 0
        run_rows = padded_rows(rows, self.dtype) if rows else 0
        if run_rows > rows:
            return self._matmul(_padded(x, run_rows), bias)[:rows]
        return self._matmul(x, bias)

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if torch.compiler.is_compiling():  # inductor cannot lower a weight it did not pack
            return torch.ops.ssd_engine.onednn_linear(x, self.packed, bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")


def _padded(x: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([x, x.new_zeros(rows - x.shape[0], x.shape[1])])


def row_tiled(matmul, x: torch.Tensor, min_rows: int = 1) -> torch.Tensor:
    """matmul(x) with every call given min_rows..ROW_TILE rows (zero-padded or cut into pieces)."""
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    count = rows.shape[0]
    if count < min_rows:
        out = matmul(_padded(rows, min_rows))[:count]
    elif count <= ROW_TILE:
        out = matmul(rows)
    else:
        out = torch.cat(
            [
                row_tiled(matmul, rows[start : start + ROW_TILE], min_rows)
                for start in range(0, count, ROW_TILE)
            ]
        )
    return out if x.dim() == 2 else out.reshape(*x.shape[:-1], -1)


class Int8Weight:
    def __init__(self, weight: torch.Tensor, row_independent: bool = False) -> None:
        self.row_independent = row_independent
        self.q = torch.empty(weight.shape, dtype=torch.int8)
        self.scales = torch.empty(weight.shape[0], dtype=torch.bfloat16)
        for start in range(0, weight.shape[0], CHUNK_ROWS):
            chunk = weight[start : start + CHUNK_ROWS].float()
            scales = (chunk.abs().amax(dim=1) / 127).clamp_min(1e-12)
            self.q[start : start + CHUNK_ROWS] = (chunk / scales[:, None]).round().clamp(-128, 127)
            self.scales[start : start + CHUNK_ROWS] = scales
        self.nbytes = self.q.numel() + self.scales.numel() * 2

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return _rows_through(
            lambda rows: torch._weight_int8pack_mm(rows, self.q, self.scales),
            x,
            bias,
            self.row_independent,
        )


class Int4Weight:
    """Asymmetric int4 per group: w = (q - 8) * scale + zero, with zero = min + 8 * scale."""

    def __init__(self, weight: torch.Tensor, row_independent: bool = False) -> None:
        self.row_independent = row_independent
        self.group = INT4_GROUP
        packed, scales_and_zeros = [], []
        # CHUNK_ROWS is a multiple of the layout's 64-row blocks, so packed chunks concatenate
        for start in range(0, weight.shape[0], CHUNK_ROWS):
            chunk = weight[start : start + CHUNK_ROWS].float()
            rows, cols = chunk.shape
            grouped = chunk.reshape(rows, cols // self.group, self.group)
            low, high = grouped.amin(-1, keepdim=True), grouped.amax(-1, keepdim=True)
            scales = ((high - low) / 15).clamp_min(1e-12)
            q = ((grouped - low) / scales).round().clamp(0, 15).to(torch.int32).reshape(rows, cols)
            packed.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
            # [groups, rows, 2]: the op's scales_and_zeros layout
            scales_and_zeros.append(
                torch.cat([scales, low + 8 * scales], -1).transpose(0, 1).to(torch.bfloat16)
            )
        self.packed = torch.cat(packed)
        self.scales_and_zeros = torch.cat(scales_and_zeros, dim=1).contiguous()
        self.nbytes = (
            self.packed.numel() * self.packed.element_size() + self.scales_and_zeros.numel() * 2
        )

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return _rows_through(
            lambda rows: torch.ops.aten._weight_int4pack_mm_for_cpu(
                rows, self.packed, self.group, self.scales_and_zeros
            ),
            x,
            bias,
            self.row_independent,
        )


def _rows_through(
    matmul, x: torch.Tensor, bias: torch.Tensor | None, row_independent: bool
) -> torch.Tensor:
    """A weight-only op (bf16 rows in, bf16 out) on x's rows, then the bias."""
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    rows = rows if rows.dtype == torch.bfloat16 else rows.to(torch.bfloat16)
    out = row_tiled(matmul, rows) if row_independent else matmul(rows)
    if x.dim() != 2:
        out = out.reshape(*x.shape[:-1], -1)
    if bias is None:
        return out
    return out + (bias if bias.dtype == out.dtype else bias.to(out.dtype))


def prepare(weight: torch.Tensor, fmt: str, row_independent: bool = False) -> PreparedWeight:
    """`weight` ([out, in], any float dtype) in format `fmt`; a new tensor, the caller may drop the original.
    row_independent: each row's output bits never depend on the other rows multiplied with it."""
    if fmt in ("fp32", "bf16"):
        return OneDNNWeight(weight, ACTIVATION_DTYPE[fmt], row_independent=row_independent)
    if fmt == "int8":
        return Int8Weight(weight, row_independent)
    if fmt == "int4":
        if weight.shape[1] % INT4_GROUP or weight.shape[0] % INT4_ROWS:
            return Int8Weight(weight, row_independent)  # the int4 layout does not tile this shape
        return Int4Weight(weight, row_independent)
    if fmt == "q4k":
        return Q4KWeight(weight)
    raise ValueError(f"weight format must be one of {FORMATS}, got {fmt!r}")


def dequantized(weight: torch.Tensor, fmt: str) -> torch.Tensor:
    """The fp32 weight that format `fmt` actually multiplies by (tests compare against it)."""
    if fmt == "fp32":
        return weight.float()
    if fmt == "bf16":
        return weight.to(torch.bfloat16).float()
    if fmt == "q4k":
        return Q4KWeight(weight).dequantized()
    prepared = prepare(weight, fmt)
    eye = torch.eye(weight.shape[1], dtype=torch.bfloat16)
    return prepared(eye, None).float().t()  # exact when rows of the identity pass through unrounded


def check_supported(fmt: str, option: str) -> None:
    """A one-line ValueError naming `option` where this CPU or torch build lacks format `fmt`'s op."""
    try:
        prepare(torch.zeros(16, 64), fmt)(torch.zeros(1, 64, dtype=ACTIVATION_DTYPE[fmt]), None)
    except RuntimeError as error:
        raise ValueError(
            f"{option}={fmt} is not supported by this CPU or torch build: "
            f"{str(error).splitlines()[0]}"
        ) from None


def describe_target_format(running: str | None, asked: str | None) -> str:
    """target_dtype as the target runs it (None: fp32)."""
    if running == "gguf":
        return "gguf (the checkpoint's blocks)"
    if running == "gguf-int8":
        return "gguf-int8 (the checkpoint's blocks, int8 activations)"
    if running:
        return f"{running} (re-quantized)"
    return "fp32 (the GGUF kernels could not be built)" if asked == "gguf" else "fp32"
