"""Seeded sampling from final probability rows: inverse CDF with one float64 uniform per row.
A row's token depends only on its probabilities and its uniform (from its own generator, else the
shared ``default_generator``), so a seeded request gets the same tokens alone or in any batch."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ssd_engine.utils.host_upload import to_device


def sample(
    probs: Tensor,
    generators: Sequence[torch.Generator | None],
    default_generator: torch.Generator | None = None,
    random_rows: Sequence[bool] | None = None,
) -> Tensor:
    """[n, V] probability rows (need not be normalised) -> [n] int64 tokens. random_rows[i]: row i
    draws one uniform (the others must be one-hot); None: decided by reading the rows back."""
    if random_rows is None:
        deterministic = (probs > 0).sum(dim=-1) == 1
        counts = (~deterministic).long().tolist()
    else:
        counts = [int(r) for r in random_rows]
    u = draw_uniforms(generators, counts, 1, probs.device, default_generator)
    # A one-hot row gets u = 0, which selects its only positive token: no RNG needed.
    return inverse_cdf(probs, u[:, 0])


def inverse_cdf(probs: Tensor, u: Tensor) -> Tensor:
    """Token i such that cdf[i-1] <= u * total < cdf[i], per row; never a zero-probability token.
    probs: [n, V] non-negative float32 rows with a positive total; u: [n] uniforms in [0, 1)."""
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    total = cdf[:, -1:]
    # the cap keeps the target below the total, so right=True finds a positive-probability token
    target = torch.minimum(u.to(torch.float64).unsqueeze(1) * total, total * (1 - 2.0**-53))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


def _rows_mask(rows: list[int], n: int) -> Tensor:
    mask = torch.zeros(n, 1, dtype=torch.bool)
    mask[rows] = True
    return mask


def draw_uniforms(
    generators: Sequence[torch.Generator | None],
    counts: Sequence[int],
    width: int,
    device: torch.device | str,
    default_generator: torch.Generator | None = None,
) -> Tensor:
    """[n, width] float64 uniforms in [0, 1) on `device`, zero past counts[i] <= width; rows without
    a generator draw from ``default_generator`` (else `device`'s RNG) in one call. Host draws cross
    in one non-blocking copy: writing into a device tensor would wait for the stream."""
    if len(generators) != len(counts):
        raise ValueError(f"got {len(generators)} generators for {len(counts)} rows")
    device = torch.device(device)
    n = len(counts)
    # [0]: host draws; [1]: 1 where the shared block goes
    host = torch.zeros(2, n, width, dtype=torch.float64)
    on_device, shared, from_host = [], [], []
    runs: list[
        list
    ] = []  # [generator, uniforms]: consecutive host rows of one generator draw in one call
    for row, (gen, count) in enumerate(zip(generators, counts)):
        if count == 0:
            continue
        if gen is None:
            shared.append(row)
        elif gen.device.type == "cpu":
            from_host.append(row)
            if runs and runs[-1][0] is gen:
                runs[-1][1] += count
            else:
                runs.append([gen, count])
        else:
            on_device.append((row, gen, count))
    if from_host or shared:
        # row-major cells: a run's one draw equals a draw per row (uniforms come in sequence)
        drawing = torch.arange(width) < torch.tensor(counts).unsqueeze(1)
        if from_host:
            host[0][drawing & _rows_mask(from_host, n)] = torch.cat(
                [torch.rand(count, generator=gen, dtype=torch.float64) for gen, count in runs]
            )
        if shared:
            host[1][drawing & _rows_mask(shared, n)] = 1.0
    block_device = default_generator.device if default_generator is not None else device
    if shared and block_device.type == "cpu":  # the shared draws are host draws too
        block = torch.rand(len(shared), width, generator=default_generator, dtype=torch.float64)
        rows = torch.tensor(shared)
        host[0, rows] = torch.where(host[1, rows] > 0, block, 0.0)
        shared = []
    u = to_device(host if shared else host[0], device)
    if shared:  # one block for the batch from the device generator, kept where a shared row draws
        block = torch.rand(
            n, width, generator=default_generator, device=block_device, dtype=torch.float64
        )
        u = torch.where(u[1] > 0, block, u[0])
    for row, gen, count in on_device:
        u[row, :count] = torch.rand(count, generator=gen, device=gen.device, dtype=torch.float64)
    return u
