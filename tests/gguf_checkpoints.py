"""Small GGUF test files: a tiny checkpoint's Linears as random GGUF blocks (Q4_K, Q6_K, Q8_0, ...),
written with gguf's own writer, beside the folder the engine's converter would make of it (every
tensor dequantized by gguf's own dequantizer into fp32 safetensors, the marker naming the file).
transformers on that folder is the oracle a target kept in its blocks must match."""

import json
import os
import shutil
from pathlib import Path

import numpy as np
import torch
from ssd_engine.kernels.gguf_cpu import BLOCKS

from ssd_engine.models.default_models import MARKER

# fp16 scales that give weights of mean ~0 and std ~0.02-0.08 from uniformly random codes
SCALES = {
    2: [0.01],
    3: [0.01, -0.08],
    6: [0.005],
    7: [0.005, -0.08],
    8: [0.0006],
    12: [0.0004, 0.003],
    13: [0.0002, 0.003],
    14: [0.00006],
}


def random_blocks(rows: int, cols: int, kind: int, rng: np.random.Generator) -> np.ndarray:
    shape = BLOCKS[kind]
    blocks = rng.integers(0, 256, size=(rows, cols // shape.values, shape.bytes), dtype=np.uint8)
    for offset, scale in zip(shape.half_offsets, SCALES[kind]):
        blocks[..., offset : offset + 2] = (
            np.full(blocks.shape[:2], scale, np.float16)
            .view(np.uint8)
            .reshape(*blocks.shape[:2], 2)
        )
    return blocks.reshape(rows, -1)


def gguf_checkpoint(src: str, dst: str, arch: str, kinds) -> tuple[str, str]:
    """(the converted folder, the GGUF file) for checkpoint folder `src`: `kinds(hf_name)` is the
    GGML type of each 2-D Linear weight (None: kept F32)."""
    import gguf
    from gguf.quants import dequantize
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    from ssd_engine.models.gguf_stream import PERMUTED_QK, _unpermute_rows, hf_name_map

    rng = np.random.default_rng(0)
    config = AutoConfig.from_pretrained(src)
    mapping, _ = hf_name_map(config, arch)
    to_gguf = {hf: name for name, hf in mapping.items()}
    state = load_file(os.path.join(src, "model.safetensors"))
    folder, path = Path(dst) / "converted", Path(dst) / "model.gguf"
    shutil.copytree(src, folder)
    writer = gguf.GGUFWriter(str(path), arch)
    for hf_name, tensor in sorted(state.items()):
        kind = kinds(hf_name) if tensor.dim() == 2 else None
        if kind is None:
            writer.add_tensor(to_gguf[hf_name], tensor.numpy())
            continue
        stored = random_blocks(*tensor.shape, kind, rng)  # GGUF's row order
        values = dequantize(stored, gguf.GGMLQuantizationType(kind)).reshape(tensor.shape)
        if arch in PERMUTED_QK and (".q_proj." in hf_name or ".k_proj." in hf_name):
            heads = (
                config.num_attention_heads if ".q_proj." in hf_name else config.num_key_value_heads
            )
            values = values[_unpermute_rows(tensor.shape[0], heads)]
        state[hf_name] = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
        writer.add_tensor(to_gguf[hf_name], stored, raw_dtype=gguf.GGMLQuantizationType(kind))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / MARKER).write_text(json.dumps({"source": path.name, "path": str(path)}) + "\n")
    return str(folder), str(path)
