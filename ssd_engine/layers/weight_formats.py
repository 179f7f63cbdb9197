"""CPU weight formats for a Linear: one prepared copy of the weight and the torch op that multiplies by it.

- "fp32": oneDNN's packed fp32 weight (the target's format: exact against transformers in fp32).
- "bf16": oneDNN's packed bf16 weight, bf16 activations.
- "int8": weight-only int8, one scale per output channel, bf16 activations (`torch._weight_int8pack_mm`).
- "int4": weight-only int4 with a scale and zero point per group of input columns, bf16 activations
  (`aten._weight_int4pack_mm_for_cpu`, torchao's CPU layout).
- "q4k": GGUF Q4_K super-blocks times int8-rounded fp32 activations through the GGUF panel kernel
  (layers/q4k_weight.py; CPUs with AVX-512 VNNI).

Only a draft takes the lossy ones: verification uses the q rows the draft's own logits give,
whatever precision produced them, so the draft's format changes speed and acceptance, never the
output. The int ops are vectorised for bf16 activations only (fp32 ones take a scalar loop many
times slower), hence bf16 activations for all three; which format is fastest depends on the CPU
(bf16 units, AMX, AVX2 only) and the row count, so the engine measures (runtime/draft_format.py).

A target may take them too (EngineConfig.target_dtype): then it IS a different model, and SD/SSD
must reproduce that model's own AR output, so a row's output must not depend on how many rows are
multiplied with it (a one-row decode against K + 1 verification rows). Measured (AMD EPYC, torch
2.13, 1 and 2 threads, up to 2048 rows, the 1.5B target's shapes): the int8 and int4 ops give every
row the same bits at any row count and position; oneDNN's packed fp32 and bf16 kernels give one row
other bits than two or more (all row counts from two on agree). `row_independent=True` therefore
runs a lone row padded to two (tests/test_target_dtype.py checks all four).
"""
from typing import Protocol

import torch

import ssd_engine.layers.compiled_ops  # noqa: F401  registers torch.ops.ssd_engine.onednn_linear
from ssd_engine.layers.q4k_weight import Q4KWeight
from ssd_engine.layers.row_padding import padded_rows

FORMATS = ("fp32", "bf16", "int8", "int4", "q4k")  # most precise first
ACTIVATION_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.bfloat16, "int4": torch.bfloat16,
                    "q4k": torch.float32}
INT4_GROUP = 32  # input columns per scale: acceptance drops with coarser groups, speed barely moves
INT4_ROWS = 16   # the packed int4 layout tiles output rows by 16
CHUNK_ROWS = 4096  # rows quantized at a time: bounds the fp32 / int32 temporaries


class PreparedWeight(Protocol):
    nbytes: int  # what it holds in memory (and reads per forward)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...


