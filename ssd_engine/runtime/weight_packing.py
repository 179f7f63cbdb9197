"""How a runner prepares each loaded Linear: one packing chosen per model (`choose`) from its
resolved format, called layer by layer as the loader reads the weights. `matmul_dtype` is the
dtype of the oneDNN matmuls it packs, whose row padding the plan measures (planning/row_padding_probe.py)."""

from dataclasses import dataclass

import torch

from ssd_engine.layers.linear import Linear
from ssd_engine.layers.weight_formats import ACTIVATION_DTYPE
from ssd_engine.models.gguf_weights import gguf_weight

NATIVE_FORMAT = {torch.float32: "fp32", torch.bfloat16: "bf16"}


@dataclass(frozen=True)
class Packing:
    """Weights left as loaded (a plain layout, or a dtype oneDNN does not pack)."""

    matmul_dtype: torch.dtype | None = None

    def pack(self, name: str, module) -> None:
        if isinstance(module, Linear):
            self.prepare(name, module)

    def prepare(self, name: str, module: Linear) -> None:
        pass


@dataclass(frozen=True)
class GGUFPacking(Packing):
    """The Linear kept in its GGUF blocks, read from the GGUF file instead of the folder."""

    blocks: object = None
    stacked_params: tuple = ()

    def prepare(self, name: str, module: Linear) -> None:
        module.use_prepared(gguf_weight(self.blocks, name, module, self.stacked_params))


@dataclass(frozen=True)
class GPURounding(Packing):
    """A target's bf16 on a GPU: its weights rounded to bf16, kept in the runner's dtype."""

    def prepare(self, name: str, module: Linear) -> None:
        if module.weight.dtype != torch.bfloat16:
            module.weight.data.copy_(module.weight.data.to(torch.bfloat16))


@dataclass(frozen=True)
class FormatPacking(Packing):
    """A weight format of layers/weight_formats.py (a draft's, or the target's target_dtype)."""

    fmt: str = "fp32"
    row_independent: bool = False

    def prepare(self, name: str, module: Linear) -> None:
        module.pack_for_cpu(keep_plain=False, fmt=self.fmt, row_independent=self.row_independent)


@dataclass(frozen=True)
class LayoutPacking(Packing):
    """The dtype's own values oneDNN-packed; "dual" also keeps the plain copy. A tied head shares
    the embedding table, which must stay plain: only "dual" pays for its copy."""

    fmt: str = "fp32"
    dual: bool = False
    tied_head: bool = False

    def prepare(self, name: str, module: Linear) -> None:
        if name == "lm_head" and self.tied_head and not self.dual:
            return
        module.pack_for_cpu(keep_plain=self.dual, fmt=self.fmt)


def choose(
    device: str,
    dtype: torch.dtype,
    weight_layout: str,
    weight_format: str | None,
    row_independent: bool = False,
    gguf_blocks=None,
    stacked_params: tuple = (),
    tied_head: bool = False,
) -> Packing:
    """The packing of a model on `device` in `dtype` with its resolved layout and format (None:
    the dtype's own); `gguf_blocks`: the GGUF blocks it reads, if any."""
    if gguf_blocks is not None:
        return GGUFPacking(torch.float32, gguf_blocks, stacked_params)
    if torch.device(device).type != "cpu":
        return GPURounding() if weight_format == "bf16" else Packing()
    if weight_format is not None:
        onednn = (
            ACTIVATION_DTYPE[weight_format] if weight_format in NATIVE_FORMAT.values() else None
        )
        return FormatPacking(onednn, weight_format, row_independent)
    native = NATIVE_FORMAT.get(dtype)
    if weight_layout == "plain" or native is None:
        return Packing()
    return LayoutPacking(dtype, native, weight_layout == "dual", tied_head)
