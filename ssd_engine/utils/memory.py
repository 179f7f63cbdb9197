"""Host memory that costs RSS only where it is used: the KV cache as an anonymous private mapping,
the token embedding as a private mapping of its rows in the safetensors file."""

from __future__ import annotations

import ctypes
import json
import math
import mmap
import struct

import torch

_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros whose pages become resident when first written (CPU); plain zeros elsewhere."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    if count == 0:
        return torch.zeros(shape, dtype=dtype)
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # the tensor keeps `region` alive
    return torch.frombuffer(region, dtype=dtype, count=count).view(shape)


def safetensors_header(path: str) -> tuple[dict, int]:
    """(the header's tensor entries, the file offset their data_offsets count from)."""
    with open(path, "rb") as f:
        header_len = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(header_len))
    header.pop("__metadata__", None)
    return header, 8 + header_len


def map_rows(path: str, name: str, start: int, rows: int) -> torch.Tensor | None:
    """Rows [start, start + rows) of 2-D tensor `name`, backed by a private mapping of just those
    bytes of the file (nothing is read yet); None when the dtype is not one we map."""
    header, data_start = safetensors_header(path)
    entry = header[name]
    dtype, shape, offset = (
        _SAFETENSORS_DTYPES.get(entry["dtype"]),
        entry["shape"],
        data_start + entry["data_offsets"][0],
    )
    if dtype is None or len(shape) != 2 or start + rows > shape[0]:
        return None
    row_bytes = shape[1] * torch.empty((), dtype=dtype).element_size()
    first = offset + start * row_bytes
    aligned = first - first % mmap.ALLOCATIONGRANULARITY  # mmap offsets must be page-aligned
    length = first - aligned + rows * row_bytes
    with open(path, "rb") as f:
        # ACCESS_COPY = MAP_PRIVATE: writable for torch, never written back, clean until written
        region = mmap.mmap(f.fileno(), length, access=mmap.ACCESS_COPY, offset=aligned)
    return torch.frombuffer(
        region, dtype=dtype, count=rows * shape[1], offset=first - aligned
    ).view(rows, shape[1])


def release_freed_heap() -> None:
    """Return freed heap pages to the kernel (glibc's malloc_trim, else a no-op)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