class OneDNNWeight:
    """fp32 or bf16, reordered once into oneDNN's blocked layout: small row counts (verification,
    branch decoding) share one pass over the weight instead of ~one pass per row."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype, batch_hint: int = 8, min_rows: int = 1) -> None:
        """min_rows: fewer rows are run padded to this many (2: every row count takes the same kernel)."""
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.to(dtype), batch_hint)
        self.dtype = dtype
        self.min_rows = min_rows
        self.nbytes = self.packed.numel() * self.packed.element_size()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # a no-op `to` still costs a dispatch a call, four times a layer
        if bias is not None and bias.dtype != self.dtype:
            bias = bias.to(self.dtype)
        if x.dtype != self.dtype:
            x = x.to(self.dtype)
        rows = x.shape[0] if x.dim() == 2 else 0
        run_rows = max(padded_rows(rows, self.dtype), self.min_rows) if rows else 0
        if run_rows > rows:  # a faster kernel from this many rows on (layers/row_padding.py)
            x = torch.cat([x, x.new_zeros(run_rows - rows, x.shape[1])])
            return self._matmul(x, bias)[:rows]
        return self._matmul(x, bias)

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if torch.compiler.is_compiling():  # inductor cannot lower a weight it did not pack (compiled_ops.py)
            return torch.ops.ssd_engine.onednn_linear(x, self.packed, bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")


class Int8Weight:
    def __init__(self, weight: torch.Tensor) -> None:
        self.q = torch.empty(weight.shape, dtype=torch.int8)
        self.scales = torch.empty(weight.shape[0], dtype=torch.bfloat16)
        for start in range(0, weight.shape[0], CHUNK_ROWS):  # fp32 temporaries for one chunk at a time
            chunk = weight[start:start + CHUNK_ROWS].float()
            scales = (chunk.abs().amax(dim=1) / 127).clamp_min(1e-12)
            self.q[start:start + CHUNK_ROWS] = (chunk / scales[:, None]).round().clamp(-128, 127)
            self.scales[start:start + CHUNK_ROWS] = scales
        self.nbytes = self.q.numel() + self.scales.numel() * 2

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return _rows_through(lambda rows: torch._weight_int8pack_mm(rows, self.q, self.scales), x, bias)


class Int4Weight:
    """Asymmetric int4 per group: w = (q - 8) * scale + zero, with zero = min + 8 * scale."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.group = INT4_GROUP
        packed, scales_and_zeros = [], []
        # chunks of CHUNK_ROWS (a multiple of the layout's 64-row blocks, so the packed chunks
        # concatenate into the whole matrix's layout): the int32 codes the op takes cost 4 bytes a
        # weight, ~0.5 GB at once for a 150k-row LM head
        for start in range(0, weight.shape[0], CHUNK_ROWS):
            chunk = weight[start:start + CHUNK_ROWS].float()
            rows, cols = chunk.shape
            grouped = chunk.reshape(rows, cols // self.group, self.group)
            low, high = grouped.amin(-1, keepdim=True), grouped.amax(-1, keepdim=True)
            scales = ((high - low) / 15).clamp_min(1e-12)
            q = ((grouped - low) / scales).round().clamp(0, 15).to(torch.int32).reshape(rows, cols)
            packed.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
            # [groups, rows, 2]: the op's scales_and_zeros layout
            scales_and_zeros.append(torch.cat([scales, low + 8 * scales], -1).transpose(0, 1).to(torch.bfloat16))
        self.packed = torch.cat(packed)
        self.scales_and_zeros = torch.cat(scales_and_zeros, dim=1).contiguous()
        self.nbytes = self.packed.numel() * self.packed.element_size() + self.scales_and_zeros.numel() * 2

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return _rows_through(lambda rows: torch.ops.aten._weight_int4pack_mm_for_cpu(
            rows, self.packed, self.group, self.scales_and_zeros), x, bias)


def _rows_through(matmul, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A weight-only op (bf16 rows in, bf16 out) on x's rows, then the bias. The engine's activations
    are already 2-D bf16 rows: no reshape or cast is dispatched for them (each costs one a call)."""
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    out = matmul(rows if rows.dtype == torch.bfloat16 else rows.to(torch.bfloat16))
    if x.dim() != 2:
        out = out.reshape(*x.shape[:-1], -1)
    if bias is None:
        return out
    return out + (bias if bias.dtype == out.dtype else bias.to(out.dtype))


def prepare(weight: torch.Tensor, fmt: str, row_independent: bool = False) -> PreparedWeight:
    """`weight` ([out, in], any float dtype) in format `fmt`; a new tensor, the caller may drop the original.
    row_independent: each row's output bits never depend on the other rows multiplied with it (a
    target's format; see the module docstring)."""
    if fmt in ("fp32", "bf16"):
        return OneDNNWeight(weight, ACTIVATION_DTYPE[fmt], min_rows=2 if row_independent else 1)
    if fmt == "int8":
        return Int8Weight(weight)
    if fmt == "int4":
        if weight.shape[1] % INT4_GROUP or weight.shape[0] % INT4_ROWS:
            return Int8Weight(weight)  # the int4 layout does not tile this shape: the next-smallest format
        return Int4Weight(weight)
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
        raise ValueError(f"{option}={fmt} is not supported by this CPU or torch build: "
                         f"{str(error).splitlines()[0]}") from None
