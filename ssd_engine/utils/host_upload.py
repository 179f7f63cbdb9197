"""Host lists to the device in one pinned, non-blocking copy (pageable ones wait for the stream)."""

import array

import torch

# Python values packed by the array module, skipping torch.tensor(list)'s per-value checks
TYPECODES = {torch.long: "q", torch.int32: "i", torch.float32: "f", torch.float64: "d"}


def upload(
    columns: list, device: torch.device, dtype: torch.dtype = torch.long
) -> list[torch.Tensor]:
    """One `dtype` tensor per column on `device` (an `array.array` of its kind: a memory copy)."""
    device = torch.device(device)
    packed = array.array(TYPECODES[dtype])
    for column in columns:
        same_kind = isinstance(column, array.array) and column.typecode == packed.typecode
        packed.extend(
            column if same_kind or not isinstance(column, array.array) else column.tolist()
        )
    flat = torch.frombuffer(packed, dtype=dtype) if packed else torch.empty(0, dtype=dtype)
    if device.type == "cuda":
        flat = flat.pin_memory()
    flat = flat.to(device, non_blocking=True)
    # not Tensor.split's Python wrapper
    return list(flat.split_with_sizes([len(column) for column in columns]))


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` in one pinned, non-blocking copy (on a CPU: the tensor itself)."""
    device = torch.device(device)
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def padded_rows(tables: list, width: int) -> array.array:
    """Each block table cut or zero-padded to `width` entries, row after row, as int32 (padding is
    never read: key counts stop short of it); packed `BlockTable`s go in as memory copies."""
    flat = array.array("i")
    for table in tables:
        row = table[:width]
        flat.extend(row)
        if len(row) < width:
            flat.frombytes(bytes(4 * (width - len(row))))
    return flat
