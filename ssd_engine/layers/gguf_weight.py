"""A Linear whose weight stays in its GGUF checkpoint's quantized blocks (target_dtype="gguf").
Blocks dequantize to exactly the checkpoint's fp32 values, and every kernel (plain or AVX-512
panels) gives a row the same bits at any row count, so batches, verification and prefill equal
one-row decoding. "gguf-int8" quantizes activations to int8 per row (llama.cpp's arithmetic)."""

from dataclasses import dataclass

import torch

from ssd_engine.kernels import gguf_cpu
from ssd_engine.layers.weight_formats import prepare

DUMMY_SCALE = 0x211F  # fp16 0.01: dummy blocks' scales, so their values are small normal floats
DENSE = 0  # GGML's F32 id: a tensor the file stores unquantized (F32 / F16), kept as fp32


@dataclass(frozen=True)
class QuantizedRows:
    """Consecutive output rows of a weight, as GGUF blocks of one type."""

    blocks: torch.Tensor  # uint8 [rows, bytes a row]; fp32 [rows, cols] where kind is DENSE
    kind: int  # GGML type id (gguf_cpu.BLOCKS), or DENSE
    cols: int  # input columns

    @property
    def rows(self) -> int:
        return self.blocks.shape[0]


@dataclass(frozen=True)
class PanelRows:
    """QuantizedRows of Q4_K / Q6_K repacked into panels of 16 outputs: the same values."""

    panels: torch.Tensor  # uint8 [ceil(rows / 16), bytes a panel]
    kind: int
    cols: int
    rows: int

    @staticmethod
    def of(part: QuantizedRows) -> "PanelRows":
        return PanelRows(
            torch.ops.ssd_engine_gguf.pack_panels(part.blocks, part.kind, part.cols),
            part.kind,
            part.cols,
            part.rows,
        )


def random_rows(rows: int, cols: int, kind: int, generator: torch.Generator) -> QuantizedRows:
    """Blocks of random codes with small normal scales: a dummy weight's (load_format="dummy")."""
    shape = gguf_cpu.BLOCKS[kind]
    blocks = torch.randint(
        0, 256, (rows, cols // shape.values, shape.bytes), dtype=torch.uint8, generator=generator
    )
    for offset in shape.half_offsets:
        blocks[..., offset] = DUMMY_SCALE & 0xFF
        blocks[..., offset + 1] = DUMMY_SCALE >> 8
    return QuantizedRows(blocks.reshape(rows, -1), kind, cols)


class GGUFWeight:
    """The PreparedWeight (weight_formats.py) of GGUF blocks: fp32 rows in, fp32 rows out."""

    def __init__(self, parts: list[QuantizedRows], int8_activations: bool = False) -> None:
        self.parts: list[QuantizedRows | PanelRows] = _merge_runs(parts)
        self.int8_activations = int8_activations
        if gguf_cpu.panels_available(int8_activations):
            self.parts = [
                PanelRows.of(p) if p.kind in gguf_cpu.PANEL_KINDS else p for p in self.parts
            ]
        self.nbytes = sum(_storage(part).nbytes for part in self.parts)
        self.dense = {
            id(part): prepare(part.blocks, "fp32", row_independent=True)
            for part in self.parts
            if part.kind == DENSE
        }

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if rows.dtype != torch.float32:
            rows = rows.float()
        outs = [self._part(rows, part) for part in self.parts]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        if bias is not None:
            out = out + bias
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], -1)

    def _part(self, rows: torch.Tensor, part: QuantizedRows | PanelRows) -> torch.Tensor:
        ops = torch.ops.ssd_engine_gguf
        if isinstance(part, PanelRows):
            linear = ops.linear_int8_panels if self.int8_activations else ops.linear_panels
            return linear(rows, part.panels, part.kind, part.cols, part.rows)
        if part.kind == DENSE:
            return self.dense[id(part)](rows, None)
        if self.int8_activations and part.kind in gguf_cpu.INT8_KINDS:
            return ops.linear_int8(rows, part.blocks, part.kind, part.cols)
        return ops.linear(rows, part.blocks, part.kind, part.cols)

    def dequantized(self) -> torch.Tensor:
        """The fp32 weight these blocks hold (tests compare against the checkpoint's)."""
        return torch.cat([_dequantized(p) for p in self.parts])


def _storage(part: QuantizedRows | PanelRows) -> torch.Tensor:
    return part.panels if isinstance(part, PanelRows) else part.blocks


def _dequantized(part: QuantizedRows | PanelRows) -> torch.Tensor:
    ops = torch.ops.ssd_engine_gguf
    if isinstance(part, PanelRows):  # times the identity: w·1 plus zeros, exact
        if not ops.panels_fp32_available():
            raise ValueError(
                "these panels dequantize only through the AVX-512 panel kernel, absent here"
            )
        return ops.linear_panels(
            torch.eye(part.cols), part.panels, part.kind, part.cols, part.rows
        ).T.contiguous()
    return part.blocks if part.kind == DENSE else ops.dequantize(part.blocks, part.kind, part.cols)


def _merge_runs(parts: list[QuantizedRows]) -> list[QuantizedRows]:
    """Adjacent parts of one type joined, so each run of a type is one kernel call."""
    merged: list[QuantizedRows] = []
    for part in parts:
        if merged and merged[-1].kind == part.kind:
            merged[-1] = QuantizedRows(
                torch.cat([merged[-1].blocks, part.blocks]), part.kind, part.cols
            )
        else:
            merged.append(part)
    return merged
