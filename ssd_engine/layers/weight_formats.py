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
multiplied with it (a one-row decode, K + 1 verification rows, a batch of them, a prefill chunk).
The libraries pick their kernel by row count: oneDNN's packed fp32 and bf16 matmuls give one row
other bits than two or more, and on CPUs with AMX its bf16 matmul (and possibly torch's int8 / int4
ops) switches to AMX tiles past some row count, which sum in another order. `row_independent=True`
therefore never lets a call see a row count outside [2, ROW_TILE] (int8 / int4: [1, ROW_TILE]):
a lone oneDNN row runs padded to two, more than ROW_TILE rows run ROW_TILE at a time
(tests/test_target_dtype.py checks every format at the row counts the engine runs, on the CPU the
suite runs on).
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
# the most rows a row-independent format multiplies in one call: every count up to here took one
# kernel on each CPU measured (an AMX host's bf16 matmul changes kernel between 17 and 40 rows)
ROW_TILE = 16


class PreparedWeight(Protocol):
    nbytes: int  # what it holds in memory (and reads per forward)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...


class OneDNNWeight:
    """fp32 or bf16, reordered once into oneDNN's blocked layout: small row counts (verification,
    branch decoding) share one pass over the weight instead of ~one pass per row."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype, batch_hint: int = 8,
                 row_independent: bool = False) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.to(dtype), batch_hint)
        self.dtype = dtype
        self.row_independent = row_independent
        self.nbytes = self.packed.numel() * self.packed.element_size()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # a no-op `to` still costs a dispatch a call, four times a layer
        if bias is not None and bias.dtype != self.dtype:
            bias = bias.to(self.dtype)
        if x.dtype != self.dtype:
            x = x.to(self.dtype)
        if self.row_independent:
            return row_tiled(lambda rows: self._matmul(rows, bias), x, min_rows=2)
        rows = x.shape[0] if x.dim() == 2 else 0
        run_rows = padded_rows(rows, self.dtype) if rows else 0
        if run_rows > rows:  # a faster kernel from this many rows on (layers/row_padding.py)
            return self._matmul(_padded(x, run_rows), bias)[:rows]
        return self._matmul(x, bias)

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if torch.compiler.is_compiling():  # inductor cannot lower a weight it did not pack (compiled_ops.py)
            return torch.ops.ssd_engine.onednn_linear(x, self.packed, bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")


def _padded(x: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([x, x.new_zeros(rows - x.shape[0], x.shape[1])])


def row_tiled(matmul, x: torch.Tensor, min_rows: int = 1) -> torch.Tensor:
    """matmul(x) with every call given between min_rows and ROW_TILE rows (fewer are padded with
    zero rows, more are cut into ROW_TILE-row pieces): the same kernel for a row at any row count."""
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    count = rows.shape[0]
    if count < min_rows:
        out = matmul(_padded(rows, min_rows))[:count]
    elif count <= ROW_TILE:
        out = matmul(rows)
    else:
        out = torch.cat([row_tiled(matmul, rows[start:start + ROW_TILE], min_rows)
                         for start in range(0, count, ROW_TILE)])
    return out if x.dim() == 2 else out.reshape(*x.shape[:-1], -1)


class Int8Weight:
    def __init__(self, weight: torch.Tensor, row_independent: bool = False) -> None:
        self.row_independent = row_independent
        self.q = torch.empty(weight.shape, dtype=torch.int8)
        self.scales = torch.empty(weight.shape[0], dtype=torch.bfloat16)
        for start in range(0, weight.shape[0], CHUNK_ROWS):  # fp32 temporaries for one chunk at a time
            chunk = weight[start:start + CHUNK_ROWS].float()
            scales = (chunk.abs().amax(dim=1) / 127).clamp_min(1e-12)
            self.q[start:start + CHUNK_ROWS] = (chunk / scales[:, None]).round().clamp(-128, 127)
            self.scales[start:start + CHUNK_ROWS] = scales
        self.nbytes = self.q.numel() + self.scales.numel() * 2

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return _rows_through(lambda rows: torch._weight_int8pack_mm(rows, self.q, self.scales), x, bias,
                             self.row_independent)


class Int4Weight:
    """Asymmetric int4 per group: w = (q - 8) * scale + zero, with zero = min + 8 * scale."""

    def __init__(self, weight: torch.Tensor, row_independent: bool = False) -> None:
        self.row_independent = row_independent
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
            rows, self.packed, self.group, self.scales_and_zeros), x, bias, self.row_independent)


def _rows_through(matmul, x: torch.Tensor, bias: torch.Tensor | None, row_independent: bool) -> torch.Tensor:
    """A weight-only op (bf16 rows in, bf16 out) on x's rows, then the bias. The engine's activations
    are already 2-D bf16 rows: no reshape or cast is dispatched for them (each costs one a call)."""
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
    row_independent: each row's output bits never depend on the other rows multiplied with it (a
    target's format; see the module docstring)."""
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
        raise ValueError(f"{option}={fmt} is not supported by this CPU or torch build: "
                         f"{str(error).splitlines()[0]}") from None


def describe_target_format(running: str | None, asked: str | None) -> str:
    """target_dtype as the target runs it (None: fp32, the weights as dtype holds them; a gguf target
    whose kernels could not be built runs the same values in fp32)."""
    if running == "gguf":
        return "gguf (the checkpoint's blocks)"
    if running == "gguf-int8":
        return "gguf-int8 (the checkpoint's blocks, int8 activations)"
    if running:
        return f"{running} (re-quantized)"
    return "fp32 (the GGUF kernels could not be built)" if asked == "gguf" else "fp32"
