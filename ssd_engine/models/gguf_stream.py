"""Dequantize a GGUF checkpoint into fp32 safetensors one slice of rows at a time.

Peak memory is a few `chunk_bytes` chunks whatever the model's size. The file is byte-identical to
what `save_pretrained` writes, so model fingerprints (calibration keys) hold."""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from ssd_engine.layers.shapes import transformers_config

# Llama's GGUF conversion interleaves the rotary halves of q and k rows; Qwen's keep HF's order
PERMUTED_QK = {"llama"}
SUPPORTED = ("llama", "qwen2", "qwen3")
# fp32 output per dequantization call; numpy temporaries are a few times this
CHUNK_BYTES = 64 * 2**20


@dataclass(frozen=True)
class TensorPlan:
    hf_name: str
    gguf_name: str
    shape: tuple[int, ...]  # Hugging Face order (GGUF lists dimensions innermost first)
    row_order: np.ndarray | None  # rows to read in this order (llama q/k), None = as stored

    @property
    def nbytes(self) -> int:
        return 4 * int(np.prod(self.shape))


def check_gguf(path) -> str:
    """-> the architecture; ValueError (one line) for an architecture other than SUPPORTED, a tensor
    type gguf cannot dequantize, or no tokenizer. Reads no tensor data."""
    import importlib.util

    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:  # accelerate: transformers reads a GGUF's config and tokenizer only with it
        raise ValueError(
            f"converting GGUF file {path} needs {' and '.join(missing)}: pip install {' '.join(missing)}"
        )
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
        field = reader.fields.get("general.architecture")
        arch = field.contents() if field is not None else None
    except Exception as error:  # a truncated or foreign file: gguf raises whatever it hits first
        raise ValueError(
            f"cannot read GGUF file {path}: {str(error).splitlines()[0] if str(error) else type(error).__name__}"
        ) from None
    if arch not in SUPPORTED:
        raise ValueError(
            f"GGUF architecture {arch!r} of {path} is not supported (supported: {', '.join(SUPPORTED)})"
        )
    kinds = {t.tensor_type for t in reader.tensors}
    bad = sorted(kind.name for kind in kinds if not _dequantizable(kind))
    if bad:
        raise ValueError(
            f"GGUF file {path} holds tensors of type {', '.join(bad)}, which gguf {_gguf_version()} "
            f"cannot dequantize"
        )
    if "tokenizer.ggml.model" not in reader.fields:
        raise ValueError(f"GGUF file {path} has no tokenizer (no tokenizer.ggml.model field)")
    return arch


def _dequantizable(kind) -> bool:
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    block_bytes = GGML_QUANT_SIZES[kind][1]
    try:
        dequantize(np.zeros((1, block_bytes), dtype=np.uint8), kind)
    except NotImplementedError:
        return False
    return True


def _gguf_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gguf")
    except PackageNotFoundError:
        return "(version unknown)"


def hf_name_map(config, arch: str) -> tuple[dict[str, str], set[str]]:
    """(GGUF tensor name -> Hugging Face parameter name, the HF names a checkpoint must hold), from
    gguf's naming table and the transformers class built on the meta device."""
    import gguf
    import torch
    from transformers import AutoModelForCausalLM

    arch_id = next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    names = gguf.get_tensor_name_map(arch_id, config.num_hidden_layers)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(transformers_config(config))
    mapping = {}
    for hf_name in model.state_dict():
        stem, dot, suffix = hf_name.rpartition(".")
        gguf_stem = names.get_name(stem) if dot else None
        if gguf_stem is not None:
            mapping[f"{gguf_stem}.{suffix}"] = hf_name
    required = set(model.state_dict())
    if getattr(config, "tie_word_embeddings", False):
        required.discard(
            "lm_head.weight"
        )  # the embedding is the head; save_pretrained drops it too
    return mapping, required


def plan_tensors(reader, config, arch: str) -> list[TensorPlan]:
    """Every GGUF tensor the HF model has, sorted by HF name (save_pretrained's file order)."""
    if arch not in SUPPORTED:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED)})"
        )
    mapping, required = hf_name_map(config, arch)
    plans = []
    for tensor in reader.tensors:
        hf_name = mapping.get(tensor.name)
        if hf_name is None:
            continue  # e.g. rope_freqs: recomputed from the config
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        order = None
        if arch in PERMUTED_QK and (".attn_q." in tensor.name or ".attn_k." in tensor.name):
            heads = (
                config.num_attention_heads
                if ".attn_q." in tensor.name
                else config.num_key_value_heads
            )
            order = _unpermute_rows(shape[0], heads)
        plans.append(TensorPlan(hf_name, tensor.name, shape, order))
    missing = sorted(required - {p.hf_name for p in plans})
    if missing:
        raise ValueError(
            f"GGUF lacks tensors for {missing[:5]}{' ...' if len(missing) > 5 else ''}"
        )
    return sorted(plans, key=lambda p: p.hf_name)


