"""The quantized blocks a target's Linears keep in target_dtype="gguf", read from the GGUF file its
folder was converted from. Everything else loads from the fp32 folder (the same values)."""

from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from ssd_engine.distributed.partition import Span, attention_head_shards, intermediate_spans
from ssd_engine.kernels import gguf_cpu
from ssd_engine.kernels.gguf_cpu import BLOCKS
from ssd_engine.layers.gguf_weight import DENSE, GGUFWeight, QuantizedRows, random_rows
from ssd_engine.layers.linear import Linear
from ssd_engine.layers.shapes import head_dim

GGUF_FORMATS = ("gguf", "gguf-int8")  # the target_dtype values that keep a GGUF's blocks
Q4_K, Q8_0 = 12, 8
UNQUANTIZED = ("F32", "F16")  # kept as fp32 Linears
LINEAR_WEIGHTS = tuple(
    f"{name}.weight"
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
)
DUMMY_SEED = 0


def row_parallel_cols(config, tp: int) -> dict[str, list[Span]]:
    """Each rank's input columns of the row-parallel Linears (decoder.py's split), by module name."""
    shards = attention_head_shards(config.num_attention_heads, config.num_key_value_heads, tp)
    return {
        "o_proj": [shard.q.scaled(head_dim(config)) for shard in shards],
        "down_proj": intermediate_spans(config.intermediate_size, tp),
    }


class BlockSource(Protocol):
    int8_activations: bool  # target_dtype gguf-int8: the blocks multiply int8-rounded activations

    def rows(self, hf_name: str, rows: Span, cols: Span | None) -> QuantizedRows: ...

    def holds(self, hf_name: str) -> bool: ...


class GGUFFile:
    """Tensors of a GGUF file by Hugging Face name, memory-mapped: a slice is copied out when asked."""

    def __init__(self, path: Path, config, int8_activations: bool = False) -> None:
        from ssd_engine.models.gguf_stream import plan_tensors
        from ssd_engine.models.gguf_table import GGUFTable

        reader = GGUFTable(path)  # the tensor table alone: gguf's reader parses the tokenizer too
        arch = reader.field("general.architecture")
        self.path, self.int8_activations, self.config = path, int8_activations, config
        self.plans = {plan.hf_name: plan for plan in plan_tensors(reader, config, arch)}
        self.tensors = {tensor.name: tensor for tensor in reader.tensors}
        if "lm_head.weight" not in self.plans:  # a tied head multiplies by the embedding's blocks
            self.plans["lm_head.weight"] = self.plans["model.embed_tokens.weight"]

    def holds(self, hf_name: str) -> bool:
        """Whether a Linear's weight `hf_name` comes from this file (the loader then skips its fp32 copy)."""
        return hf_name in self.plans and _is_linear(hf_name)

    def check(self) -> None:
        """ValueError (one line) unless the kernels read every Linear weight of the file."""
        for hf_name, plan in self.plans.items():
            if _is_linear(hf_name):
                self._check_readable(hf_name, self.tensors[plan.gguf_name])

    def check_split(self, tp: int) -> None:
        """ValueError (one line) unless each rank's row-parallel input columns are whole blocks."""
        cols = row_parallel_cols(self.config, tp)
        for hf_name, plan in self.plans.items():
            kind = int(self.tensors[plan.gguf_name].tensor_type)
            module = hf_name.rsplit(".", 2)[-2] if hf_name.endswith(".weight") else ""
            if module not in cols or kind not in BLOCKS:
                continue
            values = BLOCKS[kind].values
            for span in cols[module]:
                if span.start % values or span.size % values:
                    raise ValueError(
                        f"target_dtype=gguf: {hf_name}'s input columns {span.start}..{span.end} (a slice of "
                        f"tensor_parallel_size={tp}) do not fall on its {values}-value blocks"
                    )

    def _check_readable(self, hf_name: str, tensor) -> None:
        if int(tensor.tensor_type) not in BLOCKS and tensor.tensor_type.name not in UNQUANTIZED:
            raise ValueError(
                f"target_dtype=gguf: {hf_name} is stored as {tensor.tensor_type.name} in "
                f"{self.path.name}, which the GGUF kernels do not read (they read {_kind_names()})"
            )

    def kind(self, hf_name: str) -> int:
        return int(self.tensors[self.plans[hf_name].gguf_name].tensor_type)

    def rows(self, hf_name: str, rows: Span, cols: Span | None) -> QuantizedRows:
        plan = self.plans[hf_name]
        tensor = self.tensors[plan.gguf_name]
        self._check_readable(hf_name, tensor)
        kind = int(tensor.tensor_type)
        order = np.arange(plan.shape[0]) if plan.row_order is None else plan.row_order
        picked = order[rows.start : rows.start + rows.size]
        data = (
            tensor.data[picked[0] : picked[-1] + 1]
            if plan.row_order is None
            else tensor.data[picked]
        )
        if tensor.tensor_type.name in UNQUANTIZED:
            dense = torch.from_numpy(np.array(data, dtype=np.float32))
            return QuantizedRows(
                dense
                if cols is None
                else dense[:, cols.start : cols.start + cols.size].contiguous(),
                DENSE,
                cols.size if cols else plan.shape[1],
            )
        values, nbytes = BLOCKS[kind].values, BLOCKS[kind].bytes
        width = plan.shape[1]
        if cols is not None:
            if cols.start % values or cols.size % values:
                raise ValueError(
                    f"target_dtype=gguf: {hf_name}'s input columns {cols.start}..{cols.start + cols.size} "
                    f"(its tensor-parallel slice) do not fall on its {values}-value blocks; use fewer ranks"
                )
            data = data[
                :, cols.start // values * nbytes : (cols.start + cols.size) // values * nbytes
            ]
            width = cols.size
        # a copy: the mapping may close
        return QuantizedRows(torch.from_numpy(np.array(data)), kind, width)


