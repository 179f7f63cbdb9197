"""Weight format "q4k" (a draft's, needs AVX-512 VNNI): the weight quantized into GGUF Q4_K
super-blocks by a plain min / max quantizer, input columns zero-padded to whole super-blocks, and
run through the gguf-int8 panel kernel. A draft's precision affects acceptance, never output."""

import torch
import torch.nn.functional as F

from ssd_engine.kernels import gguf_cpu

SUPER = 256  # values a super-block
BLOCK_BYTES = 144
KIND = 12  # GGML's Q4_K id
CHUNK_ROWS = 4096  # rows quantized at a time: bounds the fp32 temporaries


def quantize_q4_k(weight: torch.Tensor) -> torch.Tensor:
    """uint8 [rows, ceil(cols / 256) * 144]: Q4_K blocks of `weight`, its columns zero-padded."""
    rows, cols = weight.shape
    padded = -(-cols // SUPER) * SUPER
    out = torch.empty(rows, padded // SUPER, BLOCK_BYTES, dtype=torch.uint8)
    for start in range(0, rows, CHUNK_ROWS):
        w = F.pad(weight[start : start + CHUNK_ROWS].float(), (0, padded - cols))
        out[start : start + CHUNK_ROWS] = _blocks(w.reshape(w.shape[0], padded // SUPER, 8, 32))
    return out.reshape(rows, -1)


def _blocks(w: torch.Tensor) -> torch.Tensor:
    """[rows, super-blocks, 8, 32] values -> [rows, super-blocks, 144] Q4_K bytes."""
    low = w.amin(-1).clamp(max=0)  # a sub-block's value is sc·d·q − m·dmin with q in 0..15, m >= 0
    step, floor = (w.amax(-1) - low) / 15, -low
    d = (step.amax(-1) / 63).half()
    dmin = (floor.amax(-1) / 63).half()
    sc = _ratio(step, d.float()[..., None]).round().clamp(0, 63)
    mn = _ratio(floor, dmin.float()[..., None]).round().clamp(0, 63)
    scale, offset = sc * d.float()[..., None], mn * dmin.float()[..., None]
    q = _ratio(w + offset[..., None], scale[..., None]).round().clamp(0, 15).to(torch.uint8)
    q = q.reshape(*q.shape[:2], 4, 2, 32)  # value 64 jj + 32 half + l
    qs = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).reshape(*q.shape[:2], 128)
    return torch.cat(
        [_halves(d), _halves(dmin), _packed_scales(sc.to(torch.uint8), mn.to(torch.uint8)), qs],
        dim=-1,
    )


def _ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    return torch.where(den > 0, num / torch.where(den > 0, den, 1), torch.zeros_like(num))


def _halves(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8).reshape(*x.shape, 2)


def _packed_scales(sc: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """Q4_K's 12 bytes of 6-bit scales and minimums (the inverse of gguf_blocks.h's scale_min_k4)."""
    low_sc, high_sc, low_mn, high_mn = sc[..., :4], sc[..., 4:], mn[..., :4], mn[..., 4:]
    first = low_sc | ((high_sc >> 4) << 6)
    second = low_mn | ((high_mn >> 4) << 6)
    third = (high_sc & 0xF) | ((high_mn & 0xF) << 4)
    return torch.cat([first, second, third], dim=-1)


class Q4KWeight:
    """A PreparedWeight (weight_formats.py): fp32 rows in, fp32 rows out."""

    def __init__(self, weight: torch.Tensor) -> None:
        if not gguf_cpu.panels_available(int8_activations=True):
            raise RuntimeError(
                "the q4k format needs the GGUF kernels built for a CPU with AVX-512 VNNI"
            )
        self.rows, self.cols = weight.shape
        self.padded = -(-self.cols // SUPER) * SUPER
        self.panels = torch.ops.ssd_engine_gguf.pack_panels(
            quantize_q4_k(weight), KIND, self.padded
        )
        self.nbytes = self.panels.numel()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if rows.dtype != torch.float32:
            rows = rows.float()
        if self.padded > self.cols:
            rows = F.pad(rows, (0, self.padded - self.cols))
        out = torch.ops.ssd_engine_gguf.linear_int8_panels(
            rows, self.panels, KIND, self.padded, self.rows
        )
        if bias is not None:
            out = out + bias
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], -1)

    def dequantized(self) -> torch.Tensor:
        """The fp32 weight it multiplies by."""
        eye = torch.eye(self.padded)
        return torch.ops.ssd_engine_gguf.linear_panels(
            eye, self.panels, KIND, self.padded, self.rows
        ).T[:, : self.cols]
