"""Host lists to the device in one copy that does not stop the host.

`torch.tensor(values, device="cuda")` copies from pageable host memory, and such a copy first waits
for the stream to drain: a step that uploads its ids, positions, slots, key counts, query offsets
and block tables that way waits for the previous step's kernels five or six times before it can
queue its own. Here every column goes into one pinned staging tensor (int64, or int32 where every
value fits, as a step's inputs do) that torch's caching host allocator keeps alive until the copy
is done, and crosses in one non-blocking copy; columns are views of the device copy. On a CPU the
staging tensor is the result. `to_device` does the same for a tensor built on the host (uniforms
drawn from a request's host generator, counts a proposer knows).
"""
import array

import torch

# Python values packed by the array module: ~3x faster than torch.tensor(list), which checks each one
TYPECODES = {torch.long: "q", torch.int32: "i", torch.float32: "f", torch.float64: "d"}


def upload(columns: list, device: torch.device, dtype: torch.dtype = torch.long) -> list[torch.Tensor]:
    """One `dtype` tensor per column (a list of ints, or an `array.array`: one of `dtype`'s kind goes
    in as a memory copy), on `device`."""
    device = torch.device(device)
    packed = array.array(TYPECODES[dtype])
    for column in columns:
        same_kind = isinstance(column, array.array) and column.typecode == packed.typecode
        packed.extend(column if same_kind or not isinstance(column, array.array) else column.tolist())
    flat = torch.frombuffer(packed, dtype=dtype) if packed else torch.empty(0, dtype=dtype)
    if device.type == "cuda":
        flat = flat.pin_memory()
    flat = flat.to(device, non_blocking=True)  # on a CPU the same tensor (tests/instrumentation/sync_count.py marks it)
    return list(flat.split_with_sizes([len(column) for column in columns]))  # not Tensor.split's Python wrapper


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` in one pinned, non-blocking copy (on a CPU: the tensor itself)."""
    device = torch.device(device)
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def padded_rows(tables: list, width: int) -> array.array:
    """Each block table cut or zero-padded to `width` entries, row after row, as int32 (padding is
    never read: key counts stop short of it). Packed tables (core/structures.py `BlockTable`) go in as
    memory copies: 64 tables of 250 blocks in ~30 us, where Python lists of them took 0.6 ms."""
    flat = array.array("i")
    for table in tables:
        row = table[:width]
        flat.extend(row)
        if len(row) < width:
            flat.frombytes(bytes(4 * (width - len(row))))  # zeros
    return flat