def _unpermute_rows(rows: int, heads: int) -> np.ndarray:
    """Row i of the HF matrix is row order[i] of the GGUF one: per head, GGUF stores the rotary
    pairs interleaved (d0a, d0b, d1a, ...), HF stores the halves apart (d0a, d1a, ..., d0b, ...)."""
    return np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(-1)


def safetensors_header(plans: list[TensorPlan]) -> bytes:
    """The header save_pretrained writes for these fp32 tensors, padded as safetensors pads it."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for plan in plans:
        header[plan.hf_name] = {
            "dtype": "F32",
            "shape": list(plan.shape),
            "data_offsets": [offset, offset + plan.nbytes],
        }
        offset += plan.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def dequantized_chunks(fd: int, tensor, plan: TensorPlan, chunk_bytes: int) -> Iterator[np.ndarray]:
    """The tensor's fp32 values in row slices of at most ~chunk_bytes, in HF row order."""
    from gguf import dequantize

    rows = tensor.data.shape[0] if tensor.data.ndim > 1 else 1
    row_bytes = tensor.n_bytes // rows
    row_values = plan.nbytes // 4 // rows
    step = max(1, chunk_bytes // (4 * row_values))
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        if plan.row_order is None:
            raw = os.pread(fd, (stop - start) * row_bytes, tensor.data_offset + start * row_bytes)
            stored = np.frombuffer(raw, dtype=np.uint8).reshape(stop - start, row_bytes)
        else:
            stored = np.stack(
                [
                    np.frombuffer(
                        os.pread(fd, row_bytes, tensor.data_offset + int(r) * row_bytes),
                        dtype=np.uint8,
                    )
                    for r in plan.row_order[start:stop]
                ]
            )
        values = dequantize(stored.view(tensor.data.dtype), tensor.tensor_type)
        yield np.ascontiguousarray(values, dtype=np.float32)


def write_safetensors(
    gguf_path: Path,
    reader,
    plans: list[TensorPlan],
    out_file: Path,
    chunk_bytes: int = CHUNK_BYTES,
    progress: Callable[[int], None] | None = None,
) -> None:
    tensors = {t.name: t for t in reader.tensors}
    fd = os.open(gguf_path, os.O_RDONLY)
    try:
        with open(out_file, "wb") as out:
            out.write(safetensors_header(plans))
            for plan in plans:
                written = 0
                for values in dequantized_chunks(fd, tensors[plan.gguf_name], plan, chunk_bytes):
                    out.write(values.data)
                    written += values.nbytes
                    if progress:
                        progress(values.nbytes)
                if written != plan.nbytes:
                    raise ValueError(
                        f"{plan.gguf_name}: wrote {written} bytes, expected {plan.nbytes}"
                    )
    finally:
        os.close(fd)


def convert(
    gguf_path: Path, out_dir: Path, chunk_bytes: int = CHUNK_BYTES, show_progress: bool = True
) -> None:
    """Write config.json, generation_config.json, model.safetensors and the tokenizer into out_dir."""
    import torch
    from gguf import GGUFReader
    from tqdm.auto import tqdm
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    if not getattr(config, "architectures", None):
        config.architectures = [causal_lm_class_name(config)]
    config.dtype = torch.float32
    reader = GGUFReader(str(gguf_path))
    arch = reader.fields["general.architecture"].contents()
    plans = plan_tensors(reader, config, arch)
    total = sum(p.nbytes for p in plans)
    with tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc=f"converting {gguf_path.name}",
        disable=not show_progress,
    ) as bar:
        write_safetensors(
            gguf_path, reader, plans, out_dir / "model.safetensors", chunk_bytes, bar.update
        )
    del reader
    config.save_pretrained(str(out_dir))
    GenerationConfig.from_model_config(config).save_pretrained(str(out_dir))
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(str(out_dir))


def causal_lm_class_name(config) -> str:
    """The class name transformers would instantiate for this config (what `architectures` holds)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM._model_mapping[type(config)].__name__


def main(argv: list[str] | None = None) -> int:
    """`python -m ssd_engine.models.gguf_stream GGUF OUT_DIR`: conversion runs in a child process so
    that what it imports and allocates is returned when it exits, not kept in the engine's RSS."""
    import sys

    from ssd_engine.utils.progress import progress_enabled

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m ssd_engine.models.gguf_stream GGUF OUT_DIR", file=sys.stderr)
        return 2
    try:
        convert(Path(args[0]), Path(args[1]), show_progress=progress_enabled())
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