class DummyBlocks:
    """Random blocks at the real shapes (load_format="dummy"): of the types the GGUF file holds
    when it is known, else Q4_K (Q8_0 where a row is not whole 256-value blocks)."""

    def __init__(self, config, types: GGUFFile | None, int8_activations: bool = False) -> None:
        self.config, self.int8_activations = config, int8_activations
        self.types = types
        self.generator = torch.Generator().manual_seed(DUMMY_SEED)

    def holds(self, hf_name: str) -> bool:
        return False  # load_format dummy reads nothing anyway

    def rows(self, hf_name: str, rows: Span, cols: Span | None) -> QuantizedRows:
        width = cols.size if cols is not None else self._columns(hf_name)
        kind = self.types.kind(hf_name) if self.types else DENSE
        if kind not in BLOCKS:
            kind = Q4_K if width % BLOCKS[Q4_K].values == 0 else Q8_0
        return random_rows(rows.size, width, kind, self.generator)

    def _columns(self, hf_name: str) -> int:
        if "down_proj" in hf_name:
            return self.config.intermediate_size
        if "o_proj" in hf_name:
            return self.config.num_attention_heads * head_dim(self.config)
        return self.config.hidden_size


def gguf_blocks_for(model, config) -> BlockSource | None:
    """Where a target kept in its GGUF blocks (ModelConfig `model`) reads them; None for the other
    formats, and, said in one line, where the kernels cannot be built here."""
    from ssd_engine.models.gguf_files import source_gguf

    if model.weight_format not in GGUF_FORMATS:
        return None
    try:
        gguf_cpu.load()
    except gguf_cpu.KernelUnavailable as error:
        if model.weight_format != "gguf":  # gguf-int8 is another model: no silent stand-in
            raise ValueError(f"target_dtype={model.weight_format}: {error}") from None
        print(
            f"warning: target_dtype=gguf: {error}; the target runs its fp32 weights (the same values)"
        )
        return None
    int8_activations = model.weight_format == "gguf-int8"
    if model.load_format == "dummy":
        try:
            types = GGUFFile(source_gguf(model.path), config)
        except ValueError:  # a config-only folder: no file to take the types from
            types = None
        return DummyBlocks(config, types, int8_activations)
    return GGUFFile(source_gguf(model.path), config, int8_activations)


def gguf_weight(
    source: BlockSource, module_name: str, linear: Linear, stacked_params: dict
) -> GGUFWeight:
    """The blocks of this rank's slice of every checkpoint tensor a (possibly fused) Linear holds."""
    fused = {(module, shard): hf_part for hf_part, (module, shard) in stacked_params.items()}
    stem, _, leaf = module_name.rpartition(".")
    parts = []
    for shard, span in linear.shards.items():
        hf_name = (
            f"{module_name}.weight" if shard is None else f"{stem}.{fused[(leaf, shard)]}.weight"
        )
        parts.append(source.rows(hf_name, span, linear.cols))
    return GGUFWeight(parts, source.int8_activations)


def _is_linear(hf_name: str) -> bool:
    return hf_name == "lm_head.weight" or hf_name.endswith(LINEAR_WEIGHTS)


def _kind_names() -> str:
    from gguf import GGMLQuantizationType

    return ", ".join(GGMLQuantizationType(kind).name for kind in BLOCKS)
