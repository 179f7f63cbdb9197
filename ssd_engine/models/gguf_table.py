"""A GGUF file's tensor table, read without parsing its metadata arrays (gguf's GGUFReader parses
the tokenizer's too, which is slow); tensor data is mapped lazily."""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# GGUF metadata value types -> their size in bytes (8: string, 9: array are walked)
FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY = 8, 9
ALIGNMENT_KEY = "general.alignment"


@dataclass
class TableTensor:
    """The attributes of gguf's ReaderTensor that the engine reads."""

    name: str
    shape: np.ndarray  # dimensions, innermost first (GGUF's order)
    tensor_type: object  # gguf.GGMLQuantizationType
    data_offset: int
    n_bytes: int
    path: Path

    @property
    def data(self) -> np.ndarray:
        """The stored bytes as gguf's reader shapes them: [rows, bytes a row] for blocks, typed values otherwise."""
        from gguf import GGML_QUANT_SIZES

        block, size = GGML_QUANT_SIZES[self.tensor_type]
        columns, rows = (
            int(self.shape[0]),
            int(np.prod(self.shape[1:])) if len(self.shape) > 1 else 1,
        )
        typed = {"F32": np.float32, "F16": np.float16}.get(self.tensor_type.name)
        if typed is not None:
            values = np.memmap(
                self.path, dtype=typed, mode="r", offset=self.data_offset, shape=(rows, columns)
            )
            return values if len(self.shape) > 1 else values[0]
        return np.memmap(
            self.path,
            dtype=np.uint8,
            mode="r",
            offset=self.data_offset,
            shape=(rows, columns // block * size),
        )


class GGUFTable:
    def __init__(self, path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:  # mapped: only the pages of the header and table are read
            head = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            self._read(head)
        finally:
            head.close()

    def _read(self, head) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        magic, _version, tensor_count, field_count = struct.unpack_from("<4sIQQ", head, 0)
        if magic != b"GGUF":
            raise ValueError(f"{self.path} is not a GGUF file")
        at, self.fields = 24, {}
        for _ in range(field_count):
            key, at = _string(head, at)
            (kind,) = struct.unpack_from("<I", head, at)
            value, at = _value(head, at + 4, kind)
            self.fields[key] = value
        self.tensors = []
        infos = []
        for _ in range(tensor_count):
            name, at = _string(head, at)
            (dims,) = struct.unpack_from("<I", head, at)
            shape = np.array(struct.unpack_from(f"<{dims}Q", head, at + 4), dtype=np.int64)
            kind, offset = struct.unpack_from("<IQ", head, at + 4 + 8 * dims)
            at += 4 + 8 * dims + 12
            infos.append((name, shape, GGMLQuantizationType(kind), offset))
        alignment = int(self.fields.get(ALIGNMENT_KEY, 32))
        start = -(-at // alignment) * alignment
        for name, shape, kind, offset in infos:
            block, size = GGML_QUANT_SIZES[kind]
            n_bytes = int(np.prod(shape)) // block * size
            self.tensors.append(TableTensor(name, shape, kind, start + offset, n_bytes, self.path))

    def field(self, key: str):
        return self.fields.get(key)


def _string(buffer: bytes, at: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", buffer, at)
    return buffer[at + 8 : at + 8 + length].decode("utf-8", errors="replace"), at + 8 + length


def _value(buffer: bytes, at: int, kind: int):
    """(the value, or None for an array, which is skipped), the offset past it."""
    if kind == STRING:
        return _string(buffer, at)
    if kind == ARRAY:
        item, count = struct.unpack_from("<IQ", buffer, at)
        at += 12
        if item in FIXED:
            return None, at + FIXED[item] * count
        for _ in range(count):
            _, at = _value(buffer, at, item)
        return None, at
    size = FIXED[kind]
    fmt = {
        0: "B",
        1: "b",
        2: "H",
        3: "h",
        4: "I",
        5: "i",
        6: "f",
        7: "?",
        10: "Q",
        11: "q",
        12: "d",
    }[kind]
    return struct.unpack_from("<" + fmt, buffer, at)[0], at + size
